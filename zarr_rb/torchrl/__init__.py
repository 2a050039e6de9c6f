""":class:`~zarr_rb.ZarrStorage` and everything that adapts a store to TorchRL.

* :mod:`~zarr_rb.torchrl.storage`: ``ZarrStorage`` (constructor, attaching to a buffer,
  state dicts, pickling), built on :mod:`~zarr_rb.torchrl.store_backed` (TorchRL's
  bookkeeping kept in the store), :mod:`~zarr_rb.torchrl.writes` and
  :mod:`~zarr_rb.torchrl.reads`;
* :mod:`~zarr_rb.torchrl.columns` (lazy, writable columns), their sources
  (:mod:`~zarr_rb.torchrl.column_sources`) and :mod:`~zarr_rb.torchrl.gather_cache`;
* data in and out: :mod:`~zarr_rb.torchrl.data_kinds`, :mod:`~zarr_rb.torchrl.leaves`,
  :mod:`~zarr_rb.torchrl.entries` (Python values, rows of different lengths) and
  :mod:`~zarr_rb.torchrl.index_forms`;
* TorchRL's components: :mod:`~zarr_rb.torchrl.guards` (samplers and writers),
  :mod:`~zarr_rb.torchrl.sharing` (several writers), :mod:`~zarr_rb.torchrl.state_dict`,
  :mod:`~zarr_rb.torchrl.checkpointer` (``rb.dumps`` / ``rb.loads``),
  :mod:`~zarr_rb.torchrl.dataloader` (PyTorch's ``DataLoader``);
* :mod:`~zarr_rb.torchrl.compat`: every private name of TorchRL zarr_rb uses.
"""
