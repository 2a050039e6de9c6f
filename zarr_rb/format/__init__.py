"""The format of a zarr_rb store, as pure records: what its record and layout hold, checked
and turned to and from JSON, with no torch and no I/O (numpy only). The lowest layer of the
package with :mod:`zarr_rb.errors` and :mod:`zarr_rb.util`: it imports nothing else of
zarr_rb, so the format can be read and checked on its own.

Layout::

    store.zarr/               root group; attributes["zarr_rb"] = StoreMeta
      data/                   one array per leaf, shape [rows, *batch_dims[1:], *leaf_shape]
        observation
        next/observation      nested keys are nested groups

The root attributes are the commit point: they are replaced atomically, and only after the
rows they declare readable are on disk.

- :mod:`~zarr_rb.format.names`: the format's version, the groups and the attribute key,
  what each part of a key may be, the path of a key's array.
- :mod:`~zarr_rb.format.dtypes`: the torch dtype names a store keeps, and the dtype of the
  Zarr array that holds each.
- :mod:`~zarr_rb.format.schema`: what a store holds, :class:`~zarr_rb.format.schema.Schema`
  and each leaf's :class:`~zarr_rb.format.schema.LeafSpec`.
- :mod:`~zarr_rb.format.commit`: the rows readers may trust
  (:class:`~zarr_rb.format.commit.Commit`) and the parts of a commit: the slots of shared
  writers, of a writer on a lease, the objects created once.
- :mod:`~zarr_rb.format.record`: the whole record of the root attributes
  (:class:`~zarr_rb.format.record.StoreMeta`), with the saves and versions; parsed and
  checked from them.
- :mod:`~zarr_rb.format.ring`: the slot map of the copy-on-write ring (``commit.slots``).
- :mod:`~zarr_rb.format.runs`: the row runs of a shared store (``commit.runs``, an
  archive's ``commit.history``).
- :mod:`~zarr_rb.format.pieces`: large run maps kept in pieces, objects the record names:
  their form, and a map read back from them through the reader its caller gives.
- :mod:`~zarr_rb.format.index_key`: the ``"index"`` entry of rows that shared writers
  place.
- :mod:`~zarr_rb.format.messages`: rows as error messages name them.
"""
