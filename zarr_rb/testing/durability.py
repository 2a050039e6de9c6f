"""A durability recorder: what was fsynced, compared with the filesystem itself, at each
commit publish."""

from __future__ import annotations

import os
from pathlib import Path, PurePath
from typing import Any

from zarr_rb.locations.base import NOT_DATA, is_temporary
from zarr_rb.util.io import IOKind


def _entry_state(path: Path, skip: frozenset[Path] = frozenset()) -> tuple[Any, ...] | None:
    """What must be durable about a file (its inode and content stamp) or a directory (its
    entries and their inodes, but those in ``skip``)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if path.is_dir():
        entries = frozenset(
            (p.name, p.stat().st_ino)
            for p in path.iterdir()
            if not is_temporary(p.name) and p.name not in NOT_DATA and p not in skip
        )
        return ("dir", st.st_ino, entries)
    return ("file", st.st_ino, st.st_size, st.st_mtime_ns)


def _tree_state(root: Path, skip: frozenset[Path] = frozenset()) -> dict[Path, tuple[Any, ...]]:
    """The state of every file and directory under ``root``, but the files in ``skip``."""
    state: dict[Path, tuple[Any, ...]] = {}
    for dirpath, _, filenames in os.walk(root):
        directory = Path(dirpath)
        if directory in skip:
            continue
        entry = _entry_state(directory, skip)
        if entry is not None:
            state[directory] = entry
        for name in filenames:
            path = directory / name
            if is_temporary(path.name) or name in NOT_DATA or path in skip:
                continue
            entry = _entry_state(path)
            if entry is not None:
                state[path] = entry
    return state


class DurabilityRecorder:
    """An I/O observer that checks, at every commit publish, that each file and directory
    changed since the previous publish was fsynced after its last change.

    It looks at the filesystem itself (inodes, sizes, modification times, directory
    entries), not at what the engine says it wrote, so a write the engine forgot to
    announce is caught too. Files written atomically (temporary file, fsync, rename)
    count as fsynced through their temporary name.

    Files of a block written while the next rows come (announced ``"behind"``) are left out
    until their write has landed (``"landed"``): no commit made meanwhile names their rows
    (``docs/design/block-writes.md``); the first publish after it checks them.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.publishes = 0
        self.fsyncs = 0
        self.writes = 0
        self.checked = 0
        self.violations: list[str] = []
        self._last = _tree_state(self.root) if self.root.exists() else {}
        self._synced_dirs: dict[Path, set[tuple[Any, ...] | None]] = {}
        """The states a directory was fsynced in: whole, and without the entries of writes
        still running (it holds those too, once they land)."""
        self._synced_files: set[tuple[Any, ...]] = set()
        self._behind: set[Path] = set()
        self._behind_made: dict[Path, list[Path]] = {}

    def __call__(self, kind: IOKind, announced: PurePath) -> None:
        path = Path(announced)
        if kind == "fsync":
            self.fsyncs += 1
            state = _entry_state(path)
            if state is not None and state[0] == "dir":
                self._synced_dirs[path] = {state, _entry_state(path, frozenset(self._behind))}
            elif state is not None:
                self._synced_files.add(state[1:])
        elif kind == "write":
            self.writes += 1
        elif kind == "behind":
            # The file, and the directories its write will make.
            made = [path]
            parent = path.parent
            while parent != self.root and self.root in parent.parents and not parent.exists():
                made.append(parent)
                parent = parent.parent
            self._behind_made[path] = made
            self._behind.update(made)
            # Its directory, durable as it is, is durable without it too.
            parent = made[-1].parent
            synced = self._synced_dirs.get(parent, set())
            if _entry_state(parent) in synced:
                synced.add(_entry_state(parent, frozenset(self._behind)))
        elif kind == "landed":
            # Checked at the next publish, whatever the ones before saw of them.
            made = self._behind_made.pop(path, [path])
            self._behind.difference_update(made)
            for entry in [*made, made[-1].parent]:
                self._last.pop(entry, None)
        elif kind == "publish":
            self._check()

    def _check(self) -> None:
        self.publishes += 1
        now = _tree_state(self.root, frozenset(self._behind))
        for path, state in now.items():
            if self._last.get(path) == state:
                continue
            self.checked += 1
            synced = (
                state in self._synced_dirs.get(path, set())
                if state[0] == "dir"
                else state[1:] in self._synced_files
            )
            if not synced:
                what = "directory" if state[0] == "dir" else "file"
                self.violations.append(
                    f"publish #{self.publishes}: {what} {path.relative_to(self.root)} changed "
                    "since the previous commit and was not fsynced after its last change",
                )
        self._last = now
