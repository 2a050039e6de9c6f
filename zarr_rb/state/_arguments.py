"""Constructor arguments of TorchRL's buffers, samplers and writers, read from the installed
TorchRL's signatures, and the versions a save was made with.

A component's settings are saved as the arguments its constructor takes, by name, and it is
rebuilt by passing them back. The names come from ``inspect.signature`` of the installed
class, not from a list written here, so an argument a TorchRL release adds is saved too (or
the save fails, naming it, when it cannot be read back from the object). The only arguments
left out are in :data:`EXCLUDED`, each with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from zarr_rb._version import __version__
from zarr_rb.errors import TorchRLVersionError, UnsupportedDataError
from zarr_rb.torchrl import compat

_BUFFER: dict[str, str] = {
    "storage": "the rows: the store itself, reopened by zarr_rb.load",
    "sampler": "saved apart, by its own adapter (sampler/)",
    "writer": "saved apart, by its own adapter (writer/)",
    "transform": "saved apart (transforms/): its state as arrays, the objects pickled",
    "transform_factory": "consumed at construction: the transform it made is saved",
    "collate_fn": "saved apart (objects/): TorchRL's default is rebuilt, a custom one pickled",
    "checkpointer": "saved apart ('checkpointer'): the storage's, by class and keys, or pickled",
    "generator": "saved apart (generator/): its state",
    "compilable": "only builds TorchRL's default ListStorage; the storage is the store",
    "delayed_init": "a loaded buffer is built initialized, to receive the saved state",
    "service_backend": "a remote buffer's deployment; a direct buffer takes only the default",
    "service_backend_options": "a remote buffer's deployment; a direct buffer takes none",
    "transport": "a remote buffer's transport; a direct buffer keeps none",
    "transport_options": "a remote buffer's transport; a direct buffer takes none",
}
_PRIORITIZED_BUFFER: dict[str, str] = dict.fromkeys(
    ("alpha", "beta", "eps", "dtype", "reduction", "sampler_device"),
    "the prioritized sampler's own setting, saved with it (its adapter)",
)
_STATIC_TRAJECTORIES: dict[str, str] = dict.fromkeys(
    ("ends", "trajectories"),
    "a tensor consumed at construction into the sampler's trajectory cache, which is saved "
    "with its state",
)

EXCLUDED: dict[str, dict[str, str]] = {
    "HERReplayBuffer": {
        **_BUFFER,
        "reward_fn": "code: saved apart (objects/), pickled, or passed to zarr_rb.load again",
    },
    "ReplayBuffer": _BUFFER,
    "TensorDictReplayBuffer": _BUFFER,
    "PrioritizedReplayBuffer": {**_BUFFER, **_PRIORITIZED_BUFFER},
    "TensorDictPrioritizedReplayBuffer": {**_BUFFER, **_PRIORITIZED_BUFFER},
    "SliceSampler": _STATIC_TRAJECTORIES,
    "SliceSamplerWithoutReplacement": _STATIC_TRAJECTORIES,
    "PrioritizedSliceSampler": _STATIC_TRAJECTORIES,
}
"""Constructor arguments that are not among a class's saved settings, by class name, and
why: saved apart (a component, code, a generator), or not kept by TorchRL itself."""


def constructor_arguments(cls: type) -> tuple[str, ...]:
    """The names of the arguments ``cls(...)`` takes, in order: its ``__init__``'s, and
    those of the parents its ``**kwargs`` are handed on to."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        if klass is object:
            break
        forwards = False
        for parameter in list(inspect.signature(init).parameters.values())[1:]:
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                forwards = True
            elif (
                parameter.kind is not inspect.Parameter.VAR_POSITIONAL
                and parameter.name not in names
                # Ray adds ``_ray_trace_ctx`` to the signature of a class it makes an actor
                # of (TorchRL's Ray buffers do so with its buffer classes): not TorchRL's.
                and not parameter.name.startswith("_ray_")
            ):
                names.append(parameter.name)
        if not forwards:
            break
    return tuple(names)


def saved_arguments(cls: type) -> tuple[str, ...]:
    """The constructor arguments of ``cls`` that are saved as its settings."""
    excluded = EXCLUDED.get(cls.__name__, {})
    return tuple(name for name in constructor_arguments(cls) if name not in excluded)


def to_json(value: Any) -> Any:
    """A constructor value as JSON (tuples, such as nested keys, as lists)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, torch.device):
        return str(value)
    raise TypeError(f"a {type(value).__name__}, which is not a JSON value")


def from_json(value: Any) -> Any:
    """A constructor value from JSON: lists come back as tuples (nested keys, spans)."""
    if isinstance(value, list):
        return tuple(from_json(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class Argument:
    """How one constructor argument is read back from a built object, and passed again.

    The default reads the attribute of the same name (most TorchRL classes keep each
    argument so) and passes the JSON value back with lists as tuples.
    """

    read: Callable[[Any], Any] | None = None
    decode: Callable[[Any], Any] = from_json


def private(name: str) -> Argument:
    """An argument TorchRL keeps as the private attribute ``name`` (declared in
    :data:`zarr_rb.torchrl.compat.USED`)."""
    return Argument(read=lambda obj: compat.get(obj, name))


def read_arguments(obj: Any, special: Mapping[str, Argument]) -> dict[str, Any]:
    """The saved settings of ``obj``: each of its class's saved arguments, as JSON.

    Raises:
        UnsupportedDataError: an argument that cannot be read back from ``obj`` (an
            argument of a newer TorchRL that zarr_rb does not know how to read) or is not
            a JSON value; nothing has been written yet.
    """
    cls = type(obj)
    config = {}
    for name in saved_arguments(cls):
        argument = special.get(name, Argument())
        try:
            value = argument.read(obj) if argument.read else getattr(obj, name)
            config[name] = to_json(value)
        except (AttributeError, TypeError) as err:
            raise UnsupportedDataError(
                f"cannot save {cls.__name__}'s constructor argument {name!r} (TorchRL "
                f"{compat.TORCHRL_VERSION}): {err}. Update zarr_rb, or build the "
                f"{cls.__name__} without it",
            ) from None
    return config


def constructor_kwargs(
    cls: type,
    config: Mapping[str, Any],
    special: Mapping[str, Argument],
    *,
    saved_version: str | None,
) -> dict[str, Any]:
    """The keyword arguments that rebuild ``cls`` from its saved settings; arguments a
    store saved before they existed take the installed TorchRL's defaults.

    Raises:
        TorchRLVersionError: a saved argument the installed ``cls`` does not take.
    """
    known = constructor_arguments(cls)
    saved = saved_arguments(cls)
    kwargs = {}
    for name, value in config.items():
        if name in known and name not in saved:
            raise ValueError(f"{cls.__name__} argument {name!r} is never saved")
        if name not in known:
            raise TorchRLVersionError(
                f"the saved {cls.__name__} was built with argument {name!r}, which "
                f"{cls.__name__} of the installed TorchRL {compat.TORCHRL_VERSION} does not "
                f"take (saved with TorchRL {saved_version or 'unknown'}). Install TorchRL "
                f"{saved_version or 'of the save'} to load it",
                component=cls.__name__,
                argument=name,
                saved_version=saved_version,
                installed_version=compat.TORCHRL_VERSION,
            )
        kwargs[name] = special.get(name, Argument()).decode(value)
    return kwargs


def missing_class(name: str, *, role: str, saved_version: str | None) -> TorchRLVersionError:
    """The error for a saved class that the installed TorchRL does not have."""
    return TorchRLVersionError(
        f"the saved {role} is a {name}, which the installed TorchRL "
        f"{compat.TORCHRL_VERSION} does not have (saved with TorchRL "
        f"{saved_version or 'unknown'}). Install TorchRL {saved_version or 'of the save'} "
        "to load it",
        component=name,
        argument=None,
        saved_version=saved_version,
        installed_version=compat.TORCHRL_VERSION,
    )


def versions() -> dict[str, str]:
    """The releases a save is made with."""
    return {"torchrl": compat.TORCHRL_VERSION, "zarr_rb": __version__}
