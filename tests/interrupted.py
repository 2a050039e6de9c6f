"""A slice sampler that lets writers commit between its scan and the buffer's gather."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchrl.data import RandomSampler, SliceSampler


class Interrupted(SliceSampler):
    """A :class:`SliceSampler` that calls ``meanwhile()`` once it scanned the trajectories,
    before the buffer gathers the rows it drew."""

    def __init__(self, meanwhile: Callable[[], Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.meanwhile = meanwhile

    def _get_stop_and_length(self, storage: Any, fallback: bool = True) -> Any:
        found = super()._get_stop_and_length(storage, fallback)
        self.meanwhile()
        return found


class DrawnThenInterrupted(RandomSampler):
    """A :class:`RandomSampler` that calls ``meanwhile()`` once it drew, before the buffer
    gathers the rows it drew."""

    def __init__(self, meanwhile: Callable[[], Any]) -> None:
        super().__init__()
        self.meanwhile = meanwhile

    def sample(self, storage: Any, batch_size: int) -> Any:
        drawn = super().sample(storage, batch_size)
        self.meanwhile()
        return drawn
