"""Every kind of row TorchRL buffers hold, stored by ZarrStorage and returned exactly as
TorchRL's own storage returns it: strings, bytes and Python scalars per row (as
LazyTensorStorage), rows of different lengths (as LazyStackStorage), pytrees (as
LazyTensorStorage); bad input gets a typed error naming the key and leaves the storage
unchanged."""

from __future__ import annotations

import json
import math
import re
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import chunk_files
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kinds import assert_same_rows, assert_same_samples, row_leaves, token_rows, values
from sample_runner import python_c
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    is_leaf_nontensor,
    lazy_stack,
    tensorclass,
)
from torchrl.data import (
    LazyStackStorage,
    LazyTensorStorage,
    PrioritizedSampler,
    ReplayBuffer,
    SliceSampler,
    TensorDictReplayBuffer,
)

import zarr_rb
from zarr_rb import (
    NotSupportedError,
    SchemaMismatchError,
    StoreCorruptedError,
    UnsupportedDataError,
    ZarrStorage,
)

# --- strings, bytes and Python scalars per row --------------------------------------------

KINDS = {
    "str": lambda i: ["", "a", "é ✓ 中文", "x" * 300, "\x00nul"][i % 5],
    "bytes": lambda i: [b"", b"\xff\x00\xfe", b"plain", bytes(range(256))][i % 4],
    "int": lambda i: [0, -1, 2**62, -(2**63), 7][i % 5],
    "float": lambda i: [0.0, -0.0, 1e300, float("inf"), -2.5][i % 5],
    "bool": lambda i: i % 3 == 0,
    "none": lambda i: None,
}


def rows_of_every_kind(n: int, start: int = 0) -> TensorDict:
    return TensorDict(
        {
            "obs": torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 3),
            **{kind: values([make(start + i) for i in range(n)]) for kind, make in KINDS.items()},
            "nested": {"text": values([f"row {start + i}" for i in range(n)])},
        },
        [n],
    )


def both(
    max_size: int, path: Path, theirs: type = LazyTensorStorage, **kwargs
) -> tuple[ReplayBuffer, ReplayBuffer]:
    """The same buffer on ZarrStorage and on one of TorchRL's storages."""
    ours = ReplayBuffer(storage=ZarrStorage(max_size, path), **kwargs)
    return ours, ReplayBuffer(storage=theirs(max_size), **kwargs)


def test_python_values_per_row_come_back_as_lazy_tensor_storage_returns_them(store_path):
    ours, theirs = both(8, store_path, batch_size=5)
    for start, n in [(0, 5), (5, 1), (6, 6)]:  # a batch, one row, then around the ring
        for rb in (ours, theirs):
            rb.extend(rows_of_every_kind(n, start))
    assert_same_rows(ours.storage.get(torch.arange(8)), theirs.storage.get(torch.arange(8)))
    assert_same_samples(ours, theirs)
    assert_same_rows(ours.storage[3], theirs.storage[3])  # one row: NonTensorData per key
    assert list(ours.storage.get("str")) == list(theirs.storage.get("str"))
    # Bit for bit: -0.0 keeps its sign (LazyTensorStorage folds rows of equal values).
    assert [math.copysign(1, v) for v in ours.storage.get("float")][:2] == [1, -1]


def test_a_tensorclass_with_a_string_field_round_trips(store_path):
    @tensorclass
    class Turn:
        tokens: torch.Tensor
        speaker: str

    data = Turn(tokens=torch.arange(12).reshape(4, 3), speaker=["a", "bb", "", "é"], batch_size=[4])
    ours = ReplayBuffer(storage=ZarrStorage(10, store_path))
    theirs = ReplayBuffer(storage=LazyTensorStorage(10))
    ours.extend(data)
    theirs.extend(data)
    got, expected = ours.storage.get(torch.arange(4)), theirs.storage.get(torch.arange(4))
    assert type(got) is type(expected) is Turn
    assert got.speaker == expected.speaker == ["a", "bb", "", "é"]
    assert torch.equal(got.tokens, expected.tokens)


READ_BACK = textwrap.dedent(
    """
    import json, sys, torch
    from zarr_rb import ZarrStorage
    from kinds import row_leaves
    storage = ZarrStorage(path=sys.argv[1], read_only=True)
    rows = storage.get(torch.arange(len(storage)))
    leaves = [sorted(row_leaves(rows[i]).items(), key=repr) for i in range(len(storage))]
    print(json.dumps([repr(row) for row in leaves]))
    """
)


def test_values_and_ragged_rows_read_back_in_another_process(tmp_path):
    tests = Path(__file__).parent
    for name, data in {
        "values.zarr": rows_of_every_kind(6),
        "ragged.zarr": token_rows([3, 17, 1, 40]),
    }.items():
        path = tmp_path / name
        with ZarrStorage(10, path) as storage:
            ReplayBuffer(storage=storage).extend(data)
            expected = storage.get(torch.arange(len(data)))
            zarr_rb.save(ReplayBuffer(storage=storage))
        done = python_c(READ_BACK, str(path), cwd=tests)
        assert done.returncode == 0, done.stderr[-3000:]
        out = done.stdout
        theirs = json.loads(out.strip().splitlines()[-1])
        ours = [repr(sorted(row_leaves(expected[i]).items(), key=repr)) for i in range(len(data))]
        assert theirs == ours


# A random schema of tensors and Python values, nested, every key read back.
LEAF_KINDS = st.sampled_from(
    ["f32", "i64", "f32x2", "u8x2x3", "str", "bytes", "int", "float", "bool", "none"]
)
NAMES = st.text(alphabet="abcxyz_", min_size=1, max_size=4).filter(lambda n: not n.startswith("__"))


def make_leaf(kind: str, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if kind == "f32":
        return torch.randn(n, generator=g)
    if kind == "i64":
        return torch.randint(-(2**40), 2**40, (n,), generator=g)
    if kind == "f32x2":
        return torch.randn(n, 2, generator=g)
    if kind == "u8x2x3":
        return torch.randint(0, 256, (n, 2, 3), generator=g, dtype=torch.uint8)
    return values([KINDS[kind](seed + i) for i in range(n)])


SCHEMAS = st.dictionaries(
    NAMES, st.one_of(LEAF_KINDS, st.dictionaries(NAMES, LEAF_KINDS, min_size=1, max_size=3)),
    min_size=1, max_size=4,
)  # fmt: skip


def build(schema: dict, n: int, seed: int) -> TensorDict:
    return TensorDict(
        {
            key: build(kind, n, seed + 1) if isinstance(kind, dict) else make_leaf(kind, n, seed)
            for key, kind in schema.items()
        },
        [n],
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, sizes=st.lists(st.integers(1, 7), min_size=1, max_size=3))
def test_every_key_written_is_read_back(schema, sizes):
    with tempfile.TemporaryDirectory() as where:
        ours, theirs = both(9, Path(where) / "s.zarr")
        written = set()
        for seed, n in enumerate(sizes):
            data = build(schema, n, seed * 10)
            written |= set(data.keys(True, True, is_leaf=is_leaf_nontensor))
            ours.extend(data)
            theirs.extend(data)
        everything = torch.arange(len(theirs))
        got = ours.storage.get(everything)
        assert set(got.keys(True, True, is_leaf=is_leaf_nontensor)) == written
        assert_same_rows(got, theirs.storage.get(everything))
        ours.storage.close()
        reopened = ZarrStorage(path=Path(where) / "s.zarr", read_only=True)
        assert_same_rows(reopened.get(everything), theirs.storage.get(everything))
        reopened.close()


def test_a_python_object_that_is_no_value_is_refused_naming_its_key(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(rows_of_every_kind(2))
    bad = rows_of_every_kind(2, 2)
    bad["nested", "text"] = values([{"a": 1}, {"a": 2}])
    with pytest.raises(UnsupportedDataError, match=r"nested.*text"):
        rb.extend(bad)
    bad["nested", "text"] = values([object(), object()])
    with pytest.raises(UnsupportedDataError, match=r"nested.*text"):
        rb.extend(bad)
    assert len(rb) == 2
    assert_same_rows(rb.storage.get(torch.arange(2)), rows_of_every_kind(2))


def test_a_string_that_utf8_cannot_encode_is_refused_and_nothing_is_written(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(rows_of_every_kind(3))
    bad = rows_of_every_kind(2, 3)
    bad["str"] = values(["fine", "lone surrogate \ud800"])
    with pytest.raises(UnsupportedDataError, match=r"\('str',\).*not valid Unicode"):
        rb.extend(bad)
    assert len(rb) == 3
    assert_same_rows(rb.storage.get(torch.arange(3)), rows_of_every_kind(3))
    rb.extend(rows_of_every_kind(2, 3))  # the storage still takes good rows where they belong
    assert_same_rows(rb.storage.get(torch.arange(5)), rows_of_every_kind(5))


@pytest.mark.parametrize(
    ("key", "replacement"),
    [
        ("str", [b"bytes", b"now"]),
        ("int", [1.5, 2.5]),
        ("bool", [1, 0]),
        ("none", ["x", "y"]),
    ],
)
def test_a_later_row_of_another_value_type_is_refused(store_path, key, replacement):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(rows_of_every_kind(3))
    bad = rows_of_every_kind(2, 3)
    bad[key] = values(replacement)
    with pytest.raises(SchemaMismatchError, match=re.escape(repr((key,)))):
        rb.extend(bad)
    assert len(rb) == 3
    assert_same_rows(rb.storage.get(torch.arange(3)), rows_of_every_kind(3))


def test_one_batch_of_mixed_value_types_under_one_key_is_refused(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    bad = rows_of_every_kind(2)
    bad["str"] = values(["text", 3])
    with pytest.raises(UnsupportedDataError, match=r"\('str',\).*several types"):
        rb.extend(bad)
    assert len(rb) == 0


# --- rows of different lengths ------------------------------------------------------------


def test_ragged_rows_come_back_as_lazy_stack_storage_returns_them(store_path):
    ours, theirs = both(6, store_path, LazyStackStorage, batch_size=4)
    writes = [token_rows([5, 1, 30], seed=1), token_rows([2], seed=2)]
    writes += [token_rows([7, 90, 3, 1], seed=3)]  # wraps: shorter rows over longer ones
    for data in writes:
        for rb in (ours, theirs):
            rb.extend(data)
    ours.add(token_rows([12], seed=4)[0])
    theirs.add(token_rows([12], seed=4)[0])
    everything = torch.arange(6)
    assert_same_rows(ours.storage.get(everything), theirs.storage.get(everything))
    assert_same_rows(ours.storage[2], theirs.storage[2])
    for seed in range(4):
        ours.set_rng(torch.Generator().manual_seed(seed))
        theirs.set_rng(torch.Generator().manual_seed(seed))
        sample, info = ours.sample(return_info=True)
        expected, expected_info = theirs.sample(return_info=True)
        assert_same_rows(sample, expected)
        assert torch.equal(info["index"], expected_info["index"])
    tokens = ours.storage.get("tokens")
    assert [t.tolist() for t in tokens] == [r["tokens"].tolist() for r in theirs.storage[:]]
    ours.storage.close()
    reopened = ZarrStorage(path=store_path, read_only=True)
    assert_same_rows(reopened.get(everything), theirs.storage.get(everything))


def test_a_ragged_store_reads_only_the_chunks_of_the_rows_asked_for(store_path):
    lengths = [16] + [6000] * 40
    with ZarrStorage(100, store_path) as storage:
        ReplayBuffer(storage=storage).extend(token_rows(lengths))
        storage.flush()
    shards = chunk_files(store_path, "data/tokens")
    beyond_first = [p for p in shards if not p.name.endswith(".0")]
    assert beyond_first, "rows of 6000 tokens span several shards along their length"
    for path in beyond_first:
        path.unlink()  # a read that touched these would fail: missing chunks are errors
    reopened = ZarrStorage(path=store_path, read_only=True)
    row = reopened.get(torch.tensor([0]))
    assert row[0]["tokens"].tolist() == token_rows(lengths)[0]["tokens"].tolist()
    with pytest.raises(StoreCorruptedError):
        reopened.get(torch.tensor([1]))


def test_prioritized_and_slice_samplers_on_ragged_rows_match_lazy_stack_storage(store_path):
    rows = token_rows([3, 8, 1, 20, 6, 6, 2, 9])
    rows.set("episode", torch.tensor([0, 0, 0, 1, 1, 1, 1, 2]))
    for make in (
        lambda: PrioritizedSampler(8, alpha=0.7, beta=0.5),
        lambda: SliceSampler(slice_len=2, traj_key="episode"),
    ):
        path = store_path.with_name(f"s{id(make)}.zarr")
        ours = ReplayBuffer(storage=ZarrStorage(8, path), sampler=make(), batch_size=4)
        theirs = ReplayBuffer(storage=LazyStackStorage(8), sampler=make(), batch_size=4)
        for rb in (ours, theirs):
            rb.extend(rows)
            if isinstance(rb.sampler, PrioritizedSampler):
                rb.update_priority(torch.arange(8), torch.arange(1.0, 9.0))
        assert_same_samples(ours, theirs)
        zarr_rb.save(ours)
        loaded = zarr_rb.load(path)
        loaded.set_rng(torch.Generator().manual_seed(9))
        theirs.set_rng(torch.Generator().manual_seed(9))
        assert_same_rows(loaded.sample(), theirs.sample())


def test_a_fixed_key_later_given_rows_of_different_lengths_is_refused(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(token_rows([4, 4]))  # every row of length 4: stored as a fixed-shape column
    with pytest.raises(SchemaMismatchError, match=r"\('tokens',\).*ragged=\['tokens'\]"):
        rb.extend(token_rows([4, 9], seed=1))
    assert len(rb) == 2
    assert_same_rows(rb.storage.get(torch.arange(2)), token_rows([4, 4]).contiguous())


def test_declared_ragged_keys_take_rows_of_any_length_later(store_path):
    ours = ReplayBuffer(storage=ZarrStorage(10, store_path, ragged=["tokens"]))
    theirs = ReplayBuffer(storage=LazyStackStorage(10))
    for data in (token_rows([4, 4]), token_rows([4, 9], seed=1)):
        ours.extend(data)
        theirs.extend(data)
    assert_same_rows(ours.storage.get(torch.arange(4)), theirs.storage.get(torch.arange(4)))


def test_a_key_holding_tensors_in_some_rows_and_values_in_others_is_refused(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(token_rows([2, 3]))
    rows = token_rows([2, 3], seed=5)
    rows.tensordicts[1]["tokens"] = NonTensorData("not tokens")
    with pytest.raises((UnsupportedDataError, SchemaMismatchError), match=r"\('tokens',\)"):
        rb.extend(rows)
    assert len(rb) == 2
    assert_same_rows(rb.storage.get(torch.arange(2)), token_rows([2, 3]))


def test_rows_with_other_keys_are_refused(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rows = token_rows([2, 3])
    del rows.tensordicts[1]["reward"]
    with pytest.raises(UnsupportedDataError, match="reward"):
        rb.extend(rows)
    assert len(rb) == 0


def test_the_lazy_view_reads_values_and_says_how_to_read_ragged_rows(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rows = token_rows([2, 3, 7])
    rb.extend(rows)
    view = rb.storage[:]
    assert view["reward"].shape == (3,)  # fixed columns stay lazy tensors
    prompts = [row["prompt"] for row in rows.unbind(0)]
    assert view["prompt"].tolist() == prompts  # values: read when asked for, as lists
    assert list(view["prompt"]) == prompts
    assert view["prompt"][1].tolist() == prompts[1]
    with pytest.raises(NotSupportedError, match=r"tolist\(\)"):
        view["prompt"].materialize()  # not as a tensor
    with pytest.raises(NotSupportedError, match=r"storage\.get"):
        view["tokens"].materialize()
    with pytest.raises(NotSupportedError, match=r"storage\.get"):
        view["tokens"].tolist()


@pytest.mark.parametrize(
    ("group_key", "strategy"), [("prompt", "random"), ("query_id", "random"), ("prompt", "recency")]
)
def test_torchrl_prompt_group_sampler_draws_as_on_lazy_stack_storage(
    store_path, group_key, strategy
):
    from torchrl.data.replay_buffers.samplers import PromptGroupSampler

    rows = token_rows([3, 8, 1, 20, 6, 6, 2, 9, 4, 4, 7, 30])
    rows.set("query_id", torch.arange(12) // 3)
    for i, row in enumerate(rows.unbind(0)):
        row["prompt"] = f"question {i // 3}"  # three answers per question

    def sampler() -> PromptGroupSampler:
        return PromptGroupSampler(num_groups=2, group_key=group_key, strategy=strategy)

    ours = ReplayBuffer(storage=ZarrStorage(20, store_path), sampler=sampler(), batch_size=6)
    theirs = ReplayBuffer(storage=LazyStackStorage(20), sampler=sampler(), batch_size=6)
    for rb in (ours, theirs):
        rb.extend(rows)
    for seed in range(3):
        ours.set_rng(torch.Generator().manual_seed(seed))
        theirs.set_rng(torch.Generator().manual_seed(seed))
        sample, info = ours.sample(return_info=True)
        expected, expected_info = theirs.sample(return_info=True)
        assert torch.equal(info["index"], expected_info["index"])
        assert_same_rows(sample, expected)
    zarr_rb.save(ours)  # the GRPO sampler is saved and loaded with the buffer
    loaded = zarr_rb.load(store_path)
    assert isinstance(loaded.sampler, PromptGroupSampler)
    assert loaded.sampler.group_key == group_key
    loaded.set_rng(torch.Generator().manual_seed(7))
    theirs.set_rng(torch.Generator().manual_seed(7))
    assert_same_rows(loaded.sample(), theirs.sample())


def test_state_dict_moves_ragged_rows_to_and_from_lazy_stack_storage(store_path):
    rows = token_rows([3, 1, 12])
    ours = ZarrStorage(10, store_path)
    ReplayBuffer(storage=ours).extend(rows)
    theirs = LazyStackStorage(10)
    theirs.load_state_dict(ours.state_dict())
    assert_same_rows(theirs.get(torch.arange(3)), ours.get(torch.arange(3)))
    # TensorDict.state_dict() leaves NonTensorData out, so LazyStackStorage's state has
    # no strings to give: the way back carries the tensors.
    tensors = LazyStackStorage(10)
    tensors.set(torch.arange(3), rows.exclude("prompt"))
    back = ZarrStorage(10, store_path.with_name("back.zarr"))
    back.load_state_dict(tensors.state_dict())
    assert_same_rows(back.get(torch.arange(3)), tensors.get(torch.arange(3)))
    assert len(back) == 3


def test_verify_reads_ragged_rows_and_catches_lengths_past_their_array(store_path):
    with ZarrStorage(10, store_path) as storage:
        rb = ReplayBuffer(storage=storage)
        rb.extend(token_rows([3, 1, 12]))
        zarr_rb.save(rb)
    assert zarr_rb.verify(store_path).ok
    # A hostile lengths array: a row claims more tokens than its array holds.
    import tensorstore as ts

    lengths = ts.open({"driver": "zarr3", "kvstore": f"file://{store_path}/lengths/tokens"})
    array = lengths.result()
    array[1] = 10**9
    with pytest.raises(StoreCorruptedError, match="tokens"):
        ZarrStorage(path=store_path, read_only=True).get(torch.tensor([1]))
    assert not zarr_rb.verify(store_path).ok


# --- pytrees -------------------------------------------------------------------------------


def pytree(n: int, start: int):
    r = torch.arange(start, start + n)
    return {"a": r.float(), "b": (r[:, None].expand(n, 2).clone(), [r.double(), {"c": -r}])}


def test_pytrees_round_trip_and_sample_as_lazy_tensor_storage(store_path):
    ours, theirs = both(7, store_path, batch_size=4)
    for start, n in [(0, 4), (4, 5)]:
        for rb in (ours, theirs):
            rb.extend(pytree(n, start))
    everything = torch.arange(7)
    assert_same_rows(ours.storage.get(everything), theirs.storage.get(everything))
    assert_same_samples(ours, theirs)
    zarr_rb.save(ours)
    loaded = zarr_rb.load(store_path)
    assert_same_rows(loaded.storage.get(everything), theirs.storage.get(everything))


def test_a_tensordict_buffer_of_strings_keeps_them_through_save_and_load(store_path):
    rb = TensorDictReplayBuffer(storage=ZarrStorage(100, store_path), batch_size=4)
    rb.extend(rows_of_every_kind(10))
    zarr_rb.save(rb)
    loaded = zarr_rb.load(store_path)
    everything = torch.arange(10)
    assert_same_rows(loaded.storage.get(everything), rb.storage.get(everything))
    assert loaded.storage.get(everything)["str"][2] == "é ✓ 中文"


def test_a_lazy_stack_of_equal_rows_is_stored_as_fixed_columns(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(lazy_stack([TensorDict({"x": torch.ones(3)}), TensorDict({"x": torch.zeros(3)})]))
    assert rb.storage[:]["x"].shape == (2, 3)


# --- stores of the format before ----------------------------------------------------------

FORMAT_1 = Path(__file__).parent / "data" / "format1.zarr"
"""A store written by zarr_rb's format 1 (tensor leaves only): a prioritized buffer of 24
rows, saved (obs = arange bytes, reward = step / 4, done every fifth step, priority step + 1)."""


def test_a_store_of_format_1_opens_loads_and_takes_strings(tmp_path):
    import shutil

    path = tmp_path / "old.zarr"
    shutil.copytree(FORMAT_1, path)
    assert json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]["format"] == 1
    rb = zarr_rb.load(path)
    assert len(rb) == 24
    rows = rb.storage.get(torch.arange(24))
    assert torch.equal(rows["obs"], torch.arange(24 * 6, dtype=torch.uint8).reshape(24, 2, 3))
    assert torch.equal(rows["reward"], torch.arange(24, dtype=torch.float32) / 4)
    assert torch.equal(rows["next", "done"][:, 0], torch.arange(24) % 5 == 4)
    # The priorities stored (p ** 0.7), rounded once to float32: float32 pow is off by an ulp
    # on some CPUs.
    stored = (torch.arange(1.0, 25.0, dtype=torch.float64) ** 0.7).float()
    assert torch.equal(rb.sampler._sum_tree[torch.arange(24)], stored)
    more = rows[:2].clone()
    more["note"] = values(["new", "keys"])  # a new kind of leaf on an old store
    rb.extend(more)
    zarr_rb.save(rb)
    # Leaves format 1 cannot read: an older zarr_rb must refuse the store from now on.
    assert json.loads((path / "zarr.json").read_text())["attributes"]["zarr_rb"]["format"] == 2
    again = zarr_rb.load(path, read_only=True)
    assert list(again.storage.get(torch.arange(24, 26))["note"]) == ["new", "keys"]
    assert torch.equal(again.storage.get(torch.arange(24))["obs"], rows["obs"])


def test_elements_of_different_shapes_inside_a_row_are_refused(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    inner = LazyStackedTensorDict(
        TensorDict(a=torch.rand(5, 4, 8), batch_size=5),
        TensorDict(a=torch.rand(5, 3, 8), batch_size=5),
        stack_dim=1,
    )  # each row: two elements whose "a" differ in shape
    with pytest.raises(UnsupportedDataError, match="lazy stack"):
        rb.extend(inner)
    assert len(rb) == 0
    rb.extend(TensorDict(a=torch.rand(2, 2, 4, 8), batch_size=[2, 2]))  # fine afterwards
    assert len(rb) == 2


def test_export_to_torchrl_refuses_what_its_layout_cannot_keep(store_path, tmp_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(token_rows([3, 1, 12]))
    zarr_rb.save(rb)
    with pytest.raises(NotSupportedError, match=r"rows of different lengths at \('tokens',\)"):
        zarr_rb.export_torchrl(store_path, tmp_path / "dump", progress=False)
    assert not (tmp_path / "dump").exists()


def test_a_ragged_buffer_snapshots_dumps_and_loads(store_path, tmp_path):
    rb = TensorDictReplayBuffer(storage=ZarrStorage(10, store_path), batch_size=2)
    rb.extend(token_rows([3, 1, 12, 40]))
    every = torch.arange(4)
    snapshot = zarr_rb.load(zarr_rb.save(rb, tmp_path / "snapshot.zarr"))
    assert_same_rows(snapshot.storage.get(every), rb.storage.get(every))
    rb.dumps(tmp_path / "dump")
    other = TensorDictReplayBuffer(storage=ZarrStorage(10, tmp_path / "other.zarr"), batch_size=2)
    other.loads(tmp_path / "dump")
    assert_same_rows(other.storage.get(every), rb.storage.get(every))


# --- refused writes leave the storage and TorchRL's writer as they were -------------------


def test_a_row_read_twice_comes_back_as_stored_even_if_the_first_was_changed(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(rows_of_every_kind(3))
    index = torch.tensor([0, 2])
    first = rb.storage.get(index)
    first["str"] = values(["changed", "changed"])
    again = rb.storage.get(index)
    assert list(again["str"]) == [KINDS["str"](0), KINDS["str"](2)]


def test_refused_lists_and_out_of_range_ints_leave_the_writer_where_it_was(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(rows_of_every_kind(2))
    with pytest.raises(UnsupportedDataError):
        rb.extend([{"obs": torch.ones(3), "str": "a"}, {"obs": torch.ones(3), "str": "b"}])
    bad = rows_of_every_kind(2, 2)
    bad["int"] = values([1, 2**64])
    with pytest.raises(UnsupportedDataError, match=r"\('int',\).*outside int64"):
        rb.extend(bad)
    rb.extend(rows_of_every_kind(2, 2))  # lands at rows 2 and 3, where it belongs
    assert len(rb) == 4
    assert_same_rows(rb.storage.get(torch.arange(4)), rows_of_every_kind(4))


def test_a_refused_write_leaves_a_max_value_writer_as_it_was(store_path):
    from torchrl.data import TensorDictMaxValueWriter

    rb = TensorDictReplayBuffer(
        storage=ZarrStorage(4, store_path), writer=TensorDictMaxValueWriter(rank_key="r")
    )
    rb.extend(TensorDict({"r": torch.tensor([1.0, 2.0]), "s": values(["a", "b"])}, [2]))
    with pytest.raises(UnsupportedDataError):
        rb.extend(TensorDict({"r": torch.tensor([3.0, 4.0]), "s": values(["c", "\ud800"])}, [2]))
    rb.extend(TensorDict({"r": torch.tensor([0.5]), "s": values(["kept"])}, [1]))
    assert len(rb) == 3
    assert sorted(rb.storage.get(torch.arange(3))["r"].tolist()) == [0.5, 1.0, 2.0]


def test_a_refused_first_write_creates_nothing(store_path):
    rb = ReplayBuffer(storage=ZarrStorage(10, store_path))
    bad = rows_of_every_kind(2)
    bad["str"] = values(["a", "\ud800"])
    with pytest.raises(UnsupportedDataError):
        rb.extend(bad)
    assert not rb.storage.initialized
    other = TensorDict({"obs": torch.arange(4, dtype=torch.int16)}, [4])  # another schema
    rb.extend(other)
    assert torch.equal(rb.storage.get(torch.arange(4))["obs"], other["obs"])


def test_a_patch_of_a_values_column_is_refused_before_anything_is_written(store_path):
    rb = TensorDictReplayBuffer(storage=ZarrStorage(10, store_path))
    rb.extend(rows_of_every_kind(3))
    with pytest.raises(NotSupportedError, match=r"\('int',\)"):
        rb.storage.write_leaves(
            np.array([0]), {("obs",): torch.full((1, 3), 99.0), ("int",): torch.ones(1)}
        )
    assert_same_rows(rb.storage.get(torch.arange(3)).exclude("index"), rows_of_every_kind(3))


def test_rows_too_long_to_wait_in_ram_are_written_at_once_after_older_ones(store_path, monkeypatch):
    monkeypatch.setattr("zarr_rb.core.solo_staging.STAGED_RAGGED_BYTES", 64 * 1024)
    ours, theirs = both(12, store_path, LazyStackStorage)
    writes = [token_rows([5, 3], seed=1), token_rows([5000], seed=2), token_rows([2, 4000, 1])]
    writes += [token_rows([7] * 8, seed=4)]  # wraps over the long rows
    for data in writes:
        for rb in (ours, theirs):
            rb.extend(data)
    every = torch.arange(12)
    assert_same_rows(ours.storage.get(every), theirs.storage.get(every))
    ours.storage.close()
    reopened = ZarrStorage(path=store_path, read_only=True)
    assert_same_rows(reopened.get(every), theirs.storage.get(every))


def test_values_of_a_two_dimensional_storage_read_as_lazy_tensor_storage(store_path):
    n = NonTensorStack.from_list([[1, 2, 3], [4, 5, 6]])
    data = TensorDict({"x": torch.arange(6.0).reshape(2, 3), "n": n}, [2, 3])
    ours, theirs = ZarrStorage(10, store_path, ndim=2), LazyTensorStorage(10, ndim=2)
    for storage in (ours, theirs):
        storage.set(slice(0, 2), data)
    assert ours.get("n") == theirs.get("n")
    assert ours[:]["n"].tolist() == [[1, 2, 3], [4, 5, 6]]
    row, their_row = ours.get(torch.tensor([1])), theirs.get(torch.tensor([1]))
    assert row["n"] == their_row["n"] == [[4, 5, 6]]
    assert torch.equal(row["x"], their_row["x"])


def test_a_refused_patch_of_some_elements_adds_no_keys(store_path):
    storage = ZarrStorage(10, store_path, ndim=2)
    storage.set(slice(0, 2), TensorDict({"x": torch.zeros(2, 3)}, [2, 3]))
    bad = TensorDict({"x": torch.ones(1, 5), "y": torch.ones(1)}, [1])  # x: wrong shape
    with pytest.raises((RuntimeError, SchemaMismatchError)):
        storage[torch.tensor([0]), torch.tensor([1])] = bad
    assert set(storage.get(torch.tensor([0])).keys()) == {"x"}
    storage[torch.tensor([0]), torch.tensor([1])] = TensorDict(
        {"x": torch.ones(1), "y": torch.full((1,), 7.0)}, [1]
    )
    row = storage.get(torch.tensor([0]))
    assert row["y"].tolist() == [[0.0, 7.0, 0.0]]
    assert row["x"].tolist() == [[0.0, 1.0, 0.0]]
