"""Reads that never see a torn commit: the commit a read starts from is read before the
rows and again after them, and the read tried again while the commit moved (a seqlock on a
store's commit record). The store's readers, its shared writers and forked readers read so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

_C = TypeVar("_C")
_R = TypeVar("_R")


def seqlock_read(
    begin: Callable[[], _C],
    read: Callable[[_C], _R],
    stands: Callable[[_C, bool], bool],
    *,
    attempts: int,
    gave_up: Callable[[Exception | None], Exception],
    retried: tuple[type[Exception], ...] = (),
    lasting: tuple[type[Exception], ...] = (),
    pause: float = 0.001,
) -> _R:
    """``read(begin())``, once the commit re-read after it says it stands.

    Each attempt takes ``before = begin()`` (the commit the read starts from), reads
    ``read(before)`` (the rows as that commit has them; an error of one of ``retried`` fails
    this attempt, any other is raised), then asks ``stands(before, whole)`` (``whole``: the
    read did not fail), which re-reads the commit and says whether what was read from
    ``before`` holds under it. A whole read that stands is returned; a failed one that
    stands raises its error if it is one of ``lasting`` (the commit of now has the rows: no
    writer's doing). Otherwise it sleeps ``pause`` times the attempt's number and tries
    again.

    Raises:
        Exception: ``gave_up(error)`` after ``attempts`` attempts (``error``: the last
            error of ``retried``, ``None`` if none).
    """
    last_error: Exception | None = None
    for attempt in range(attempts):
        before = begin()
        failed: Exception | None = None
        try:
            out = read(before)
        except retried as err:
            failed = last_error = err
        if stands(before, failed is None):
            if failed is None:
                return out
            if isinstance(failed, lasting):
                raise failed
        time.sleep(pause * (attempt + 1))
    raise gave_up(last_error) from last_error
