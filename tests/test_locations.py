"""The location contract, checked on every implementation: a local directory and an S3
prefix (a real SeaweedFS server). Each primitive does what ``locations/base.py`` says,
compare-and-swap included, from several real processes at once."""

from __future__ import annotations

import multiprocessing
import uuid

import pytest

from zarr_rb.locations import LocalLocation, open_location
from zarr_rb.locations.base import LEASE_KEY, LOCK_FILE, Location


@pytest.fixture(params=["local", "s3"])
def spec(request, tmp_path):
    """``(url, storage_options)`` of a fresh, empty location."""
    if request.param == "local":
        return str(tmp_path / "store.zarr"), None
    server = request.getfixturevalue("s3_server")
    return server.url(f"locations-{uuid.uuid4().hex[:8]}.zarr"), server.storage_options()


@pytest.fixture
def location(spec) -> Location:
    location = open_location(*spec)
    location.create_root()
    return location


def test_objects_round_trip_and_change_generation(location):
    assert location.read("a/b") is None
    absent = location.read_versioned("a/b").generation
    first = location.write("a/b", b"one")
    assert location.read("a/b") == b"one"
    assert location.read_versioned("a/b").generation == first != absent
    second = location.write("a/b", b"two")
    assert second != first
    assert location.read_versioned("a/b") == type(location.read_versioned("a/b"))(b"two", second)
    location.delete("a/b")
    assert location.read("a/b") is None


def test_compare_and_swap(location):
    absent = location.read_versioned("record").generation
    created = location.write_if("record", b"v1", generation=absent)
    assert created is not None
    assert location.write_if("record", b"again", generation=absent) is None  # create-only
    assert location.read("record") == b"v1"
    updated = location.write_if("record", b"v2", generation=created)
    assert updated is not None
    assert location.read("record") == b"v2"
    assert location.write_if("record", b"v3", generation=created) is None  # stale
    assert location.read("record") == b"v2"
    assert location.write_if("record", None, generation=created) is None  # stale delete
    assert location.write_if("record", None, generation=updated) is not None
    assert location.read("record") is None


def _increment(spec, times: int, start) -> None:
    import time

    from zarr_rb.util.io import observe_io

    location = open_location(*spec)
    start.wait(60)  # all at once: interpreters take a while to start
    # A pause at each write widens the window between compare and swap that a race needs.
    with observe_io(lambda kind, path: time.sleep(0.002)):
        for _ in range(times):
            while True:
                found = location.read_versioned("counter")
                value = int(found.value or b"0") + 1
                if location.write_if("counter", str(value).encode(), generation=found.generation):
                    break


def test_compare_and_swap_is_atomic_across_processes(spec, location):
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    workers = [context.Process(target=_increment, args=(spec, 40, start)) for _ in range(4)]
    for worker in workers:
        worker.start()
    start.set()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    assert location.read("counter") == b"160"  # no increment lost


def test_listing_and_deleting_a_prefix_leave_siblings_alone(location):
    location.write("data/obs/c/0", b"x" * 10)
    location.write("data/obs/zarr.json", b"{}")
    location.write("data/obs2/c/0", b"y" * 3)
    location.write("zarr.json", b"{}")
    assert location.list("data/obs") == {"data/obs/c/0": 10, "data/obs/zarr.json": 2}
    assert set(location.list()) == {
        "data/obs/c/0",
        "data/obs/zarr.json",
        "data/obs2/c/0",
        "zarr.json",
    }
    location.delete_prefix("data/obs")
    assert set(location.list()) == {"data/obs2/c/0", "zarr.json"}


def test_an_object_is_looked_up_alone(location):
    location.write("data/obs/c/1/0", b"x")
    location.write("data/obs/c/10/0", b"y")
    location.write("data/obs/c/2", b"z")
    assert location.has("data/obs/c/1/0")
    assert location.has("data/obs/c/2")
    # Neither a prefix of a key, nor a key it prefixes, nor a folder is the object.
    for key in ("data/obs/c/1", "data/obs/c/1/", "data/obs/c/10", "data/obs/c/1/00", "c/1/0"):
        assert not location.has(key), key


def test_copies_within_and_across_kinds(location, tmp_path):
    location.write("data/c/0", b"chunk")
    location.write("zarr.json", b"{}")
    for target in (location.child("copy.zarr"), LocalLocation(tmp_path / "elsewhere.zarr")):
        target.create_root()
        location.copy_to(target, ["data/c/0", "zarr.json"])
        assert target.read("data/c/0") == b"chunk"
        assert target.read("zarr.json") == b"{}"


def test_a_writers_lock_or_lease_is_not_content(location):
    assert not location.exists()
    hold = location.acquire_writer()
    names = set(location.list())
    assert names <= {LOCK_FILE, LEASE_KEY}
    assert not location.exists()
    hold.release()
    location.write("zarr.json", b"{}")
    assert location.exists()
