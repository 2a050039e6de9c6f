"""How the analysis face names keys: as TensorDict does (``"obs"``, ``("next", "reward")``),
as messages show them, and as the command line takes them (``next.reward``)."""

from __future__ import annotations

from zarr_rb.util.keys import Key

KeyLike = str | Key

TENSOR_KEY = "tensor"
"""The name of the one leaf of a store of bare tensors (whose key is ``()``)."""


def public_key(key: Key) -> KeyLike:
    """``("obs",)`` as ``"obs"``, nested keys as tuples, ``()`` as :data:`TENSOR_KEY`."""
    if not key:
        return TENSOR_KEY
    return key[0] if len(key) == 1 else key


def shown(key: KeyLike | Key) -> str:
    """A key as messages show it: ``'obs'``, ``('next', 'reward')``."""
    return repr(public_key((key,) if isinstance(key, str) else key))


def dotted(key: Key) -> str:
    """A key as the command line names it: ``next.reward``."""
    return ".".join(key) if key else TENSOR_KEY


def parse_dotted(text: str) -> Key:
    return tuple(text.split("."))
