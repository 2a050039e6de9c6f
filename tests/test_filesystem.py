"""A store on a real local filesystem: a full disk, file modes, a read-only mount, and
starting a store over."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import zarr
from conftest import assert_identical
from sample_runner import python_c
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

import zarr_rb
from zarr_rb import ZarrStorage
from zarr_rb.errors import ReadOnlyError, ReadOnlyFilesystemError, StoreWriteError, ZarrRBError

# --- a small filesystem of our own ----------------------------------------------------------


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, check=False)


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[[str], Path]]:
    """``mount(size)``: a fresh tmpfs of that size (``"8m"``), unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        done = _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where))
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        if _run("umount", str(where)).returncode != 0:
            _run("umount", "-l", str(where))  # a file still open: detach it now, free it later


def remount_read_only(where: Path) -> None:
    done = _run("mount", "-o", "remount,ro", str(where))
    if done.returncode != 0:
        pytest.skip(f"cannot remount a tmpfs read-only here: {done.stderr.strip()}")


def frames(start: int, count: int) -> TensorDict:
    """Rows of incompressible 84x84 frames (no codec shrinks them) and their step."""
    generator = torch.Generator().manual_seed(start)
    obs = torch.randint(0, 256, (count, 84, 84), dtype=torch.uint8, generator=generator)
    return TensorDict({"obs": obs, "step": torch.arange(start, start + count)}, [count])


# --- a full disk ----------------------------------------------------------------------------

_READ_COMMITTED = textwrap.dedent(
    """
    import sys, torch
    from zarr_rb import ZarrStorage
    reader = ZarrStorage(path=sys.argv[1], read_only=True)
    rows = reader.get(torch.arange(len(reader)))
    torch.save({"obs": rows["obs"], "step": rows["step"]}, sys.argv[2])
    reader.close()
    """
)


def fill_until_full(
    storage: ZarrStorage, twin: LazyTensorStorage, *, batch: int
) -> tuple[int, StoreWriteError]:
    """Write and flush rows (into ``twin`` too) until a flush fails: the rows written, and
    the error."""
    written = 0
    while written < storage.max_size:
        rows, data = torch.arange(written, written + batch), frames(written, batch)
        storage.set(rows, data)
        twin.set(rows, data)
        written += batch
        try:
            storage.flush()
        except StoreWriteError as error:
            return written, error
    pytest.fail("the filesystem never filled up")


def test_full_filesystem_is_enospc_keeps_the_commit_and_recovers(tmpfs, tmp_path):
    disk = tmpfs("8m")
    filler = disk / "filler"
    filler.write_bytes(os.urandom(2 * 2**20))
    max_size, batch = 4096, 8  # 28 MiB of frames: far more than the disk holds
    storage = ZarrStorage(max_size, disk / "rb.zarr")
    twin = LazyTensorStorage(max_size)
    written, error = fill_until_full(storage, twin, batch=batch)
    assert error.errno == errno.ENOSPC, str(error)
    assert "rb.zarr" in str(error)
    assert "Free space" in str(error)
    assert "flush()" in str(error)

    # Another process sees the last commit, whole.
    seen = tmp_path / "committed.pt"
    done = python_c(_READ_COMMITTED, str(disk / "rb.zarr"), str(seen), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    committed = torch.load(seen)
    length = len(committed["step"])
    assert 0 < length < written
    assert_identical(committed["obs"], twin.get(torch.arange(length))["obs"])
    assert_identical(committed["step"], twin.get(torch.arange(length))["step"])

    filler.unlink()
    storage.flush()
    every = torch.arange(written)
    assert_identical(storage.get(every), twin.get(every))
    storage.close()
    reopened = ZarrStorage(path=disk / "rb.zarr", read_only=True)
    assert len(reopened) == written
    assert_identical(reopened.get(every), twin.get(every))
    reopened.close()


# --- file modes -----------------------------------------------------------------------------


def fill(path: Path) -> int | None:
    """Write zeros into ``path`` until the filesystem refuses more: the errno it gave."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as err:
        return err.errno
    finally:
        os.close(fd)


def test_a_full_disk_at_the_first_write_is_a_typed_error_and_the_write_works_once_freed(tmpfs):
    """The first write makes the store (its directory, its lock file): on a disk with no
    room left it fails with ENOSPC, holds nothing (no lock of this very process is left
    behind) and succeeds once space is freed."""
    disk = tmpfs("64k")
    filler = disk / "filler"
    assert fill(filler) == errno.ENOSPC
    rb = ReplayBuffer(storage=ZarrStorage(100, disk / "rb.zarr"))
    rows = TensorDict({"step": torch.arange(4)}, [4])
    with pytest.raises(StoreWriteError) as info:
        rb.extend(rows)
    assert info.value.errno == errno.ENOSPC
    assert "nothing was written" in str(info.value)
    filler.unlink()
    rb.extend(rows)
    rb.storage.close()
    with ZarrStorage(path=disk / "rb.zarr", read_only=True) as reopened:
        assert reopened[:]["step"].tolist() == [0, 1, 2, 3]


def test_an_export_onto_a_disk_without_room_is_refused_before_it_writes(tmpfs, tmp_path):
    """An export says what it writes and refuses a disk that cannot hold it, before it makes
    the dump (not half-way through a TorchRL layout)."""
    from zarr_rb.interop import export_torchrl

    rb = ReplayBuffer(storage=ZarrStorage(256, tmp_path / "rb.zarr"))
    rb.extend(frames(0, 256))  # 1.8 MB of rows
    zarr_rb.save(rb)
    rb.storage.close()
    disk = tmpfs("1m")
    with pytest.raises(OSError) as info:
        export_torchrl(tmp_path / "rb.zarr", disk / "dump", progress=False)
    assert info.value.errno == errno.ENOSPC
    assert "256 rows, 1.7 MiB" in str(info.value)
    assert "nothing was written" in str(info.value)
    assert not (disk / "dump").exists()


def wrong_modes(root: Path, umask: int) -> list[str]:
    """Every file and directory under ``root`` whose mode is not what ``umask`` gives."""
    wrong = []
    for path in [root, *sorted(root.rglob("*"))]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        if mode != expected:
            wrong.append(f"{path.relative_to(root.parent)}: {oct(mode)}, expected {oct(expected)}")
    return wrong


@pytest.mark.parametrize("umask", [0o022, 0o002], ids=["022", "002"])
def test_every_file_of_a_store_honours_the_umask(tmp_path, umask):
    """Another user (an analysis job on a shared filesystem) reads what the umask lets it
    read: the commit record and every group's metadata as well as the chunks."""
    single, shared = tmp_path / "single.zarr", tmp_path / "shared.zarr"
    previous = os.umask(umask)
    try:
        rb = ReplayBuffer(storage=ZarrStorage(64, single, ragged=["tokens"]), batch_size=4)
        for i in range(6):
            rb.add(TensorDict({"obs": torch.full((3,), i), "tokens": torch.ones(i + 1)}, []))
        rb.storage.flush()
        zarr_rb.save(rb)
        writer = ZarrStorage(64, shared, shared=True)
        writer.set(torch.arange(4), frames(0, 4))
        writer.flush()
        # While both are open, with their lock files and the shared writer's own.
        assert (shared / ".zarr_rb.writers").is_dir()
        assert wrong_modes(single, umask) == []
        assert wrong_modes(shared, umask) == []
        writer.close()
        rb.storage.close()
        assert wrong_modes(single, umask) == []
    finally:
        os.umask(previous)


# --- a read-only filesystem -----------------------------------------------------------------

WRITERS: dict[str, Callable[[Path], object]] = {
    "default": lambda path: ZarrStorage(64, path),
    "r+": lambda path: ZarrStorage(path=path, mode="r+"),
    "w": lambda path: ZarrStorage(64, path, mode="w"),
    "shared": lambda path: ZarrStorage(64, path, shared=True),
    "new store": lambda path: ZarrStorage(64, path.parent / "new.zarr"),
    "load": lambda path: zarr_rb.load(path),
}


@pytest.fixture
def read_only_store(tmpfs) -> tuple[Path, LazyTensorStorage]:
    """A saved store on a filesystem since remounted read-only, and its twin."""
    disk = tmpfs("8m")
    path = disk / "rb.zarr"
    rb = ReplayBuffer(storage=ZarrStorage(64, path), batch_size=4)
    twin = LazyTensorStorage(64)
    data = frames(0, 20)
    rb.extend(data)
    twin.set(torch.arange(20), data)
    zarr_rb.save(rb)
    rb.storage.close()
    del rb
    remount_read_only(disk)
    return path, twin


@pytest.mark.parametrize("writer", list(WRITERS))
def test_writer_on_a_read_only_filesystem_is_a_typed_error(read_only_store, writer):
    path, _ = read_only_store
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    with pytest.raises(ReadOnlyFilesystemError) as info:
        WRITERS[writer](path)
    error = info.value
    assert isinstance(error, PermissionError)
    assert isinstance(error, ReadOnlyError)
    assert isinstance(error, ZarrRBError)
    assert error.errno == errno.EROFS
    where = str(path.parent / "new.zarr") if writer == "new store" else str(path)
    assert where in str(error)
    assert "read-only filesystem" in str(error)
    assert "read_only=True" in str(error)
    assert "writable" in str(error)
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == before


def test_readers_on_a_read_only_filesystem_keep_working(read_only_store):
    path, twin = read_only_store
    every = torch.arange(20)
    reader = ZarrStorage(path=path, read_only=True)
    assert_identical(reader.get(every), twin.get(every))
    reader.close()
    loaded = zarr_rb.load(path, read_only=True)
    assert len(loaded) == 20
    assert_identical(loaded.storage.get(every), twin.get(every))
    assert len(loaded.sample()) == 4
    loaded.storage.close()
    view = zarr_rb.open(path)
    assert_identical(view.storage.get(every), twin.get(every))
    view.storage.close()


# --- starting over --------------------------------------------------------------------------


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def test_mode_w_leaves_only_what_a_fresh_store_has(tmp_path):
    old, fresh = tmp_path / "old.zarr", tmp_path / "fresh.zarr"
    rb = ReplayBuffer(storage=ZarrStorage(16, old, ragged=True), batch_size=2)
    for i in range(5):
        rb.add(TensorDict({"tokens": torch.arange(i + 1), "reward": torch.tensor(i)}, []))
    zarr_rb.save(rb)
    rb.storage.close()
    assert (old / "lengths").is_dir()
    assert (old / "state").is_dir()
    # A group this version does not know (written by a newer one), and a temporary an
    # interrupted write left at the top.
    (old / "newer").mkdir()
    (old / "newer" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    (old / ".zarr.json.0123abcd.tmp").write_bytes(b"{")

    plain = frames(0, 6)
    for path in (old, fresh):
        storage = ZarrStorage(16, path, mode="w")
        storage.set(torch.arange(6), plain)
        storage.close()
    assert not (old / "lengths").exists()
    assert tree(old) == tree(fresh)

    # zarr-python sees the same hierarchy in both, and says nothing more of one than of
    # the other (it notes the writers' lock files in both).
    groups: dict[Path, list[str]] = {}
    said: dict[Path, list[str]] = {}
    for path in (old, fresh):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            groups[path] = sorted(zarr.open_group(path, mode="r").group_keys())
        said[path] = sorted({str(w.message) for w in caught})
    assert groups[old] == groups[fresh] == ["data"]
    assert said[old] == said[fresh]
    data = zarr.open_group(old / "data", mode="r")
    assert sorted(data.array_keys()) == ["obs", "step"]
    for key in ("obs", "step"):
        array = data[key]
        assert isinstance(array, zarr.Array)
        assert torch.equal(torch.from_numpy(array[:6]), plain[key])


def test_a_sync_run_by_a_collection_inside_a_sync_does_not_deadlock(tmp_path: Path) -> None:
    """A garbage collection in the middle of a commit's sync may run the finalizer of
    another storage, which closes it and syncs its own files: that sync must not wait on
    anything the first one holds (a version that fsynced on a pool of threads hung there,
    inside the pool's ``submit``). The collections here run a sync each, as such a
    finalizer would; in a child process, so that a hang fails this test rather than stops
    the run."""
    script = textwrap.dedent(
        """
        import gc, sys
        from pathlib import Path
        from zarr_rb.locations import local

        files = []
        for i in range(8):
            path = Path(sys.argv[1]) / f"f{i}"
            path.write_bytes(b"x")
            files.append(path)
        inside = []

        def finalizer_like(phase, info):
            if phase == "start" and not inside:
                inside.append(True)
                try:
                    local._fsync_together(files[:2])
                finally:
                    inside.clear()

        gc.callbacks.append(finalizer_like)
        gc.set_threshold(1)
        for _ in range(5):
            local._fsync_together(files)
        gc.callbacks.remove(finalizer_like)
        print("synced")
        """
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a sync run by a collection inside another sync waits for it forever")
    assert done.stdout.strip() == "synced", done.stderr
