"""What long operations show: progress bars, copying rows block by block under one, and
byte counts for people."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zarr_rb.util.malloc import release_free_memory


def progress_bar(total: int, *, desc: str, unit: str, enabled: bool) -> Any:
    """A tqdm bar, silent unless ``enabled``."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=True, disable=not enabled, leave=False
    )


def copy_in_blocks(
    read: Callable[[int, int], Any],
    write: Callable[[slice, Any], None],
    *,
    rows: int,
    row_nbytes: int,
    block_bytes: int,
    progress: bool,
    desc: str,
) -> None:
    """Copy rows ``[0, rows)`` block by block, ``write(slice(a, b), read(a, b))``, holding
    about ``block_bytes`` bytes of rows in RAM at once (the memory of each block is given
    back to the system before the next one is read)."""
    step = max(1, block_bytes // max(1, row_nbytes))
    with progress_bar(rows, desc=desc, unit="row", enabled=progress) as bar:
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            write(slice(start, stop), read(start, stop))
            release_free_memory()
            bar.update(stop - start)


def format_bytes(n: float) -> str:
    """A byte count with a binary unit, e.g. ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
