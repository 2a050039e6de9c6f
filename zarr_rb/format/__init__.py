"""The format of a store, as pure records: what its record and layout hold, checked and
turned to and from JSON, with no torch and no I/O. The lowest layer of the package with
:mod:`zarr_rb.errors` and :mod:`zarr_rb.util`: it imports nothing else of zarr_rb.

- :mod:`~zarr_rb.format.ring`: the slot map of the copy-on-write ring (``commit.slots``).
- :mod:`~zarr_rb.format.runs`: the row runs of a shared store (``commit.runs``, an
  archive's ``commit.history``).
- :mod:`~zarr_rb.format.pieces`: large run maps kept in pieces, objects the record names:
  their form, and a map read back from them through the reader its caller gives.
- :mod:`~zarr_rb.format.index_key`: the ``"index"`` entry of rows that shared writers
  place.
"""
