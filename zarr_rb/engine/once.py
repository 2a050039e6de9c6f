"""Data objects created once: rows encoded in RAM, then each object created on the store
by a conditional PUT (``If-None-Match: *``), never written over while it exists.

TensorStore's zarr driver writes a shard back unconditionally, and no spec option makes
its writes create-only; its S3 key-value store can (a write whose ``if_equal`` is the
generation of an absent object sends ``If-None-Match: *``; a refused PUT comes back as an
empty generation, not as an error). So rows are written through the array's own metadata
into a ``memory`` key-value store (the same codecs give the same objects under the same
keys), and each object found there is created on the store.

Design: ``docs/design/ring.md``, "Step 5".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import tensorstore as ts

from zarr_rb.errors import FencedError
from zarr_rb.locations.base import NO_VALUE


def shadow_of(array: ts.TensorStore) -> ts.TensorStore:
    """An empty array in RAM with ``array``'s metadata (shape, chunks, codecs)."""
    metadata = array.spec().to_json()["metadata"]
    context = ts.Context({"memory_key_value_store": {}, "cache_pool": {"total_bytes_limit": 0}})
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "memory"},
        "metadata": metadata,
        # As the store's arrays: every chunk written is stored, even one of fill values
        # (a chunk missing inside the committed range is damage, not zeros).
        "store_data_equal_to_fill_value": True,
    }
    return ts.open(spec, create=True, context=context).result()


class Creation:
    """The conditional PUTs of every object written into a ``shadow`` (an array of
    :func:`shadow_of`) to ``target``, started as it is made; :func:`finish_all` waits for
    them.

    An object ``target`` already holds is kept when its bytes are the ones to create (a
    retried request whose first attempt landed); otherwise it is deleted and created
    again. The caller writes only into slots of its own, where any object is its own
    garbage (a write that failed, a slot freed and not collected yet).

    Args:
        where: the key as the store names it (for messages).
        clear: delete each object first, then create it: one round of requests instead of
            three where leftovers are likely (a shared writer's slots, taken again once
            free), one more where there are none.
    """

    def __init__(
        self,
        shadow: ts.TensorStore,
        target: ts.KvStore,
        *,
        where: Callable[[str], str],
        clear: bool = False,
    ) -> None:
        memory = shadow.kvstore
        assert memory is not None
        self._target = target
        self._where = where
        listed = [key.decode() for key in memory.list().result() if key != b"zarr.json"]
        reads = {key: memory.read(key) for key in listed}
        self._values = {key: bytes(read.result().value) for key, read in reads.items()}
        # (A DELETE of one key each: a range would LIST first.)
        self._cleared = [target.write(key, None) for key in listed] if clear else []
        self._created = {} if clear else self._create(listed)
        self.keys = listed
        """The keys created (relative to the array's)."""

    def _create(self, keys: Iterable[str]) -> dict[str, Any]:
        """Start the conditional PUTs of ``keys``."""
        values = self._values
        return {key: self._target.write(key, values[key], if_equal=NO_VALUE) for key in keys}

    def steps(self) -> Iterator[None]:
        """The requests after the first round, in rounds (each round's requests in flight
        at once, and with the other creations' of :func:`finish_all`)."""
        target, values = self._target, self._values
        if self._cleared:
            for deletion in self._cleared:
                deletion.result()
            self._created = self._create(self.keys)
            yield
        found: dict[str, Any] = {
            key: target.read(key)
            for key, future in self._created.items()
            if not future.result().generation  # refused: the object exists
        }
        yield
        replaced = [
            key
            for key, future in found.items()
            if (result := future.result()).state != "value" or bytes(result.value) != values[key]
        ]
        deletions = [target.write(key, None) for key in replaced]
        yield
        for deletion in deletions:
            deletion.result()
        again = self._create(replaced)
        yield
        for key, future in again.items():
            if not future.result().generation:
                raise FencedError(
                    f"object {self._where(key)!r} was created by another writer between this "
                    "writer's deletion of its own leftover there and its creation of the rows "
                    "meant for it: another process writes this writer's slots. Nothing of "
                    "this write was committed; close this storage and reopen the store",
                    holder={},
                )


def finish_all(creations: Sequence[Creation]) -> None:
    """Wait for every creation, their rounds of requests side by side (a refused PUT costs
    a few round trips for the whole write, not per array).

    Raises:
        FencedError: an object appeared again between its deletion and its creation:
            another writer writes this writer's slots.
        ValueError: a request failed (TensorStore's error).
    """
    rounds = [creation.steps() for creation in creations]
    while rounds:
        rounds = [steps for steps in rounds if next(steps, StopIteration) is not StopIteration]
