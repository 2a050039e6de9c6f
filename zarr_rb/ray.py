"""Ray: actors on any number of machines writing one shared store, learners sampling it.

Ray is an optional extra (``pip install 'zarr-rb[ray]'``), imported only when used.
Nothing here is needed to use a store from Ray: any actor may open
``ZarrStorage(path=url, mode="r+", shared=True)`` itself (see ``docs/many-writers.md``).
:func:`writer_actor` is that, ready-made, for data produced elsewhere::

    writer = zarr_rb.ray.writer_actor("s3://bucket/runs/pong.zarr", storage_options=...)
    ray.get(writer.extend.remote(batch))      # from any task or actor

TorchRL's own Ray buffer takes a ZarrStorage as it takes its storages:
``ReplayBuffer(storage=partial(ZarrStorage, max_size, url), service_backend="ray")``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zarr_rb.torchrl.storage import ZarrStorage
from zarr_rb.util.optional import require

__all__ = ["BufferWriter", "require_ray", "writer_actor"]


def require_ray() -> Any:
    """The ``ray`` module, or an :class:`ImportError` saying how to install it."""
    return require("ray", extra="ray", what="zarr_rb.ray")


class BufferWriter:
    """The body of a Ray actor that writes into a shared store (one of its writers)."""

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage = ZarrStorage(
            path=url, mode="r+", shared=True, storage_options=storage_options
        )

    def extend(self, data: Any) -> list[int]:
        """Append rows; returns the rows they went to (a shared store places them)."""
        import torch

        index = torch.arange(len(data))
        self.storage.set(index, data)
        return [int(i) for i in index.tolist()]

    def close(self) -> None:
        self.storage.close()


def writer_actor(
    url: str, *, storage_options: Mapping[str, Any] | None = None, **remote_options: Any
) -> Any:
    """A Ray actor holding a shared writer of the store at ``url`` (``remote_options``:
    ``num_cpus``, ``resources``... as for ``ray.remote``)."""
    ray = require_ray()
    actor = ray.remote(**(remote_options or {"num_cpus": 0}))(BufferWriter)
    return actor.remote(url, storage_options=storage_options)
