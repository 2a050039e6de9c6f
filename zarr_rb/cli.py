"""The ``zarr-rb`` command (also ``python -m zarr_rb``): look at a store, picture it, copy,
convert and check it.

Exit codes: 0 done; 1 ``verify`` found damage (and did not repair it); 2 bad input, or an
error of the store (the message says what and how to fix it); 130 interrupted.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Callable, Sequence
from typing import Any

from zarr_rb._progress import format_bytes
from zarr_rb.errors import LockedError, ZarrRBError

EPILOG = (
    "Stores are local paths or s3://bucket/path URLs (credentials and endpoint from "
    "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION). "
    "Exit codes: 0 done, 1 verify found damage, 2 bad input or a store error, 130 interrupted."
)
_PATH_HELP = "the store: a directory or an s3://bucket/path URL"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print("zarr-rb: interrupted", file=sys.stderr)
        return 130
    except (ZarrRBError, FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"zarr-rb {args.command}: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zarr-rb", description=__doc__, epilog=EPILOG)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[[argparse.Namespace], int], summary: str) -> Any:
        sub = commands.add_parser(name, help=summary, description=summary, epilog=EPILOG)
        sub.set_defaults(run=run)
        return sub

    info = command(
        "info",
        _info,
        "schema, rows, holes, compression per key, episodes, saved state and writers of a store",
    )
    info.add_argument("path", help=_PATH_HELP)
    _episode_options(info)

    episodes = command("episodes", _episodes, "a table of the episodes of a store, oldest first")
    episodes.add_argument("path", help=_PATH_HELP)
    _episode_options(episodes)
    episodes.add_argument(
        "--limit", type=int, default=40, help="episodes shown: the first and last (default 40)"
    )
    episodes.add_argument("--csv", metavar="FILE", help="also write every episode to a CSV file")

    show = command(
        "show", _show, "the frames of an episode as an animated GIF (.gif) or a PNG strip (.png)"
    )
    show.add_argument("path", help=_PATH_HELP)
    show.add_argument("--episode", type=int, required=True, help="episode number (-1: newest)")
    show.add_argument("--key", help="image key, e.g. observation or next.pixels (default: first)")
    show.add_argument("-o", "--output", required=True, help="the .gif or .png to write")
    show.add_argument("--fps", type=float, default=15, help="GIF frames per second (default 15)")
    show.add_argument(
        "--stride", type=int, default=1, help="show every n-th row of the episode (default 1)"
    )
    _episode_options(show)

    plot = command("plot", _plot, "a PNG plot of episode returns and lengths over the buffer")
    plot.add_argument("path", help=_PATH_HELP)
    plot.add_argument("-o", "--output", required=True, help="the .png to write")
    _episode_options(plot)

    snapshot = command(
        "snapshot", _snapshot, "copy a store (rows and saved state) to a new path, as it is now"
    )
    snapshot.add_argument("source", help=_PATH_HELP)
    snapshot.add_argument("dest", help="the new store (must not exist)")

    imports = command("import", _import, "import a TorchRL dump (rb.dumps(dir)) into a new store")
    imports.add_argument("dump", help="the directory given to TorchRL's rb.dumps(dir)")
    imports.add_argument("dest", help="the new store")

    export = command(
        "export", _export, "export a saved store as a TorchRL dump (rb.loads(dir) reads it)"
    )
    export.add_argument("source", help=_PATH_HELP)
    export.add_argument("dest", help="the directory to write (must not exist)")
    export.add_argument(
        "--allow-pickle",
        action="store_true",
        help="unpickle the store's saved transforms and custom objects (only stores you trust)",
    )

    check = command(
        "verify",
        _verify,
        "read back every chunk of a store and list the damaged ones with their rows",
    )
    check.add_argument("path", help=_PATH_HELP)
    check.add_argument(
        "--repair",
        action="store_true",
        help="withdraw the rows of damaged chunks from the buffer (takes the writer lock)",
    )
    return parser


def _episode_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--episode-key",
        help="the key marking episodes: a boolean done flag or integer trajectory ids, "
        "nested keys with dots (default: collector.traj_ids, episode, next.done, done, ...)",
    )
    parser.add_argument("--reward-key", help="the key summed into returns (default next.reward)")


def _key(text: str | None) -> tuple[str, ...] | None:
    from zarr_rb.analysis._keys import parse_dotted

    return None if text is None else parse_dotted(text)


def _open(args: argparse.Namespace) -> Any:
    from zarr_rb.analysis import open as open_view

    return open_view(
        args.path, episode_key=_key(args.episode_key), reward_key=_key(args.reward_key)
    )


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False)


# --- commands --------------------------------------------------------------------------


def _info(args: argparse.Namespace) -> int:
    from rich.table import Table

    from zarr_rb.analysis.report import describe

    with _open(args) as view:
        report = describe(view)
    console = _console()
    console.print(
        f"[bold]{report.url}[/bold]  (zarr_rb format {report.format_version})", soft_wrap=True
    )
    rows = " x ".join(str(n) for n in report.shape)
    console.print(
        f"rows      {rows} of {report.capacity} (cursor {report.cursor}, commit "
        f"{report.generation})"
    )
    holes = ", ".join(f"{a}-{b - 1}" for a, b in report.holes) if report.holes else "none"
    console.print(f"holes     {holes}")
    console.print(f"episodes  {report.episodes}")
    console.print(f"saved     {report.saved}")
    writers = [
        f"{w.get('kind')}: pid {w.get('pid')} on {w.get('host')} since {w.get('since')}"
        for w in report.writers
    ]
    console.print(f"writers   {'; '.join(writers) or 'none (no process holds the store)'}")
    table = Table(title=f"keys (store compression {report.codec})", title_justify="left")
    columns = (
        "key",
        "dtype",
        "shape",
        "kind",
        "rows per object",
        "codec",
        "stored",
        "raw",
        "ratio",
    )
    for name in columns:
        table.add_column(name, justify="right" if name in ("stored", "raw", "ratio") else "left")
    for key in report.keys:
        ratio = f"{key.ratio:.1f}x" if key.raw_bytes else "-"
        raw = format_bytes(key.raw_bytes) if key.raw_bytes else "-"
        table.add_row(
            key.key,
            key.dtype,
            key.shape,
            key.kind,
            key.chunking,
            key.codec,
            format_bytes(key.stored_bytes),
            raw,
            ratio,
        )
    console.print(table)
    return 0


def _episodes(args: argparse.Namespace) -> int:
    from rich.table import Table

    with _open(args) as view:
        episodes = view._episode_index()
    columns = episodes.columns()
    n = len(episodes)
    if args.csv:
        with open(args.csv, "w", newline="") as file:
            out = csv.writer(file)
            out.writerow(columns)
            out.writerows(zip(*(c.tolist() for c in columns.values()), strict=True))
    shown = list(range(n))
    limit = max(2, args.limit)
    if n > limit:
        shown = [*range(limit // 2), -1, *range(n - limit // 2, n)]
    table = Table()
    for name in columns:
        table.add_column(name, justify="right")
    for i in shown:
        if i < 0:
            table.add_row(*("..." for _ in columns))
            continue
        table.add_row(*(_cell(c[i]) for c in columns.values()))
    console = _console()
    console.print(f"{n} episodes of {view.url}", soft_wrap=True)
    console.print(table)
    return 0


def _show(args: argparse.Namespace) -> int:
    from zarr_rb.analysis.pictures import episode_frames, write_frames

    key = None if args.key is None else _key(args.key)
    with _open(args) as view:
        frames = episode_frames(view, args.episode, key)
    if args.stride < 1:
        raise ValueError(f"expected --stride >= 1, got {args.stride}")
    written = write_frames(frames[:: args.stride], args.output, fps=args.fps)
    print(f"wrote {args.output}: {written} frames of episode {args.episode}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from zarr_rb.analysis.pictures import plot_episodes

    with _open(args) as view:
        count = plot_episodes(view, args.output)
    print(f"wrote {args.output}: {count} episodes")
    return 0


def _snapshot(args: argparse.Namespace) -> int:
    from zarr_rb.locations import open_location
    from zarr_rb.storage import ZarrStorage

    with ZarrStorage(path=args.source, read_only=True) as source:
        writers = source._store.engine.location.holders()
        if writers:
            who = ", ".join(f"pid {w.get('pid')} on {w.get('host')}" for w in writers)
            raise LockedError(
                f"store {source.url!r} is being written ({who}): a copy could catch rows "
                "half-written; close the writers first, or snapshot from the writing "
                "process with zarr_rb.save(rb, dest)",
                holder=writers[0],
            )
        target = open_location(args.dest)
        target.check_usable()
        copied = source._store.engine.snapshot_to(target, progress=True)
    print(
        f"wrote {args.dest} ({format_bytes(copied)} copied, the rest linked or copied server-side)"
    )
    return 0


def _import(args: argparse.Namespace) -> int:
    from zarr_rb.convert import buffer_like_dump, import_torchrl

    buffer = buffer_like_dump(args.dump, args.dest)
    try:
        path = import_torchrl(args.dump, buffer)
    finally:
        buffer.storage.close()
    print(f"wrote {path}: {type(buffer).__name__} of {len(buffer)} rows")
    return 0


def _export(args: argparse.Namespace) -> int:
    from zarr_rb.convert import export_torchrl

    path = export_torchrl(args.source, args.dest, allow_pickle=args.allow_pickle)
    print(f"wrote {path}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from zarr_rb.verify import verify

    report = verify(args.path, repair=args.repair)
    print(report)
    return 0 if report.ok or (args.repair and not report.damaged_state) else 1


def _cell(value: Any) -> str:
    value = value.item() if hasattr(value, "item") else value
    return f"{value:.4g}" if isinstance(value, float) else str(value)
