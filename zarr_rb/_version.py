"""The release of zarr_rb (``zarr_rb.__version__``), importable by any module without the
package's public names."""

__version__ = "0.1.0"
