"""``python -m zarr_rb``: see :mod:`zarr_rb.cli`."""

from __future__ import annotations

import sys

from zarr_rb.cli import main

sys.exit(main())
