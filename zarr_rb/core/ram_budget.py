"""The RAM a writer takes by default for its RAM tier: ``ram_bytes="auto"``.

A quarter of the memory available when the store opens, at most :data:`AUTO_LIMIT_BYTES`:
``MemAvailable`` of ``/proc/meminfo``, or what the process's memory cgroups (v1 or v2)
leave below their limits when that is less. The tier takes pages only as rows are written,
so a small buffer never takes its whole budget.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTO_FRACTION = 4
"""``ram_bytes="auto"`` is the memory available divided by this."""
AUTO_LIMIT_BYTES = 16 * 2**30
"""``ram_bytes="auto"`` is at most this."""

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def auto_ram_bytes() -> int:
    """The budget of ``ram_bytes="auto"``, from the memory available now."""
    return min(available_bytes() // AUTO_FRACTION, AUTO_LIMIT_BYTES)


def available_bytes() -> int:
    """Memory this process could take now without swapping: the least of the system's
    ``MemAvailable`` and the room below each memory cgroup limit above it."""
    candidates = [_mem_available()]
    candidates += [limit - usage for limit, usage in _cgroup_limits()]
    known = [max(0, value) for value in candidates if value is not None]
    return min(known) if known else 0


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
    return None


def _cgroup_limits() -> list[tuple[int, int]]:
    """``(limit, usage)`` of each memory cgroup from this process's up to the root."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            files, base = ("memory.max", "memory.current"), _CGROUP_ROOT
        elif "memory" in controllers.split(","):
            files, base = (
                ("memory.limit_in_bytes", "memory.usage_in_bytes"),
                (_CGROUP_ROOT / "memory"),
            )
        else:
            continue
        parts = Path(path.lstrip("/")).parts
        for depth in range(len(parts), -1, -1):
            directory = base.joinpath(*parts[:depth])
            limit, usage = _read_int(directory / files[0]), _read_int(directory / files[1])
            if limit is not None and usage is not None:
                out.append((limit, usage))
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max": no limit
    return int(text)
