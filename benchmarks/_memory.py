"""This process's memory, as the kernel counts it for the current address space.

``getrusage``'s ``ru_maxrss`` is kept across ``exec``, so a child started from a large
parent reports the parent's peak; ``VmHWM`` starts again with each new address space.
"""

from __future__ import annotations

from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Resident memory now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The most resident memory this address space held."""
    return _status_kib("VmHWM") * 1024


def heap_kept_free_bytes() -> int | None:
    """Bytes the C library's heap holds free (freed, not given back to the kernel), over
    all its arenas: glibc's ``mallinfo2``; ``None`` elsewhere."""
    import ctypes

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in [
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            ]
        ]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _Mallinfo2
    return int(mallinfo2().fordblks)
