"""Every private TorchRL name zarr_rb relies on still exists in the installed TorchRL, and no
module but zarr_rb.torchrl.compat touches one: a TorchRL release that renames one fails here,
naming it and the TorchRL version, instead of breaking buffers quietly."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyTensorStorage,
    PrioritizedReplayBuffer,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers import checkpointers, samplers, writers
from torchrl.data.replay_buffers.storages import ListStorage, Storage, TensorStorage

import zarr_rb
from zarr_rb.torchrl import compat

# One live instance of each class compat.USED names: many of the names are instance
# attributes, set by the constructor.
INSTANCES = {
    TensorStorage: lambda: LazyTensorStorage(10),
    Storage: lambda: LazyTensorStorage(10),
    ListStorage: lambda: ListStorage(10),
    checkpointers.StorageCheckpointerBase: checkpointers.TensorStorageCheckpointer,
    ReplayBuffer: lambda: ReplayBuffer(storage=LazyTensorStorage(10)),
    PrioritizedReplayBuffer: lambda: PrioritizedReplayBuffer(alpha=0.7, beta=0.5),
    TensorDictPrioritizedReplayBuffer: lambda: TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5
    ),
    writers.Writer: writers.RoundRobinWriter,
    writers.RoundRobinWriter: writers.RoundRobinWriter,
    writers.TensorDictMaxValueWriter: lambda: writers.TensorDictMaxValueWriter(rank_key="r"),
    samplers.PrioritizedSampler: lambda: samplers.PrioritizedSampler(10, 0.7, 0.5),
    samplers.SamplerWithoutReplacement: samplers.SamplerWithoutReplacement,
    samplers.SliceSampler: lambda: samplers.SliceSampler(slice_len=2, traj_key="t"),
    samplers.StalenessAwareSampler: samplers.StalenessAwareSampler,
}

DECLARED = [(cls, name) for cls, names in compat.USED.items() for name in names]

STORAGE_CLASSES = [
    cls for cls in zarr_rb.ZarrStorage.__mro__ if cls.__module__.startswith("zarr_rb")
]
"""ZarrStorage and the classes of zarr_rb it derives from (its bookkeeping, writes, reads):
TorchRL subclasses, which override TorchRL's hooks and keep their own state."""


def _instance(cls: type):
    obj = INSTANCES[cls]()
    if isinstance(obj, ReplayBuffer) and not isinstance(obj, TensorDictReplayBuffer):
        obj.extend(TensorDict({"r": torch.zeros(2)}, [2]))  # fills lazily set attributes
    return obj


@pytest.mark.parametrize(("cls", "name"), DECLARED, ids=[f"{c.__name__}.{n}" for c, n in DECLARED])
def test_every_private_name_zarr_rb_uses_exists(cls: type, name: str) -> None:
    obj = _instance(cls)
    assert hasattr(obj, name) or hasattr(cls, name), (
        f"torchrl {compat.TORCHRL_VERSION}: {cls.__module__}.{cls.__qualname__}.{name} is "
        "gone; zarr_rb relies on it (see zarr_rb/torchrl/compat.py)"
    )


@pytest.mark.parametrize("name", sorted(compat.OVERRIDDEN))
def test_every_hook_zarr_storage_overrides_is_one_torchrl_calls(name: str) -> None:
    assert hasattr(TensorStorage, name), (
        f"torchrl {compat.TORCHRL_VERSION}: TensorStorage.{name} is gone; ZarrStorage "
        f"overrides it because {compat.OVERRIDDEN[name]}"
    )
    assert any(name in vars(cls) for cls in STORAGE_CLASSES)


def test_zarr_storage_takes_every_keyword_of_torchrl_lazy_storages() -> None:
    ours = set(inspect.signature(zarr_rb.ZarrStorage.__init__).parameters)
    from torchrl.data import LazyMemmapStorage

    for cls in (LazyMemmapStorage, LazyTensorStorage):
        theirs = set(inspect.signature(cls.__init__).parameters)
        assert theirs <= ours, (
            f"torchrl {compat.TORCHRL_VERSION}: {cls.__name__} takes {sorted(theirs - ours)}, "
            "which ZarrStorage does not"
        )


def _torchrl_private_names() -> set[str]:
    names: set[str] = set()
    import torchrl.data.replay_buffers as rb

    for module in (rb.storages, rb.samplers, rb.writers, rb.replay_buffers, rb.checkpointers):
        for obj in vars(module).values():
            if isinstance(obj, type) and obj.__module__.startswith("torchrl"):
                names.update(n for n in dir(obj) if n.startswith("_") and not n.startswith("__"))
    return names


def test_no_module_but_compat_touches_a_torchrl_private_name() -> None:
    """Attributes ``x._name`` that TorchRL's classes define may only be used in
    ``compat.py``, and in the modules of ZarrStorage's classes for the hooks they override
    and their own state."""
    torchrl_names = _torchrl_private_names()
    package = Path(zarr_rb.__file__).parent
    own_storage_names = set(compat.OVERRIDDEN).union(*(vars(cls) for cls in STORAGE_CLASSES))
    storage_files = {inspect.getfile(cls) for cls in STORAGE_CLASSES}
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "compat.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in torchrl_names:
                allowed = str(path) in storage_files and node.attr in own_storage_names
                if not allowed and not _defined_by_zarr_rb(node.attr):
                    offenders.append(f"{path.relative_to(package)}:{node.lineno} .{node.attr}")
    assert not offenders, "TorchRL private names outside _compat: " + ", ".join(offenders)


def _defined_by_zarr_rb(name: str) -> bool:
    """Whether one of zarr_rb's own classes (other than ZarrStorage's, TorchRL subclasses)
    defines ``name`` (its own private state)."""
    import importlib
    import pkgutil

    classes = []
    for module_info in pkgutil.walk_packages(zarr_rb.__path__, "zarr_rb."):
        if module_info.name.endswith("__main__"):
            continue  # running it is the command line
        module = importlib.import_module(module_info.name)
        classes.extend(
            obj
            for obj in vars(module).values()
            if isinstance(obj, type)
            and obj.__module__ == module.__name__
            and obj not in STORAGE_CLASSES
        )
    return any(name in vars(cls) or name in getattr(cls, "__annotations__", {}) for cls in classes)


def _private_torchrl_imports(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every private TorchRL or tensordict name ``source`` imports:
    ``from torchrl... import _name`` (aliased or not), and modules with a private part
    (``import torchrl._utils``, ``from tensordict._td import TensorDict``)."""

    def is_theirs(module: str) -> bool:
        return module.split(".")[0] in ("torchrl", "tensordict")

    def private_part(module: str) -> str | None:
        return next((part for part in module.split(".") if part.startswith("_")), None)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not is_theirs(node.module):
                continue
            if private_part(node.module):
                found.append((node.lineno, node.module))
            found.extend(
                (node.lineno, f"{node.module}.{alias.name}")
                for alias in node.names
                if alias.name.startswith("_")
            )
        elif isinstance(node, ast.Import):
            found.extend(
                (node.lineno, alias.name)
                for alias in node.names
                if is_theirs(alias.name) and private_part(alias.name)
            )
    return found


def test_the_import_scan_sees_every_form_of_a_private_import() -> None:
    source = (
        "from torchrl.data.utils import _a\n"
        "from torchrl.data.utils import public, _b as b\n"
        "from tensordict import (\n    x,\n    _c,\n)\n"
        "import torchrl._utils\n"
        "from tensordict._td import TensorDict\n"
        "def f():\n    from torchrl.envs import _d\n"
        "from torchrl.data import checkpointers as _public_module\n"
        "from zarr_rb.torchrl.compat import _e\n"
        "import torch._dynamo\n"
    )
    assert [line for line, _ in _private_torchrl_imports(source)] == [1, 2, 3, 7, 8, 10]


def test_no_module_but_compat_imports_a_torchrl_private_name() -> None:
    """``from torchrl... import _name`` anywhere in zarr_rb but ``compat.py`` (the
    attribute scan above does not see imports)."""
    package = Path(zarr_rb.__file__).parent
    offenders = [
        f"{path.relative_to(package)}:{line} {name}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "compat.py"
        for line, name in _private_torchrl_imports(path.read_text())
    ]
    assert not offenders, "TorchRL private names imported outside _compat: " + ", ".join(offenders)
