"""Small helpers shared by every layer: I/O observers and bounded JSON parsing
(:mod:`~zarr_rb.util.io`), the type of a leaf's key (:mod:`~zarr_rb.util.keys`), reads
never torn by a commit (:mod:`~zarr_rb.util.seqlock`), TensorStore across ``fork()``
(:mod:`~zarr_rb.util.fork`), progress bars and block copies (:mod:`~zarr_rb.util.progress`),
giving freed memory back (:mod:`~zarr_rb.util.malloc`) and optional dependencies
(:mod:`~zarr_rb.util.optional`). They import nothing of zarr_rb but :mod:`zarr_rb.errors`."""
