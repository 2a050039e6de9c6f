"""A bounded in-RAM cache of a remote store's encoded objects (shards and metadata).

Reads from an object store pay a request per inner chunk. Compressed replay data is
small (a million Pong transitions are about 0.4 GB stored), so a reader keeps whole
objects as they are stored, still compressed, in a TensorStore ``memory`` kvstore, and
reads its arrays from there: a warm sample then costs what a read from the local page
cache costs. The cache holds at most ``limit`` bytes of objects (least recently used
ones leave first).

Freshness: objects this process writes are dropped from the cache as they are written.
Objects another process may have rewritten are revalidated (a conditional GET, answered
"not modified" without a body when unchanged) the first time they are used after the
commit record moved: :meth:`EncodedCache.new_epoch`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import tensorstore as ts

from zarr_rb.locations.base import Generation

_T = TypeVar("_T")


@dataclasses.dataclass(slots=True)
class _Entry:
    generation: Generation
    size: int
    epoch: int


class EncodedCache:
    """Objects of one store copied from ``source`` (a kvstore rooted at the store) into
    RAM, at most ``limit`` bytes of them."""

    def __init__(
        self,
        source: ts.KvStore,
        *,
        limit: int,
        errors: Callable[[Callable[[], Any], str], Any],
    ) -> None:
        self.limit = limit
        self._source = source
        self._errors = errors
        self.context = ts.Context(
            {
                "memory_key_value_store": {},
                # The objects are cached encoded here; decoding them again is cheap.
                "cache_pool": {"total_bytes_limit": 0},
            }
        )
        self._memory = ts.KvStore.open({"driver": "memory"}, context=self.context).result()
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._bytes = 0
        self._epoch = 0
        self._versions: collections.Counter[str] = collections.Counter()
        """How often each key was invalidated: a fetch that began before an invalidation
        does not insert what it fetched (it may be older than what was written)."""
        self._mutex = threading.Lock()
        self._reading = threading.RLock()
        """Held from fetching objects until the read from them is done, so that no other
        read evicts them in between."""

    @property
    def nbytes(self) -> int:
        return self._bytes

    def kvstore(self, key: str) -> dict[str, Any]:
        """The kvstore spec arrays read from (with :attr:`context`)."""
        return {"driver": "memory", "path": key.strip("/") + "/"}

    def keys_under(self, prefix: str) -> list[str]:
        """The cached keys below ``prefix/``."""
        with self._mutex:
            return [key for key in self._entries if key.startswith(prefix.strip("/") + "/")]

    def new_epoch(self) -> None:
        """The commit moved: revalidate each cached object before its next use."""
        with self._mutex:
            self._epoch += 1

    def invalidate(self, keys: Iterable[str]) -> None:
        """Forget objects (this process just wrote them)."""
        with self._mutex:
            for key in keys:
                self._versions[key] += 1
                self._drop(key)

    def read(self, keys: Iterable[str], read: Callable[[], _T]) -> _T:
        """``read()`` (a read of arrays on :attr:`context`) once the objects ``keys`` are
        current in the cache; none of them leaves the cache before it returns."""
        with self._reading:
            self._ensure(keys)
            return read()

    def _ensure(self, keys: Iterable[str]) -> None:
        """Make the objects ``keys`` current in the cache (fetching the missing and the
        stale ones, together), then trim the cache to its limit."""
        wanted = list(dict.fromkeys(keys))
        with self._mutex:
            epoch = self._epoch
            stale = {
                key: entry
                for key in wanted
                if (entry := self._entries.get(key)) is not None and entry.epoch != epoch
            }
            missing = [key for key in wanted if key not in self._entries]
            for key in wanted:
                if key in self._entries and key not in stale:
                    self._entries.move_to_end(key)
            versions = {key: self._versions[key] for key in wanted}
        if not stale and not missing:
            return
        reads = {key: self._source.read(key) for key in missing}
        reads.update(
            {key: self._source.read(key, if_not_equal=e.generation) for key, e in stale.items()}
        )
        results = {
            key: self._errors(future.result, f"reading {key!r}") for key, future in reads.items()
        }
        with self._mutex:
            for key, result in results.items():
                if self._versions[key] != versions[key]:
                    continue  # written meanwhile: fetched again at its next use
                if result.state == "unspecified":  # not modified since it was cached
                    entry = self._entries.get(key)
                    if entry is not None:
                        entry.epoch = epoch
                        self._entries.move_to_end(key)
                    continue
                self._drop(key)
                if result.state == "value":
                    value = bytes(result.value)
                    self._memory.write(key, value).result()
                    self._entries[key] = _Entry(bytes(result.stamp.generation), len(value), epoch)
                    self._bytes += len(value)
            keep = set(wanted)
            for key in list(self._entries):
                if self._bytes <= self.limit:
                    break
                if key not in keep:
                    self._drop(key)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size
            self._memory.write(key, None).result()
