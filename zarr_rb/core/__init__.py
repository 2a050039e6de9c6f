"""The store itself, below TorchRL: dtypes and layout of its arrays, the ledger of readable
rows, the write cache, opening (``open``), writing and committing (``store``) and reading
(``reader``). Its on-disk records are :mod:`zarr_rb.format`."""
