"""The store itself, below TorchRL: its on-disk records (``format``), dtypes and layout,
the ledger of readable rows, the write cache, opening (``open``), writing and committing
(``store``) and reading (``reader``)."""
