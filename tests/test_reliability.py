"""One writer, durable commits, read-only openers that never write, I/O faults, damaged chunks."""

from __future__ import annotations

import errno
import gc
import json
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_identical, chunk_file, name_chunks_with
from tensordict import TensorDict
from torchrl.data import TensorDictPrioritizedReplayBuffer

import zarr_rb
from zarr_rb import (
    ChunkCorruptedError,
    Compression,
    LockedError,
    RowsNotCommittedError,
    StoreWriteError,
    ZarrStorage,
)
from zarr_rb.cli import main as cli
from zarr_rb.testing import (
    ALL_KINDS,
    CrashWorkload,
    DurabilityRecorder,
    FaultInjector,
    count_fault_points,
    inject_io_fault,
    observe_io,
)

WORKLOAD = CrashWorkload(capacity=48, block_rows=8)


def buffer(path: Path) -> TensorDictPrioritizedReplayBuffer:
    return WORKLOAD.buffer(path)


def extend(rb, start: int, n: int) -> None:
    steps = torch.arange(start, start + n)
    index = rb.extend(WORKLOAD.rows(steps, WORKLOAD.capacity))
    rb.update_priority(index, WORKLOAD.priority(steps))


def expected_rows(total: int) -> TensorDict:
    """The rows a buffer holds after ``total`` sequential writes (slot order)."""
    cap = WORKLOAD.capacity
    n = min(total, cap)
    index = torch.arange(n)
    return WORKLOAD.rows(total - 1 - ((total - 1 - index) % cap), cap)


def rows_in(storage, index) -> TensorDict:
    """Rows as written (without the ``index`` key TorchRL's prioritized buffer adds)."""
    return storage.get(index).exclude("index")


def tree_state(root: Path) -> dict[str, tuple[int, int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


# --- one writer --------------------------------------------------------------------------------


def test_storages_of_one_process_share_the_writer(store_path):
    """In one process, storages opened on one store share its writer: the same rows, one
    lock, one RAM buffer; the store stays locked against other processes until the last of
    them is closed."""
    first = ZarrStorage(10, store_path)
    first.set(torch.arange(3), torch.arange(3.0).unsqueeze(-1))
    second = ZarrStorage(10, store_path)
    assert len(second) == 3
    assert_identical(second.get(torch.arange(3)), torch.arange(3.0).unsqueeze(-1))
    second.set(torch.arange(3, 5), torch.arange(3.0, 5.0).unsqueeze(-1))
    assert len(first) == 5
    with pytest.raises(LockedError, match=r"close that storage first \(storage.close\(\)"):
        ZarrStorage(10, store_path, mode="w")  # would remove rows under the other one
    first.close()
    assert second.get(4).item() == 4.0  # still open: the store closes with its last user
    second.close()
    assert_identical(ZarrStorage(path=store_path, read_only=True)[:], torch.arange(5.0)[:, None])


HOLDER = textwrap.dedent(
    """
    import sys, time, torch
    from tensordict import TensorDict
    from zarr_rb import ZarrStorage
    storage = ZarrStorage(10, sys.argv[1])
    storage.set(torch.arange(1), TensorDict({"x": torch.zeros(1)}, [1]))  # makes the store
    print("holding", flush=True)
    time.sleep(600)
    """
)


def test_lock_frees_itself_when_the_holder_dies(store_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(store_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(LockedError) as info:
            ZarrStorage(10, store_path)
        assert info.value.holder["pid"] == holder.pid
        assert info.value.holder["host"] == socket.gethostname()
        assert "since" in info.value.holder
        message = str(info.value)
        assert f"pid {holder.pid}" in message
        assert "read_only=True" in message
        assert isinstance(info.value, BlockingIOError)
        # Readers are not writers: they open next to it, and it stays the only writer.
        ZarrStorage(path=store_path, read_only=True).close()
        with pytest.raises(LockedError):
            zarr_rb.load(store_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    ZarrStorage(10, store_path).close()  # no stale lock after kill -9


def test_read_only_openers_never_write(tmp_path):
    path = tmp_path / "rb.zarr"
    rb = buffer(path)
    extend(rb, 0, 60)
    zarr_rb.save(rb)
    rb.storage.close()
    before = tree_state(path)
    gc.collect()  # storages earlier tests dropped close now, not while operations are counted
    injector = FaultInjector(kinds=ALL_KINDS)
    with observe_io(injector):
        reader = ZarrStorage(path=path, read_only=True)
        reader.refresh()
        assert_identical(rows_in(reader, torch.arange(len(reader))), expected_rows(60))
        _ = reader[:]["obs"][3:7].clone()
        loaded = zarr_rb.load(path, read_only=True)
        loaded.sample()
        assert zarr_rb.verify(path).ok
        zarr_rb.export_torchrl(path, tmp_path / "dump", progress=False)
        reader.close()
        loaded.storage.close()
    assert injector.count == 0, injector.events[:5]  # (what was touched, if anything)
    assert [e for e in injector.events if path in e[1].parents] == []
    assert tree_state(path) == before  # not a byte, not a lock file, not a timestamp


# --- durability --------------------------------------------------------------------------------


@pytest.mark.parametrize("separator", [".", "/"])
def test_every_commit_is_published_after_what_it_depends_on_is_fsynced(
    tmp_path, monkeypatch, separator
):
    """``/``: chunks named as in stores made before ``c.3.0.0`` (``c/3/0/0``), each chunk
    of an image leaf in directories of its own, made as it is written."""
    name_chunks_with(monkeypatch, separator)
    path = tmp_path / "rb.zarr"
    recorder = DurabilityRecorder(path)
    rng = np.random.default_rng(0)
    with observe_io(recorder):
        rb = buffer(path)
        for step in range(1, 40):  # about 5 times around the ring
            WORKLOAD.step(rb, rng)
            if step % 6 == 0:
                zarr_rb.save(rb)
            elif step % 5 == 0:
                rb.storage.flush()
        zarr_rb.save(rb, tmp_path / "snapshot.zarr")
        rb.storage.close()
    assert recorder.violations == []
    assert recorder.publishes > 30
    assert recorder.checked > 100  # files and directories that changed between commits
    chunk_dirs = [p for p in path.rglob("c") if p.is_dir()]
    assert bool(chunk_dirs) == (separator == "/")


def test_recorder_catches_a_write_that_is_not_fsynced(tmp_path):
    """The recorder itself: a file changed behind the engine's back is reported."""
    path = tmp_path / "rb.zarr"
    recorder = DurabilityRecorder(path)
    with observe_io(recorder):
        storage = ZarrStorage(10, path)
        storage.set(torch.arange(2), torch.zeros(2, 3))
        (path / "data" / "stray").write_bytes(b"not fsynced")
        storage.set(torch.arange(2, 4), torch.zeros(2, 3))
        storage.close()
    assert any("stray" in v for v in recorder.violations)


# --- I/O faults --------------------------------------------------------------------------------


FAULTS = pytest.mark.parametrize(
    ("error", "persistent"),
    [(errno.ENOSPC, False), (errno.EIO, False), (errno.ENOSPC, True)],
    ids=["ENOSPC-once", "EIO-once", "ENOSPC-from-then-on"],
)


def io_faults(tmp_path: Path, error: int, persistent: bool, points: int | None) -> None:
    """Inject ``error`` at the n-th store write or publish of a workload, for ``points``
    values of n spread over all of them (``None``: every one)."""
    operations = count_fault_points(WORKLOAD, tmp_path / "count.zarr")
    assert operations > 20
    step = 1 if points is None else max(1, operations // points)
    for n in range(1 + (error + persistent) % step, operations + 1, step):
        inject_io_fault(WORKLOAD, tmp_path / f"{n}.zarr", at=n, error=error, persistent=persistent)


@FAULTS
def test_io_fault_at_some_writes_is_typed_and_recoverable(tmp_path, error, persistent):
    io_faults(tmp_path, error, persistent, points=8)


@pytest.mark.slow
@FAULTS
def test_io_fault_at_every_write_is_typed_and_recoverable(tmp_path, error, persistent):
    io_faults(tmp_path, error, persistent, points=None)


def test_retry_on_the_same_buffer_after_a_full_disk(tmp_path):
    """The rows of a failed write wait in RAM; the retried save writes them all."""
    path = tmp_path / "rb.zarr"
    rb = buffer(path)
    extend(rb, 0, 30)
    zarr_rb.save(rb)
    with observe_io(FaultInjector(at=1, persistent=True)), pytest.raises(StoreWriteError):
        extend(rb, 30, 37)
    with observe_io(FaultInjector(at=1, persistent=True)), pytest.raises(StoreWriteError):
        zarr_rb.save(rb)
    assert_identical(rows_in(rb.storage, torch.arange(48)), expected_rows(67))  # served from RAM
    zarr_rb.save(rb)  # the disk has room again
    rb.storage.close()
    loaded = zarr_rb.load(path)
    assert int(loaded.writer._write_count) == 67
    assert_identical(rows_in(loaded.storage, torch.arange(48)), expected_rows(67))
    loaded.storage.close()


# --- damaged chunks ----------------------------------------------------------------------------


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped byte": flip_byte,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "missing": lambda p: p.unlink(),
}


@pytest.fixture
def saved_store(tmp_path) -> Path:
    path = tmp_path / "rb.zarr"
    rb = buffer(path)
    extend(rb, 0, 40)
    zarr_rb.save(rb)
    rb.storage.close()
    return path


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("leaf", ["obs", "reward"])  # a sharded and a plain chunked array
def test_damaged_chunk_is_a_typed_error_naming_array_and_rows(saved_store, damage, leaf):
    chunk = chunk_file(saved_store, f"data/{leaf}", *((1, 0, 0, 0) if leaf == "obs" else (0,)))
    DAMAGE[damage](chunk)
    lost = range(8, 16) if leaf == "obs" else range(8)  # a shard, a chunk: a block each
    for read_only in (True, False):
        storage = ZarrStorage(path=saved_store, read_only=read_only)
        with pytest.raises(ChunkCorruptedError) as info:
            storage.get(torch.tensor([1, *range(lost.start, min(lost.stop, 40)), 30]))
        assert info.value.array == f"data/{leaf}"
        assert all(lost[0] <= a < b <= lost[-1] + 1 for a, b in info.value.rows)
        assert f"data/{leaf}" in str(info.value)
        assert "verify" in str(info.value)
        if leaf == "obs":  # rows of intact chunks still read
            assert_identical(rows_in(storage, torch.tensor([1, 30])), expected_rows(40)[[1, 30]])
        storage.close()
    report = zarr_rb.verify(saved_store)
    assert not report.ok
    assert {d.array for d in report.damaged} == {f"data/{leaf}"}
    covered = sorted({r for d in report.damaged for r in range(*d.rows)})
    assert covered
    assert set(covered) <= set(lost)
    if damage != "flipped byte":  # the whole file is gone: every committed row of it
        assert covered == list(range(lost.start, min(lost.stop, 40)))


def test_verify_lists_every_damaged_chunk_and_repair_withdraws_its_rows(saved_store, capsys):
    flip_byte(chunk_file(saved_store, "data/obs", 0, 0, 0, 0))
    chunk_file(saved_store, "data/next/obs", 3, 0, 0, 0).unlink()
    assert cli(["verify", str(saved_store)]) == 1
    out = capsys.readouterr().out
    assert "data/next/obs rows 24-25" in out
    assert "data/obs" in out
    report = zarr_rb.verify(saved_store)
    bad = sorted({r for d in report.damaged for r in range(*d.rows)})
    assert set(range(24, 32)) <= set(bad)
    assert cli(["verify", str(saved_store), "--repair"]) == 0
    assert zarr_rb.verify(saved_store).ok
    reader = ZarrStorage(path=saved_store, read_only=True)
    assert len(reader) == 40  # the length stays; the damaged rows are holes
    with pytest.raises(RowsNotCommittedError):
        reader.get(torch.tensor([bad[0]]))
    good = torch.tensor([r for r in range(40) if r not in bad])
    assert_identical(rows_in(reader, good), expected_rows(40)[good])
    reader.close()


def test_damaged_sampler_state_fails_load_with_a_typed_error(saved_store):
    attrs = json.loads((saved_store / "zarr.json").read_text())["attributes"]["zarr_rb"]
    tree = saved_store / "state" / str(attrs["saved"]["slot"]) / "sampler" / "sum_tree"
    flip_byte(chunk_file(tree.parent, tree.name, 0))
    with pytest.raises(ChunkCorruptedError, match="sum_tree"):
        zarr_rb.load(saved_store)
    report = zarr_rb.verify(saved_store)
    assert [d.array.rsplit("/", 1)[-1] for d in report.damaged] == ["sum_tree"]
    assert "saved buffer state is damaged" in str(report)
    # The data is intact and still opens; the store is not left locked.
    storage = ZarrStorage(path=saved_store)
    assert_identical(rows_in(storage, torch.arange(40)), expected_rows(40))
    storage.close()


def test_cli_reports_a_missing_store(tmp_path, capsys):
    assert cli(["verify", str(tmp_path / "nowhere.zarr")]) == 2
    assert "no zarr_rb store" in capsys.readouterr().err


# --- readers -----------------------------------------------------------------------------------


def test_reader_refreshes_on_an_interval(store_path):
    writer = ZarrStorage(100, store_path, compression=Compression(block_rows=8))
    writer.set(torch.arange(8), torch.arange(8.0).unsqueeze(-1))
    reader = ZarrStorage(path=store_path, read_only=True, refresh_interval=0.0)
    manual = ZarrStorage(path=store_path, read_only=True)
    assert len(reader) == len(manual) == 8
    writer.set(torch.arange(8, 16), torch.arange(8.0, 16.0).unsqueeze(-1))
    assert len(manual) == 8  # no refresh, no new rows
    assert_identical(reader.get(torch.arange(16)), torch.arange(16.0).unsqueeze(-1))
    assert len(reader) == 16
    manual.refresh()
    assert len(manual) == 16
    for storage in (reader, manual, writer):
        storage.close()
    with pytest.raises(ValueError, match="refresh_interval"):
        ZarrStorage(path=store_path, refresh_interval=1.0)
