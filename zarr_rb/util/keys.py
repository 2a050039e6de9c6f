"""The key of a leaf in a TensorDict or a store: its path of names, ``("next", "reward")``
(``()`` for a bare tensor's one leaf)."""

from __future__ import annotations

Key = tuple[str, ...]
