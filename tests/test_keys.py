"""Keys become Zarr node names: a key the format, Zarr, TensorStore or a filesystem cannot
hold is refused at the write that brings it, naming it, before anything is made on disk;
every other key is stored and read back, after a flush and a reopen too."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import assert_identical
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, tensorclass
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer

from zarr_rb import UnsupportedDataError, ZarrStorage
from zarr_rb.errors import KeyNameError

N = 3

REFUSED = {
    "zarr.json": "zarr.json",
    "zarr-v2-array": ".zarray",
    "zarr-v2-group": ".zgroup",
    "zarr-v2-attrs": ".zattrs",
    "consolidated": ".zmetadata",
    "lock-suffix": "frames.__lock",
    "lock-file": ".__lock",
    "dot": ".",
    "dot-dot": "..",
    "dots-only": "...",
    "dunder": "__private",
    "empty": "",
    "slash": "obs/pixels",
    "backslash": "obs\\pixels",
    "nul": "a\x00b",
    "newline": "a\nb",
    "tab": "a\tb",
    "escape": "\x1b[31m",
    "delete": "a\x7f",
    "c1-control": "a\x85b",
    "lone-surrogate": "a\ud800",
    "too-long": "x" * 256,
    "too-long-utf8": "é" * 128,  # 128 characters, 256 bytes
}

ACCEPTED = [
    "obs",
    "observation",
    "action",
    "reward",
    "done",
    "terminated",
    "_weight",
    "index",
    "Pixels",
    "x1",
    "0",
    "123",
    "a-b",
    "-",
    "a.b",
    "v1.2.3",
    ".hidden",
    "trailing.",
    "with space",
    " lead",
    "é",
    "観測",
    "🎮",
    "a:b",
    "a*b?",
    "CON",
    "c",
    "data",
    "lengths",
    "state",
    "tensor",
    "zarr",
    "zarr.json.bak",
    "x.tmp",
    "x.partial",
    "_",
    "_x_",
    "x__",
    "y" * 255,
    "é" * 127,
]


def td(keys: dict, n: int = N, start: int = 0) -> TensorDict:
    """``{key: rows}`` for nested keys given as tuples, each key its own values."""
    out = TensorDict(batch_size=[n])
    for i, key in enumerate(keys):
        out.set(key, torch.arange(start, start + n, dtype=torch.float32) + 100 * i)
    return out


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file of a store and its bytes (a missing store: nothing)."""
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def writer_state(rb) -> tuple:
    return (rb.writer._cursor, rb.writer._write_count)


def check_refused(rb, path: Path, write, key) -> None:
    """``write()`` raises a KeyNameError naming ``key`` and leaves store and writer as they
    were: the same files and bytes, the same length and cursor, no new key."""
    storage = rb.storage
    files, length, state = snapshot(path), len(storage), writer_state(rb)
    keys = None if not storage.initialized else [leaf.key for leaf in storage.schema.leaves]
    with pytest.raises(KeyNameError, match=r"(?i)rename") as info:
        write()
    assert repr(key) in str(info.value)
    assert info.value.key == key
    assert isinstance(info.value, UnsupportedDataError)
    assert isinstance(info.value, ValueError)
    assert snapshot(path) == files
    assert len(storage) == length
    assert writer_state(rb) == state
    assert storage.initialized == (keys is not None)
    if keys is not None:
        assert [leaf.key for leaf in storage.schema.leaves] == keys


def check_still_writes(rb, length: int, keys=("obs",)) -> None:
    """The storage takes good rows after a refusal, where they belong."""
    rows = td(keys, 2, start=50)
    index = rb.extend(rows)
    assert index.tolist() == [length, length + 1]
    assert len(rb) == length + 2
    assert_identical(rb.storage.get(index).select(*rows.keys(True, True)), rows)


# --- refused names, at the first write and as a new key later ---------------------------


@pytest.mark.parametrize("name", REFUSED.values(), ids=REFUSED.keys())
def test_a_refused_name_in_the_first_write_creates_nothing(store_path: Path, name) -> None:
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    check_refused(rb, store_path, lambda: rb.extend(td(["obs", name])), (name,))
    assert not rb.storage.initialized
    check_still_writes(rb, 0)


@pytest.mark.parametrize("name", REFUSED.values(), ids=REFUSED.keys())
def test_a_refused_name_as_a_new_nested_key_changes_nothing(store_path: Path, name) -> None:
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(td(["obs", ("next", "reward")]))
    rb.storage.flush()
    key = ("next", "deeper", name)
    check_refused(rb, store_path, lambda: rb.extend(td(["obs", ("next", "reward"), key])), key)
    check_still_writes(rb, N, keys=["obs", ("next", "reward")])


# --- every way a key reaches a store ------------------------------------------------------


@tensorclass
class Step:
    obs: torch.Tensor
    extra: TensorDict


def _step(name: str, n: int = N) -> Step:
    return Step(obs=torch.zeros(n, 2), extra=td([name], n), batch_size=[n])


WRITES = {
    "extend": lambda rb, name: rb.extend(td(["obs", name])),
    "add": lambda rb, name: rb.add(td(["obs", name], 1)[0]),
    "storage-set": lambda rb, name: rb.storage.set(torch.arange(N), td(["obs", name])),
    "storage-setitem": lambda rb, name: rb.storage.__setitem__(torch.arange(N), td(["obs", name])),
    "nested-depth-4": lambda rb, name: rb.extend(td(["obs", ("a", "b", "c", name)])),
    "tensorclass-field": lambda rb, name: rb.extend(_step(name)),
    "pytree-dict": lambda rb, name: rb.extend({"obs": torch.zeros(N), name: torch.zeros(N)}),
    "pytree-nested": lambda rb, name: rb.extend(
        {"obs": torch.zeros(N), "inner": [torch.zeros(N), {name: torch.zeros(N)}]}
    ),
}
KEY_OF = {
    "nested-depth-4": lambda name: ("a", "b", "c", name),
    "tensorclass-field": lambda name: ("extra", name),
    "pytree-nested": lambda name: ("inner", "1", name),
}


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
@pytest.mark.parametrize("name", ["zarr.json", "x.__lock", "a\\b"])
def test_every_first_write_refuses_a_bad_name(store_path: Path, write, name) -> None:
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    which = next(k for k, v in WRITES.items() if v is write)
    key = KEY_OF.get(which, lambda n: (n,))(name)
    check_refused(rb, store_path, lambda: write(rb, name), key)
    assert not rb.storage.initialized


@pytest.mark.parametrize(
    "write", ["extend", "add", "storage-set", "nested-depth-4"], ids=lambda name: name
)
def test_every_later_write_refuses_a_bad_new_key(store_path: Path, write) -> None:
    rb = TensorDictReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(td(["obs"]))
    rb.storage.flush()
    key = KEY_OF.get(write, lambda n: (n,))("zarr.json")
    check_refused(rb, store_path, lambda: WRITES[write](rb, "zarr.json"), key)
    check_still_writes(rb, N)


def test_a_patch_of_elements_refuses_a_bad_new_key(store_path: Path) -> None:
    """``storage[rows, envs] = ...`` of an ndim=2 storage may bring new keys too."""
    rb = ReplayBuffer(storage=ZarrStorage(12, store_path, ndim=2))
    rb.extend(TensorDict({"obs": torch.zeros(3, 2)}, [3, 2]))
    rb.storage.flush()
    patch = TensorDict({"obs": torch.ones(2), "x.__lock": torch.ones(2)}, [2])
    where = (torch.tensor([0, 1]), torch.tensor([1, 0]))
    check_refused(rb, store_path, lambda: rb.storage.set(where, patch), ("x.__lock",))


def test_the_message_says_what_is_wrong_and_how_to_fix_it(store_path: Path) -> None:
    storage = ZarrStorage(10, store_path)
    cases = {
        "zarr.json": "metadata",
        "x.__lock": "TensorStore",
        "a\\b": "separator",
        "a\nb": "control character",
        "...": "dots",
        "x" * 300: "255",
        "__x": "reserve",
    }
    for name, reason in cases.items():
        with pytest.raises(KeyNameError, match=reason) as info:
            storage.set(torch.arange(N), td(["obs", name]))
        assert "rename" in str(info.value).lower()
        assert re.search(r"letters, digits", str(info.value))


def test_a_key_too_long_as_a_whole_is_refused(store_path: Path) -> None:
    """Object stores cap a whole object key (S3: 1,024 bytes with the store's prefix and
    the chunk's key), even when each name is short enough for a filesystem."""
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    key = tuple(f"{i}" + "k" * 200 for i in range(3))
    check_refused(rb, store_path, lambda: rb.extend(td(["obs", key])), key)
    check_still_writes(rb, 0)


# --- keys that would share a node: arrays and groups, case, normalization -----------------


CLASHES = {
    # held keys, new keys, the key named in the error
    "key-over-group": (["obs", ("a", "b")], ["obs", "a"], ("a",)),
    "key-under-array": (["obs", "a"], ["obs", ("a", "c")], ("a", "c")),
    "deeper-under-array": (
        ["obs", ("n", "a")],
        ["obs", ("n", "a", "z", "y")],
        ("n", "a", "z", "y"),
    ),
    "case": (["obs"], ["obs", "OBS"], ("OBS",)),
    "case-of-a-group": (["obs", ("next", "r")], ["obs", ("Next", "d")], ("Next", "d")),
    "case-over-group": (["obs", ("a", "b")], ["obs", "A"], ("A",)),
    "normalization": (["obs", "caf\u00e9"], ["obs", "cafe\u0301"], ("cafe\u0301",)),
    "first-write-case": ([], ["obs", "Reward", "reward"], ("reward",)),
}


@pytest.mark.parametrize(("held", "new", "key"), CLASHES.values(), ids=CLASHES.keys())
def test_a_key_that_would_share_a_node_with_another_is_refused(
    store_path: Path, held, new, key
) -> None:
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    if held:
        rb.extend(td(held))
        rb.storage.flush()
    check_refused(rb, store_path, lambda: rb.extend(td(new)), key)
    if held:  # the rows held are intact (a key over a group once deleted the group's arrays)
        rb.storage.close()
        reopened = ZarrStorage(path=store_path, read_only=True)
        assert_identical(reopened.get(torch.arange(N)), td(held))
        reopened.close()


# --- accepted keys --------------------------------------------------------------------------


def test_ordinary_and_unusual_keys_round_trip_through_flush_and_reopen(store_path: Path) -> None:
    keys = [*ACCEPTED, ("next", "obs"), ("next", "c", "zarr"), ("a", "b", "c", "d", "e", "f")]
    data = td(keys, 4)
    ours = ReplayBuffer(storage=ZarrStorage(8, store_path))
    theirs = ReplayBuffer(storage=LazyTensorStorage(8))
    for rb in (ours, theirs):
        rb.extend(data)
    every = torch.arange(4)
    assert_identical(ours.storage.get(every), theirs.storage.get(every))
    ours.storage.close()
    reopened = ZarrStorage(path=store_path, read_only=True)
    assert_identical(reopened.get(every), data)
    reopened.close()


def test_accepted_keys_added_later_round_trip(store_path: Path) -> None:
    rb = ReplayBuffer(storage=ZarrStorage(8, store_path))
    rb.extend(td(["obs", ("next", "reward")]))
    later = ["obs", ("next", "reward"), ("next", "done"), "c", "d.e"]
    rb.extend(td(later, start=10))
    rb.storage.close()
    reopened = ZarrStorage(path=store_path, read_only=True)
    got = reopened.get(torch.arange(N, 2 * N))
    assert_identical(got, td(later, start=10))
    reopened.close()


def test_pytree_and_tensorclass_keys_round_trip(tmp_path: Path) -> None:
    tree = {"obs": torch.arange(4.0), "inner": [torch.ones(4), {"a.b": torch.zeros(4)}]}
    storage = ZarrStorage(8, tmp_path / "tree.zarr")
    storage.set(torch.arange(4), tree)
    storage.close()
    got = ZarrStorage(path=tmp_path / "tree.zarr", read_only=True).get(torch.arange(4))
    assert torch.equal(got["inner"][1]["a.b"], tree["inner"][1]["a.b"])
    step = _step("next", 4)
    storage = ZarrStorage(8, tmp_path / "tc.zarr")
    storage.set(torch.arange(4), step)
    storage.close()
    got = ZarrStorage(path=tmp_path / "tc.zarr", read_only=True).get(torch.arange(4))
    assert torch.equal(got.extra["next"], step.extra["next"])


def test_a_store_that_already_holds_a_refused_name_still_opens_and_takes_rows(
    store_path: Path, monkeypatch
) -> None:
    """Keys are checked when they are new: a store written before a rule existed (a name
    with a newline) keeps working, with its keys and with new ones."""
    from zarr_rb.torchrl import leaves

    with monkeypatch.context() as patch:
        patch.setattr(leaves, "check_new_keys", lambda *args, **kwargs: None)
        storage = ZarrStorage(10, store_path)
        storage.set(torch.arange(N), td(["obs", "a\nb", "Obs"]))
        storage.close()
    rb = TensorDictReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(td(["obs", "a\nb", "Obs", "new"], start=5))
    with pytest.raises(KeyNameError):
        rb.extend(td(["obs", "a\nb", "Obs", "a\tb"], start=5))
    rb.storage.close()
    reopened = ZarrStorage(path=store_path, read_only=True)
    assert reopened.get(torch.arange(N))["a\nb"].tolist() == [100.0, 101.0, 102.0]
    assert reopened.get(torch.arange(N, 2 * N))["new"].tolist() == [305.0, 306.0, 307.0]
    reopened.close()


def test_the_shipped_format_1_store_takes_rows_of_its_keys(tmp_path: Path) -> None:
    import shutil

    path = tmp_path / "format1.zarr"
    shutil.copytree(Path(__file__).parent / "data" / "format1.zarr", path)
    storage = ZarrStorage(path=path)
    rows = storage.get(torch.arange(2))
    storage.set(torch.arange(2), rows)
    storage.close()


# --- the whole key space --------------------------------------------------------------------


NAMES = st.one_of(
    st.text(min_size=0, max_size=12),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=8),
    st.sampled_from([*REFUSED.values(), *ACCEPTED[:20]]),
    st.builds(
        lambda a, b: a + b,
        st.sampled_from(["", ".", "__", "x"]),
        st.sampled_from([".__lock", ".", "zarr.json", "\\", "/", "\u0301", "\x00", ""]),
    ),
    st.text(alphabet="ab", min_size=250, max_size=260),
)
HELD = ["obs", ("next", "reward"), ("next", "Done")]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(parts=st.lists(NAMES, min_size=1, max_size=3), first=st.booleans())
def test_a_key_is_either_refused_untouched_or_read_back_after_reopen(parts, first) -> None:
    """No key is taken that then fails at the flush, loses rows or rewrites another key."""
    key = tuple(parts)
    with tempfile.TemporaryDirectory() as where:
        path = Path(where) / "s.zarr"
        rb = ReplayBuffer(storage=ZarrStorage(10, path))
        held = [] if first else HELD
        if held:
            rb.extend(td(held))
            rb.storage.flush()
        try:
            data = td([*held, key], start=N)
        except (KeyError, ValueError, TypeError, RuntimeError):
            event("TensorDict takes no such key")
            return
        files, length, state = snapshot(path), len(rb), writer_state(rb)
        try:
            index = rb.extend(data)
        except KeyNameError:
            event("refused")
            assert snapshot(path) == files
            assert (len(rb), writer_state(rb)) == (length, state)
            return
        event("stored")
        rb.storage.close()
        reopened = ZarrStorage(path=path, read_only=True)
        if held:
            assert_identical(reopened.get(torch.arange(N)).select(*held), td(held))
        assert_identical(reopened.get(index), data)
        reopened.close()


ORDINARY = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.",
    min_size=1,
    max_size=40,
).filter(
    # less the few such names the format or TensorStore keep for themselves
    lambda s: (
        set(s) != {"."}
        and not s.startswith("__")
        and not s.endswith(".__lock")
        and s not in {"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"}
    )
)


@settings(max_examples=25, deadline=None)
@given(names=st.lists(ORDINARY, min_size=1, max_size=4, unique_by=str.casefold))
def test_names_of_letters_digits_underscores_dashes_and_dots_are_taken(names) -> None:
    """What the Zarr specification recommends for names is always stored."""
    with tempfile.TemporaryDirectory() as where:
        path = Path(where) / "s.zarr"
        data = td(names)
        storage = ZarrStorage(10, path)
        storage.set(torch.arange(N), data)
        storage.close()
        reopened = ZarrStorage(path=path, read_only=True)
        assert_identical(reopened.get(torch.arange(N)), data)
        reopened.close()
