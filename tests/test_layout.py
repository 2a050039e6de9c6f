"""The layout of the package holds: no import cycle, no import up the
layers, no module reaching into another object's private state, no torch and no I/O
library in the pure records of ``format/``, and no file or class too long to read.

The checks read the sources with ``ast`` (nothing is imported), so they see every import:
those made only for type checking and those inside functions too. Each check is also
run on a small bad example, to show that it fails where it should.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import zarr_rb

PACKAGE = Path(zarr_rb.__file__).parent
ROOT = "zarr_rb"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "util", "_version", "format"),
    ("locations",),
    ("engine",),
    ("core",),
    ("torchrl", "storage"),
    ("state",),
    ("interop", "convert", "api", "verify"),
    ("analysis", "ray", "testing"),
    ("cli", "demo", "__main__", ""),
)
"""The layers of ``zarr_rb``, lowest first, by their first name under ``zarr_rb`` (``""``
is the package's ``__init__``, which names every public name; ``storage`` and ``convert``
are the old paths of ``ZarrStorage`` and of the dump conversions, kept as re-exports). A
module imports from its own layer and the layers below it only. ``format/`` (the store's
records, pure) is in the lowest layer: it imports nothing but :mod:`zarr_rb.errors`,
:mod:`zarr_rb.util` and itself. ``engine/`` (arrays, metadata, caches: TensorStore and
zarr-python) is below ``core/`` (the store: positions, commits, reads), which names it
through :class:`~zarr_rb.core.commits.StoreAPI` where a store's parts use the store;
``state/`` (one adapter per TorchRL component) is above ``torchrl/`` since it saves and
restores TorchRL's private state through ``torchrl/compat.py``."""

NO_PRIVATE_ACCESS = (
    "format",
    "core",
    "state",
    "torchrl",
    "interop",
    "engine",
    "locations",
    "testing",
    "util",
    "analysis",
)
"""Packages whose modules must not read or write ``obj._name`` of another object (nor may
the top-level modules)."""

PRIVATE_NAMES_OF_OTHERS = ("torchrl/compat.py",)
"""The one module that uses the private names of TorchRL's objects (and of torch and
tensordict under it), each declared and tested (``tests/test_compat.py``)."""

PURE = "format"
"""The package of pure records: no torch, no I/O (see :func:`impure_imports`)."""

PURE_MAY_IMPORT = ("numpy", "zarr_rb.errors", "zarr_rb.util", f"zarr_rb.{PURE}")
"""What :data:`PURE` imports besides the standard library."""

IO_MODULES = frozenset({"io", "os", "pathlib", "shutil", "socket", "subprocess", "tempfile"})
"""Modules of the standard library that do I/O, which :data:`PURE` does not import."""

TOO_LONG_YET: tuple[str, ...] = ()
"""Files still longer than :data:`MAX_FILE_LINES` (or with a class longer than
:data:`MAX_CLASS_LINES`): ``Store`` still holds its arrays, disk reads, saves and lifetime,
which are to move out of it. A file leaves this list as it is split; none joins it."""

MAX_FILE_LINES = 600
MAX_CLASS_LINES = 400


# --- the import graph ------------------------------------------------------------------


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """``zarr_rb/torchrl/storage.py`` -> ``zarr_rb.torchrl.storage``; a package's
    ``__init__.py`` is the package."""
    parts = [ROOT, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, *, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` (the module ``module``) imports, anywhere in
    it: relative imports resolved, ``from package import name`` as the module ``name`` when
    it is one, otherwise as the package."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == ROOT or alias.name.startswith(ROOT + "."):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            if base != ROOT and not base.startswith(ROOT + "."):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in known else base)
    found.discard(module)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Every module of the package under ``root``, and the package modules it imports."""
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    known = set(paths)
    return {
        name: imports_of(path.read_text(), name, is_package=path.name == "__init__.py", known=known)
        for name, path in paths.items()
    }


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one
    module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def _top(module: str) -> str:
    """The first name under ``zarr_rb`` (``""`` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(module: str) -> int:
    top = _top(module)
    for number, names in enumerate(LAYERS):
        if top in names:
            return number
    raise AssertionError(f"{module} is in no layer of LAYERS: add {top!r} to one")


def upward_imports(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """``a -> b`` for every import of ``b`` by ``a`` where ``b`` is in a higher layer."""
    return [
        f"{module} -> {imported}"
        for module in sorted(graph)
        for imported in sorted(graph[module])
        if layer(imported) > layer(module)
    ]


# --- private state of other objects ----------------------------------------------------


def private_accesses(source: str) -> list[str]:
    """``line: obj._name`` for every attribute ``_name`` (not a dunder) read or written on
    an object other than ``self``, ``cls`` or ``super()``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if (
            isinstance(owner, ast.Call)
            and isinstance(owner.func, ast.Name)
            and owner.func.id == "super"
        ):
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


# --- pure records ----------------------------------------------------------------------


def impure_imports(source: str) -> list[str]:
    """``line: module`` for every import of ``source`` that is neither the standard library
    (but :data:`IO_MODULES`) nor one of :data:`PURE_MAY_IMPORT` (relative imports are of
    the package itself)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.partition(".")[0]
            allowed = any(name == m or name.startswith(m + ".") for m in PURE_MAY_IMPORT)
            stdlib = top in sys.stdlib_module_names and top not in IO_MODULES
            if not (allowed or stdlib):
                found.append(f"{node.lineno}: {name}")
    return found


# --- lengths ---------------------------------------------------------------------------


def too_long(source: str) -> list[str]:
    """The file, if it has more than :data:`MAX_FILE_LINES` lines, and each class of more
    than :data:`MAX_CLASS_LINES`."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        found.append(f"{lines} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or start) - start + 1
            if length > MAX_CLASS_LINES:
                found.append(f"class {node.name}: {length} lines")
    return found


def _files_of(packages: Iterable[str]) -> list[Path]:
    return [path for name in packages for path in sorted((PACKAGE / name).rglob("*.py"))]


# --- the tests -------------------------------------------------------------------------


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = upward_imports(import_graph())
    assert not upward, "imports up the layers (see LAYERS): " + ", ".join(upward)


@pytest.mark.parametrize(
    "path",
    [*_files_of(NO_PRIVATE_ACCESS), *sorted(PACKAGE.glob("*.py"))],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_no_module_reaches_into_another_objects_private_state(path: Path) -> None:
    if str(path.relative_to(PACKAGE)) in PRIVATE_NAMES_OF_OTHERS:
        pytest.skip("the one module of TorchRL's private names")
    found = private_accesses(path.read_text())
    assert not found, f"{path.relative_to(PACKAGE)}: " + ", ".join(found)


@pytest.mark.parametrize(
    "path",
    sorted(PACKAGE.rglob("*.py")),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_no_file_or_class_is_too_long_to_read(path: Path) -> None:
    if str(path.relative_to(PACKAGE)) in TOO_LONG_YET:
        pytest.skip("being split (see TOO_LONG_YET)")
    found = too_long(path.read_text())
    assert not found, f"{path.relative_to(PACKAGE)}: " + ", ".join(found)


@pytest.mark.parametrize("path", _files_of((PURE,)), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_format_imports_no_torch_and_no_io(path: Path) -> None:
    found = impure_imports(path.read_text())
    assert not found, f"{path.relative_to(PACKAGE)} is not pure: imports " + ", ".join(found)


def test_every_module_is_in_a_layer() -> None:
    for module in import_graph():
        layer(module)


# --- each check fails where it should ---------------------------------------------------


def _write(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = root / ROOT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / ROOT


def test_the_graph_resolves_every_form_of_import(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "__init__.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from zarr_rb.torchrl.storage import ZarrStorage\n",
            "errors.py": "",
            "torchrl/__init__.py": "",
            "torchrl/storage.py": "from . import compat\nfrom .reads import Reads\n"
            "def f():\n    import zarr_rb.errors\n",
            "torchrl/compat.py": "from ..errors import X\n",
            "torchrl/reads.py": "from zarr_rb import errors, ZarrStorage\n",
            "demo.py": "from zarr_rb import ZarrStorage\nimport zarr_rb.torchrl.reads as r\n",
        },
    )
    assert import_graph(root) == {
        "zarr_rb": {"zarr_rb.torchrl.storage"},
        "zarr_rb.errors": set(),
        "zarr_rb.torchrl": set(),
        "zarr_rb.torchrl.storage": {
            "zarr_rb.torchrl.compat",
            "zarr_rb.torchrl.reads",
            "zarr_rb.errors",
        },
        "zarr_rb.torchrl.compat": {"zarr_rb.errors"},
        "zarr_rb.torchrl.reads": {"zarr_rb.errors", "zarr_rb"},
        "zarr_rb.demo": {"zarr_rb", "zarr_rb.torchrl.reads"},
    }


def test_a_cycle_is_found_even_through_a_type_checking_import(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "torchrl/__init__.py": "",
            "torchrl/storage.py": "from zarr_rb.torchrl.guards import guard\n",
            "torchrl/guards.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from zarr_rb.torchrl.storage import ZarrStorage\n",
            "core/__init__.py": "",
            "core/a.py": "import zarr_rb.core.b\n",
            "core/b.py": "from zarr_rb.core import a\n",
        },
    )
    graph = import_graph(root)
    assert cycles(graph) == [
        ["zarr_rb.core.a", "zarr_rb.core.b"],
        ["zarr_rb.torchrl.guards", "zarr_rb.torchrl.storage"],
    ]


def test_an_import_up_the_layers_is_found() -> None:
    graph = {
        "zarr_rb.core.store": {"zarr_rb.errors", "zarr_rb.torchrl.compat"},
        "zarr_rb.state": {"zarr_rb.torchrl.compat"},
        "zarr_rb.locations.base": {"zarr_rb.api"},
        "zarr_rb.torchrl.compat": set(),
        "zarr_rb.errors": set(),
        "zarr_rb.api": set(),
    }
    assert upward_imports(graph) == [
        "zarr_rb.core.store -> zarr_rb.torchrl.compat",
        "zarr_rb.locations.base -> zarr_rb.api",
    ]


def test_private_state_of_other_objects_is_found() -> None:
    source = (
        "class A:\n"
        "    def f(self, storage, cls):\n"
        "        self._a = storage._store\n"
        "        storage._thread_state.draw = 1\n"
        "        cls._b, super()._c, self.__dict__\n"
        "        return self._owner._where, _module._helper(), other.__len__()\n"
    )
    assert private_accesses(source) == [
        "3: storage._store",
        "4: storage._thread_state",
        "6: self._owner._where",
        "6: _module._helper",
    ]


def test_impure_imports_are_found() -> None:
    source = (
        "from __future__ import annotations\n"
        "import numpy as np\n"
        "import re, zlib\n"
        "from . import runs\n"
        "from zarr_rb.errors import StoreCorruptedError\n"
        "from zarr_rb.format.ring import SlotMap\n"
        "import torch\n"
        "from pathlib import Path\n"
        "def f():\n    import zarr_rb.core.store\n"
    )
    assert impure_imports(source) == ["7: torch", "8: pathlib", "10: zarr_rb.core.store"]


def test_long_files_and_classes_are_found() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    assert too_long("class Short:\n    x = 1\n") == []
    assert too_long(f"class Long:\n{body}") == [f"class Long: {MAX_CLASS_LINES + 1} lines"]
    lines = "x = 1\n" * (MAX_FILE_LINES + 1)
    assert too_long(lines) == [f"{MAX_FILE_LINES + 1} lines"]
