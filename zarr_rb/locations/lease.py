"""One writer per store on an object store: a lease object, renewed while the writer lives.

There is no ``flock`` on an object store. The writer holds the object
``<store>/.zarr_rb.lease``, a JSON record naming it (host, pid, since) and saying until
when it holds the store (``expires``, seconds since the epoch). A background thread
renews it every quarter of its duration; each write of it is a compare-and-swap on the
generation the writer last wrote, so two writers can never both believe they hold it.

A writer that dies stops renewing: after at most ``seconds`` (20 by default, at most 30)
the record has expired and the next writer takes it over, by a compare-and-swap on the
generation it read. A second writer meanwhile gets :class:`~zarr_rb.errors.LockedError`
naming the holder.

Fencing: a writer that stalled (a paused process, a long GC, a network partition) may
find its lease gone. Before writing rows and before each commit it calls
:meth:`Lease.check`, which fails with :class:`~zarr_rb.errors.FencedError` once a renewal
found the lease taken, or once the last successful renewal is older than three quarters
of its duration (it may have expired on the server's side by now). The commit itself is
a compare-and-swap on the commit record, so a fenced writer can never overwrite a newer
writer's commit. What it cannot stop is a chunk PUT already on the wire when the stall
began: S3 has no fencing token for plain writes. The three-quarter margin bounds that
window to stalls that begin between a check and the PUT after it.

Expiry compares the holder's clock with the contender's: hosts must agree on the time
to well within the lease's duration (NTP does).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from zarr_rb.errors import FencedError, LockedError
from zarr_rb.locations.base import LEASE_KEY, WRITERS_DIR, Generation, Location
from zarr_rb.util.io import json_object

SAFETY = 0.75
"""Fraction of the lease's duration after its last renewal during which the holder may
still write."""


class Lease:
    """The writer lease of one store, held from :meth:`acquire` until :meth:`release`."""

    needs_claim = True
    late_writes = True

    def __init__(
        self,
        location: Location,
        *,
        seconds: float,
        holder: dict[str, Any],
        generation: bytes,
        key: str = LEASE_KEY,
        renewed: float | None = None,
    ) -> None:
        """``renewed``: when the lease was last written (``time.monotonic()``; now if not
        given)."""
        self.location = location
        self.key = key
        self.needs_claim = key == LEASE_KEY  # a shared writer's lease names no commit
        self.seconds = seconds
        self.holder = holder
        self._lease_generation: Generation = generation
        self._renewed = time.monotonic() if renewed is None else renewed
        self._lost: str | None = None
        self._released = threading.Event()
        self._mutex = threading.Lock()
        self._thread = threading.Thread(target=self._keep, name="zarr_rb-lease", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(
        cls, location: Location, *, seconds: float, key: str = LEASE_KEY, **about: Any
    ) -> Lease:
        """Take the lease at ``key`` (the store's writer lease by default; a shared
        writer's own otherwise), or raise :class:`LockedError` at once if it is held.
        ``about`` goes into the record."""
        current = location.read_versioned(key)
        record = json_object(current.value)
        if current.value is not None and _unexpired(record):
            raise _locked(location, record)
        started = time.monotonic()
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "token": uuid.uuid4().hex,
            "seconds": seconds,
            **about,
        }
        generation = location.write_if(key, _record(holder, seconds), generation=current.generation)
        if generation is None:  # another writer took it between our read and our write
            raise _locked(location, json_object(location.read(key)))
        return cls(
            location,
            seconds=seconds,
            holder=holder,
            generation=generation,
            key=key,
            renewed=started,
        )

    @property
    def held(self) -> bool:
        return not self._released.is_set() and self._lost is None

    def check(self) -> None:
        """Raise :class:`FencedError` unless this writer surely still holds the store."""
        if self._released.is_set():
            raise FencedError(
                f"store {self.location.url!r}: this writer released its lease", holder={}
            )
        age = time.monotonic() - self._renewed
        if self._lost is None and age > SAFETY * self.seconds:
            self._renew()  # a stalled renewal thread: try once here before giving up
            age = time.monotonic() - self._renewed
        if self._lost is not None or age > SAFETY * self.seconds:
            reason = self._lost or f"its lease was last renewed {age:.1f} s ago"
            raise FencedError(
                f"store {self.location.url!r}: this writer lost the store ({reason}; "
                f"leases last {self.seconds:g} s). It writes nothing more, so that it cannot "
                "overwrite a newer writer's rows: reopen the store to write again (rows not "
                "committed are lost)",
                holder=self._current_holder(),
            )

    def _current_holder(self) -> dict[str, Any]:
        """Who holds the lease now, as far as it can be read."""
        with contextlib.suppress(OSError):
            return json_object(self.location.read(self.key))
        return {}

    def release(self) -> None:
        """Give the lease up: replace the record, if still ours, by an expired one. (Not a
        delete: a conditional delete on S3 is a check then a delete, which could remove
        the record of a writer that took over in between; a conditional PUT cannot.)"""
        if self._released.is_set():
            return
        self._released.set()
        with self._mutex:
            if self._lost is None:
                # Unreachable: the lease expires by itself.
                with contextlib.suppress(OSError):
                    self.location.write_if(
                        self.key,
                        _record(self.holder, -self.seconds),
                        generation=self._lease_generation,
                    )

    def _keep(self) -> None:
        while not self._released.wait(self.seconds / 4):
            if self._lost is not None:
                return
            self._renew()

    def _renew(self) -> None:
        with self._mutex:
            if self._lost is not None or self._released.is_set():
                return
            started = time.monotonic()
            record = _record(self.holder, self.seconds)
            try:
                generation = self.location.write_if(
                    self.key, record, generation=self._lease_generation
                )
                if generation is None:
                    # A retried request whose first attempt landed fails its condition.
                    current = self.location.read_versioned(self.key)
                    generation = current.generation if current.value == record else None
            except OSError:
                return  # try again at the next renewal; check() fences once it is too old
            if generation is None:
                self._lost = "another writer took its lease over"
                return
            self._lease_generation = generation
            self._renewed = started


def lease_alive(location: Location, key: str) -> bool:
    """Whether the lease at ``key`` is held (its record has not expired)."""
    return _unexpired(json_object(location.read(key)))


def lease_holders(location: Location) -> list[dict[str, Any]]:
    """The writers whose lease on the store has not expired (see ``Location.holders``); reads
    only."""
    keys = [LEASE_KEY, *sorted(location.list(WRITERS_DIR))]
    out = []
    for key in keys:
        record = json_object(location.read(key))
        if _unexpired(record):
            kind = "single writer" if key == LEASE_KEY else "shared writer"
            out.append({k: v for k, v in record.items() if k != "token"} | {"kind": kind})
    return out


def _unexpired(record: dict[str, Any]) -> bool:
    """Whether a lease record is still held (its ``expires`` lies ahead)."""
    return float(record.get("expires", 0)) > time.time()


def _record(holder: dict[str, Any], seconds: float) -> bytes:
    return json.dumps({**holder, "expires": time.time() + seconds}).encode("utf-8")


def _locked(location: Location, record: dict[str, Any]) -> LockedError:
    holder: dict[str, object] = {
        k: record[k] for k in ("host", "pid", "since", "expires") if k in record
    }
    left = max(0.0, float(record.get("expires", 0)) - time.time())
    return LockedError(
        f"store {location.url!r} is open for writing by pid {holder.get('pid')} on host "
        f"{holder.get('host')!r} since {holder.get('since')} (its lease runs {left:.0f} s "
        "more unless renewed); one writer per store: close it there first, wait for its "
        "lease to expire if it died, or open this one read-only (read_only=True)",
        holder=holder,
    )
