"""Every private name of TorchRL (and of torch and tensordict under it) that zarr_rb relies
on, in one place.

TorchRL's storages, samplers, writers and buffers keep their state in private attributes
and call private hooks on their storage. zarr_rb reads and writes some of that state (to
save and restore it, to append after a reopened store's last row, to keep samplers off
rows a crash withdrew) and overrides some hooks (``ZarrStorage`` is a ``TensorStorage``).
Everything of that kind goes through this module (so do the few private names of torch and
tensordict that lazy columns and data kinds need, at its end), and ``tests/test_compat.py``
checks each TorchRL name against the installed TorchRL, so that a release that renames one
fails loudly, naming the name and the TorchRL version, instead of breaking a buffer
quietly.
"""

from __future__ import annotations

import heapq
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchrl
from torchrl.data.replay_buffers import replay_buffers as _buffers
from torchrl.data.replay_buffers import samplers as _samplers
from torchrl.data.replay_buffers import writers as _writers
from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase
from torchrl.data.replay_buffers.replay_buffers import ReplayBuffer
from torchrl.data.replay_buffers.storages import ListStorage, Storage, TensorStorage
from torchrl.data.replay_buffers.storages.utils import _get_default_collate
from torchrl.data.replay_buffers.utils import _is_int, _reduce

TORCHRL_VERSION: str = torchrl.__version__

OVERRIDDEN: dict[str, str] = {
    "_len": "TorchRL reads and sets the storage's length through it",
    "_total_shape": "the storage's full shape, read by len and shape computations",
    "_storage": "the full-capacity data, read and written by checkpointers and hooks",
    "_init": "called with a first element by TorchRL's checkpointers",
    "_empty": "called by rb.empty()",
    "_rand_given_ndim": "RandomSampler draws its indices through it",
    "_apply_conditional_patch": "rb.update_if_present writes through it",
    "_default_checkpointer": "rb.dumps / rb.loads use it",
}
"""Hooks of ``TensorStorage`` that ``ZarrStorage`` overrides, and why TorchRL needs them."""

USED: dict[type, tuple[str, ...]] = {
    TensorStorage: (
        "_set_last_cursor",
        "_last_cursor",
        "_last_cursor_index",
        "_get_new_len",
        "_len_along_dim0",
        "_bump_mutation_revision",
        "_mutation_revision",
        "_mutation_revision_value",
        "_attached_entities",
        "_is_full",
        "_rng",
        "_storage",
    ),
    Storage: ("__getstate__", "__setstate__", "_compilable"),
    ListStorage: ("_storage",),
    StorageCheckpointerBase: ("_save_hooks", "_load_hooks"),
    ReplayBuffer: (
        "_init_writer",
        "_maybe_make_writer",
        "_init_sampler",
        "_maybe_make_sampler",
        "_batch_size",
        "_dim_extend",
        "_pin_memory",
        "_prefetch_cap",
        "_sample_unit",
        "_collate_fn",
        "_is_tensordict",
        "_consume_after_n_samples",
        "_rng",
        "_transform",
        "_sampler",
        "_writer",
        "_storage",
    ),
    _buffers.PrioritizedReplayBuffer: (
        "_sync",
        "_prioritized_sampler",
        "_prioritized_sampler_write_count",
    ),
    _buffers.TensorDictPrioritizedReplayBuffer: (
        "_sync",
        "_prioritized_sampler",
        "_prioritized_sampler_write_count",
    ),
    _writers.Writer: ("_compilable",),
    _writers.RoundRobinWriter: (
        "_cursor",
        "_write_count",
        "_track_generations",
        "_generation",
        "_align_generation_device",
    ),
    _writers.TensorDictMaxValueWriter: (
        "_cursor",
        "_write_count",
        "_current_top_values",
        "_rank_key",
        "_reduction",
    ),
    _samplers.PrioritizedSampler: (
        "_sum_tree",
        "_min_tree",
        "_max_capacity",
        "_alpha",
        "_beta",
        "_eps",
        "_max_priority",
        "_max_priority_within_buffer",
        "_device",
    ),
    _samplers.SamplerWithoutReplacement: (
        "_get_sample_list",
        "_sample_list",
        "_remaining_batches",
        "_ran_out",
    ),
    _samplers.SliceSampler: (
        "_get_stop_and_length",
        "_fetch_traj",
        "_traj_key_auto",
        "_cache",
        "_gpu_device",
    ),
    _samplers.StalenessAwareSampler: ("_max_staleness", "_version_key", "_weight_fn"),
}
"""Private names read, written or called, by the TorchRL class that defines them."""


def get(obj: Any, name: str) -> Any:
    """``obj.<name>``: a private TorchRL attribute, declared in :data:`USED`."""
    _check_declared(obj, name)
    return getattr(obj, name)


def put(obj: Any, name: str, value: Any) -> None:
    """``obj.<name> = value``: a private TorchRL attribute, declared in :data:`USED`."""
    _check_declared(obj, name)
    setattr(obj, name, value)


def _check_declared(obj: Any, name: str) -> None:
    if not any(name in USED.get(cls, ()) for cls in type(obj).__mro__):
        raise AssertionError(
            f"zarr_rb uses {type(obj).__qualname__}.{name}, which zarr_rb.torchrl.compat.USED does "
            "not declare (declare it there, where tests/test_compat.py checks it)",
        )


is_int = _is_int
"""TorchRL's test for an integer index (Python and numpy ints, 0-d tensors)."""

default_staleness_weight: Any = getattr(_samplers, "_default_staleness_weight", None)
"""The weight ``StalenessAwareSampler`` gives rows when it is given none (TorchRL 0.14)."""

default_collate = _get_default_collate
"""``default_collate(storage, _is_tensordict=False)``: the ``collate_fn`` a TorchRL buffer
gets when it is given none (a custom one is saved as code; this one is rebuilt)."""


# --- storages ------------------------------------------------------------------------------


def attached_count(storage: Any) -> int:
    """How many buffers and samplers are attached to ``storage`` (see :func:`detach_since`)."""
    return len(get(storage, "_attached_entities"))


def detach_since(storage: Any, count: int) -> None:
    """Detach what was attached to ``storage`` after it had ``count`` (a buffer whose
    building failed: TorchRL would notify it of every write)."""
    del get(storage, "_attached_entities")[count:]


def set_last_cursor(storage: Any, cursor: Any) -> None:
    """Record the index of the last write (TorchRL's checkpointers and samplers read it)."""
    storage._set_last_cursor(cursor)


def stored_last_cursor(storage: Any) -> Any:
    """TensorStorage's own ``_last_cursor_index`` of ``storage`` (a subclass that shows
    another one to some threads reads it here)."""
    return TensorStorage._last_cursor_index.fget(storage)


def last_cursor_index(storage: Any) -> int | None:
    """The last row written, as TorchRL's slice samplers see it."""
    index = storage._last_cursor_index
    return None if index is None else int(index)


def grow_length(storage: Any, data: Any, cursor: Any) -> None:
    """Grow the storage's length by what ``data`` written at ``cursor`` adds (TorchRL's rule)."""
    storage._get_new_len(data, cursor)


def bump_revision(storage: Any) -> None:
    """Tell samplers' caches (trajectory boundaries) that the data changed."""
    storage._bump_mutation_revision()


def revision(storage: Any) -> int:
    return int(storage._mutation_revision)


def length_along_dim0(storage: Any) -> int:
    return int(storage._len_along_dim0 or 0)


def set_length(storage: Any, length: int) -> None:
    """Set a storage's length in elements, as TorchRL's checkpointers do."""
    storage._len = length


def is_full(storage: Any) -> bool:
    return bool(storage._is_full)


def same_function(a: Any, b: Any) -> bool:
    """Whether two callables are one function (TorchRL wraps some defaults, such as its
    collate functions, in registrable wrappers that may be unwrapped later)."""
    if a is b:
        return True
    a, b = inspect.unwrap(a), inspect.unwrap(b)
    names = [(getattr(f, "__module__", None), getattr(f, "__qualname__", None)) for f in (a, b)]
    return a is b or (names[0] == names[1] and None not in names[0])


def swap_storage(buffer: Any, storage: Any) -> Any:
    """Put ``storage`` under ``buffer`` (for one ``dumps``); returns the previous one."""
    previous = buffer._storage
    buffer._storage = storage
    return previous


def storage_state(storage: Any) -> dict[str, Any]:
    """The picklable state of a storage, as TorchRL's ``Storage.__getstate__`` makes it (its
    shared counters turned into plain numbers, or kept shared for a spawned child)."""
    state: dict[str, Any] = Storage.__getstate__(storage)
    return state


def set_storage_state(storage: Any, state: dict[str, Any]) -> None:
    Storage.__setstate__(storage, state)


def share_revision(storage: Any, shared: dict[str, Any]) -> None:
    """Make storages that share one store share one mutation revision (TorchRL's samplers
    cache trajectory boundaries by it)."""
    revision = shared.get("revision")
    if revision is None:
        shared["revision"] = storage._mutation_revision_value
    else:
        storage._mutation_revision_value = revision


def storage_generator(storage: Any) -> torch.Generator | None:
    """The generator the buffer handed its storage (``rb.set_rng``)."""
    generator: torch.Generator | None = storage._rng
    return generator


# --- buffers and writers -------------------------------------------------------------------


def is_buffer_being_built(buffer: Any) -> bool:
    """Whether ``buffer`` is a replay buffer in the middle of building its components
    (TorchRL attaches the storage first, then makes the sampler and the writer)."""
    return isinstance(buffer, ReplayBuffer) and hasattr(buffer, "_init_writer")


def writer_to_build(buffer: Any) -> Any:
    """The writer a buffer that is being built will use (building it now if it was given as
    a class, a factory or ``None``), so that its state can be set before its first write."""
    writer = buffer._maybe_make_writer(buffer._init_writer)
    buffer._init_writer = writer
    return writer


def set_writer_position(writer: Any, *, cursor: int, write_count: int) -> bool:
    """Put a round-robin writer at ``cursor`` (its next write) having written ``write_count``
    elements; returns whether ``writer`` is one (other writers keep their own order)."""
    if not isinstance(writer, _writers.RoundRobinWriter):
        return False
    writer._cursor = cursor
    writer._write_count = write_count
    return True


def is_compilable(storage: Any) -> bool:
    """Whether the storage was built for ``torch.compile`` (``compilable=True``)."""
    return bool(storage._compilable)


def writer_state(writer: Any) -> tuple[Any, ...] | None:
    """What TorchRL's writers change before they call ``storage.set`` (the cursor, the write
    count, a max-value writer's heap), to put back when the storage refuses the write;
    ``None`` for other writers."""
    if isinstance(writer, _writers.TensorDictMaxValueWriter):
        heap = writer._current_top_values
        return (writer._cursor, writer._write_count, list(heap))
    if isinstance(writer, _writers.RoundRobinWriter):
        return (writer._cursor, writer._write_count)
    return None


def restore_writer_state(writer: Any, state: tuple[Any, ...]) -> None:
    writer._cursor = state[0]
    writer._write_count = state[1]
    if len(state) > 2:
        writer._current_top_values = state[2]


def sampler_to_build(buffer: Any) -> Any:
    """The sampler a buffer that is being built will use (built now if it was given as a
    class, a factory or ``None``)."""
    sampler = buffer._maybe_make_sampler(buffer._init_sampler)
    buffer._init_sampler = sampler
    return sampler


def exclude_from_priority_trees(sampler: Any, index: torch.Tensor) -> None:
    """Give elements a priority of exactly zero (never drawn; ``update_priority`` would add
    ``eps``)."""
    index = index[index < sampler._max_capacity]
    if index.numel():
        dtype = sampler.dtype
        sampler._sum_tree[index] = torch.zeros(index.shape, dtype=dtype)
        sampler._min_tree[index] = torch.full(index.shape, float("inf"), dtype=dtype)


def drop_from_permutation(sampler: Any, index: torch.Tensor, batch_size: int) -> None:
    """Remove elements from a without-replacement sampler's current permutation."""
    order = sampler._sample_list
    if order is None:
        return
    order = order[~torch.isin(order, index.to(order.device))]
    sampler._sample_list = order
    batches = order.numel() // batch_size if sampler.drop_last else -(-order.numel() // batch_size)
    sampler._remaining_batches = batches


class _Around:
    """One method of one object, routed through ``hook(method, *args, **kwargs)``, where
    ``method`` is the class's own. Picklable (the buffer and its sampler pickle) when
    ``hook`` is."""

    def __init__(self, obj: Any, name: str, hook: Callable[..., Any]) -> None:
        self.obj = obj
        self.name = name
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        method = getattr(type(self.obj), self.name).__get__(self.obj)
        return self.hook(method, *args, **kwargs)


def route_method(obj: Any, name: str, hook: Callable[..., Any]) -> bool:
    """Route ``obj.<name>(...)`` through ``hook(method, ...)`` (once: returns whether it was
    routed now). ``name`` is a sampler method of :data:`USED`: ``sample``,
    ``_get_sample_list`` (a without-replacement sampler draws a permutation),
    ``_get_stop_and_length`` (a slice sampler finds trajectory boundaries); or a writer's
    public ``add`` or ``extend``, or its ``_empty``."""
    if isinstance(obj.__dict__.get(name), _Around):
        return False
    getattr(type(obj), name)  # fails loudly if TorchRL renamed it
    obj.__dict__[name] = _Around(obj, name, hook)
    return True


def writes_positions_into_index(writer: Any) -> bool:
    """Whether ``writer`` sets each row's ``"index"`` entry to the position it writes the
    row at (TorchRL's TensorDict writers do; the others leave ``"index"`` to the data)."""
    return isinstance(
        writer, (_writers.TensorDictRoundRobinWriter, _writers.TensorDictMaxValueWriter)
    )


def rebuild_top_values(writer: Any, storage: Any) -> bool:
    """Give a max-value writer on a reopened store the heap of the rows it holds (ranked by
    its rank key, reduced as it reduces them), so that it goes on keeping the best rows
    instead of overwriting them; returns whether ``writer`` is one."""
    if not isinstance(writer, _writers.TensorDictMaxValueWriter):
        return False
    length = length_along_dim0(storage)
    ranks = storage.get(slice(0, length)).get(writer._rank_key).reshape(length, -1)
    ranks = _reduce(ranks, writer._reduction, dim=1)
    heap = [(float(rank), index) for index, rank in enumerate(ranks.tolist())]
    heapq.heapify(heap)
    writer._current_top_values = heap
    writer._cursor = length % storage.max_size
    writer._write_count = length
    return True


def is_prioritized_buffer(buffer: Any) -> bool:
    """Whether ``buffer`` is one of TorchRL's prioritized buffer classes (they keep their
    prioritized sampler, and with ``sync=False`` a second sampler, themselves)."""
    return isinstance(
        buffer, (_buffers.PrioritizedReplayBuffer, _buffers.TensorDictPrioritizedReplayBuffer)
    )


def is_sampler(obj: Any, name: str) -> bool:
    """Whether ``obj`` is an instance of TorchRL's sampler class ``name``."""
    cls = getattr(_samplers, name)
    return isinstance(obj, cls)


# --- torch and tensordict ------------------------------------------------------------------


def tensorclass_data(obj: Any) -> Any:
    """The TensorDict that holds a tensorclass instance's data (its fields, not a copy)."""
    return obj._tensordict


def tensor_version(tensor: torch.Tensor) -> int:
    """The version counter of a tensor: moves at every in-place change of its data."""
    return int(tensor._version)


def op_schema(op: Any) -> Any:
    """The schema of an aten operator overload (its arguments and which of them it
    writes into)."""
    return op._schema


def make_wrapper_subclass(cls: type, meta: torch.Tensor, dtype: torch.dtype) -> Any:
    """A new instance of the tensor subclass ``cls`` with the shape and strides of ``meta``
    and no data of its own (PyTorch's way of making a wrapper tensor subclass)."""
    return torch.Tensor._make_wrapper_subclass(
        cls, meta.shape, strides=meta.stride(), dtype=dtype, device=torch.device("cpu")
    )


FOREACH_COPY: Any = torch.ops.aten._foreach_copy_.default
"""``torch._foreach_copy_``, which TensorDict's ``update_`` and ``copy_`` run on lists of
tensors."""


CHECKPOINT_MANIFEST = "manifest.json"
"""The file ``torchrl.checkpoint`` writes at the top of every checkpoint it publishes."""
_CHECKPOINT_STAGE = re.compile(r"^\.(?P<name>.+)\.stage-[0-9a-f]{32}$")
"""The directory ``torchrl.checkpoint.Checkpoint.save`` stages a checkpoint in, beside its
destination (``.<name>.stage-<uuid4 hex>``), before it renames or zips it into place."""


def checkpoint_stage(path: Path) -> tuple[Path, Path] | None:
    """``(stage, destination)`` of the TorchRL checkpoint being staged that ``path`` is
    in, or ``None`` when it is in none."""
    for parent in path.parents:
        found = _CHECKPOINT_STAGE.match(parent.name)
        if found is not None:
            return parent, parent.parent / found["name"]
    return None
