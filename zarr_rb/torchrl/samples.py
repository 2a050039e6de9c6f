"""A sample of a :class:`~zarr_rb.ZarrStorage` reads one commit: the sampler's draw (its scan
of a column, the length and cursor it draws from) and the buffer's gather of the rows it
drew, on a store whose rows other processes move (a reader's, or a shared store's writer's).
See ``docs/design/reader-snapshots.md``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from zarr_rb.core.reader import follows_writer
from zarr_rb.torchrl.store_backed import StoreBacked


class OneCommitSamples(StoreBacked):
    """The samples of a storage, each of one commit (see the module's docstring)."""

    def follow_writer(self) -> None:
        """A reader outside a sample moves to the writer's last commit (one read of the
        record): before it takes a view, which reads the commit it was taken at."""
        store = self._store
        if follows_writer(store) and store.commits.held() is None:
            store.refresh()
            self._show_store()

    def begin_sample(self) -> None:
        """A sampler starts drawing from this storage (a reader, or a writer of a shared
        store): move to the last commit and read it, and only it, until this thread's next
        gather (:meth:`end_sample`): a sampler's scan of a column, the length and cursor it
        draws from, and the rows gathered then are all of one commit. A writer keeps the
        rows of its last commits (``Commit.kept_from``), shared writers those whose slots
        no writer took again; a read that finds them gone raises
        :class:`~zarr_rb.errors.RowsNotCommittedError` instead of returning them."""
        if not self._samples_hold():
            return
        self._store.hold()
        self._show_store()

    def draw_again(self) -> None:
        """Rows a sample drew were gone before they could be read: move to the last
        commit (this thread holds it from now on, if it held one), to draw again there."""
        if self._store.commits.held() is not None:  # (held: only where samples hold)
            self.begin_sample()
        else:
            self.refresh()

    def _samples_hold(self) -> bool:
        """Whether this storage's samples hold a commit (see :meth:`begin_sample`): its
        rows may move under it, by another process's commits (a single writer's own
        commits never move the rows it reads)."""
        return self.read_only or self._store.is_shared

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """Inside, this thread's sampler draws (see :meth:`begin_sample`): the rows it reads
        itself (a ``SliceSampler`` reads flags of the rows it drew) end no sample."""
        with self._in_this_thread("drawing", True):
            yield

    def end_sample(self) -> None:
        """This thread's sample gathered its rows (see :meth:`begin_sample`): the next
        read moves to the writer's last commit again."""
        if self._samples_hold():
            self._store.hold(False)

    def gathered(self) -> None:
        """A gather of rows in this thread: the buffer's, at the end of a sample, unless
        the sampler is still drawing (see :meth:`drawing`)."""
        if not getattr(self._thread_state, "drawing", False):
            self.end_sample()
