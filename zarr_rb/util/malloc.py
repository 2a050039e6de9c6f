"""Giving freed heap memory back to the system between the blocks of a long copy.

glibc's allocator keeps memory that the decoder's threads freed in their arenas (after
the first large buffer it frees, it also stops mapping large buffers apart), so a copy of
a whole store block by block grows the process by far more than one block, and keeps it.
``malloc_trim`` returns what is free; elsewhere (other C libraries, other systems) there
is nothing to do.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, looked up among the symbols this process has loaded."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (or no dlopen of the process)
        return None
    return trim


def release_free_memory() -> None:
    """Return the heap memory freed so far to the system, where the C library can."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
