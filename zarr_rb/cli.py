"""Command line: ``python -m zarr_rb verify PATH [--repair]`` (also installed as ``zarr-rb``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from zarr_rb.errors import ZarrRBError
from zarr_rb.verify import verify


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zarr_rb", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "verify",
        help="read back every chunk of a store and list the damaged ones with their rows",
    )
    check.add_argument(
        "path",
        help="the store: a directory, or an s3://bucket/path URL (credentials and endpoint "
        "from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION)",
    )
    check.add_argument(
        "--repair",
        action="store_true",
        help="withdraw the rows of damaged chunks from the buffer (takes the writer lock)",
    )
    args = parser.parse_args(argv)
    try:
        report = verify(args.path, repair=args.repair)
    except (ZarrRBError, FileNotFoundError) as err:
        print(f"zarr_rb verify: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok or (args.repair and not report.damaged_state) else 1
