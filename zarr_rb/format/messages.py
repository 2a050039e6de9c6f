"""Rows as error messages name them: a short listing of row numbers, and ranges of rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def preview_rows(rows: np.ndarray, limit: int = 8) -> str:
    """A short listing of row numbers for error messages: ``[3, 9, ...] (12 rows)``."""
    shown = ", ".join(str(int(r)) for r in rows[:limit])
    return f"[{shown}{', ...' if rows.size > limit else ''}] ({rows.size} rows)"


def describe_runs(runs: Sequence[tuple[int, int, str]] | Sequence[tuple[int, int]]) -> str:
    """``rows 6-7, 12-13`` for error messages (half-open ranges, shown inclusive)."""
    shown = ", ".join(f"{r[0]}-{r[1] - 1}" if r[1] - r[0] > 1 else f"{r[0]}" for r in runs[:8])
    more = f" and {len(runs) - 8} more ranges" if len(runs) > 8 else ""
    return f"rows {shown}{more}"
