"""The ``zarr-rb`` command (also ``python -m zarr_rb``): look at a store, picture it, copy,
convert and check it.

Exit codes: 0 done; 1 ``verify`` found damage (and did not repair it); 2 bad input, or an
error of the store (the message says what and how to fix it); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import shlex
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from zarr_rb.core.ram_budget import auto_ram_bytes
from zarr_rb.errors import LockedError, ZarrRBError
from zarr_rb.util.progress import format_bytes

EPILOG = (
    "Stores are local paths or s3://bucket/path URLs (credentials and endpoint from "
    "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION). "
    "Exit codes: 0 done, 1 verify found damage, 2 bad input or a store error, 130 interrupted."
)
_PATH_HELP = "the store: a directory or an s3://bucket/path URL"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
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
        "show",
        _show,
        "the frames of an episode as an animated GIF (.gif), an MP4 video (.mp4) or a PNG "
        "strip (.png)",
    )
    show.add_argument("path", help=_PATH_HELP)
    show.add_argument("--episode", type=int, required=True, help="episode number (-1: newest)")
    show.add_argument("--key", help="image key, e.g. observation or next.pixels (default: first)")
    show.add_argument("-o", "--output", required=True, help="the .gif, .mp4 or .png to write")
    show.add_argument(
        "--fps", type=float, default=15, help="frames per second of a GIF or MP4 (default 15)"
    )
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


def _is_local(path: str) -> bool:
    # zarr_rb.locations.is_remote, whose module imports TensorStore; file:// URLs take the
    # route of remote ones (through a View).
    return "://" not in path


def _suggest(args: argparse.Namespace, old: str) -> Callable[[str], str]:
    """The command line run, with ``old`` (one of its paths) replaced by another."""

    def command(new: str) -> str:
        argv = list(args.argv)
        if old not in argv:
            return shlex.join(["zarr-rb", args.command, new])
        argv[argv.index(old)] = new
        return shlex.join(["zarr-rb", *argv])

    return command


def _check_store(args: argparse.Namespace, path: str) -> None:
    """Refuse a local ``path`` that holds no store, saying what it holds and what to do
    (a folder of stores, a TorchRL dump, ...), before anything heavy is imported."""
    if _is_local(path):
        from zarr_rb.analysis._files import check_store

        check_store(Path(path), command=_suggest(args, path))


def _open(args: argparse.Namespace) -> Any:
    _check_store(args, args.path)
    from zarr_rb.analysis import open as open_view

    return open_view(
        args.path, episode_key=_key(args.episode_key), reward_key=_key(args.reward_key)
    )


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False)


# --- commands --------------------------------------------------------------------------


@contextlib.contextmanager
def _source(args: argparse.Namespace) -> Iterator[Any]:
    """What ``info``, ``episodes`` and ``plot`` read the store from: a local store as files
    (neither torch nor TensorStore is imported), any other through a View."""
    if _is_local(args.path):
        from zarr_rb.analysis._files import LocalFiles

        yield LocalFiles(args.path, command=_suggest(args, args.path))
        return
    from zarr_rb.analysis import open as open_view
    from zarr_rb.analysis.report import ViewSource

    with open_view(args.path) as view:
        yield ViewSource(view)


def _store_episodes(args: argparse.Namespace) -> tuple[str, Any]:
    from zarr_rb.analysis.report import store_episodes

    with _source(args) as source:
        keys = {"episode_key": _key(args.episode_key), "reward_key": _key(args.reward_key)}
        return source.url, store_episodes(source, **keys)


def _info(args: argparse.Namespace) -> int:
    from zarr_rb.analysis.report import describe

    with _source(args) as source:
        keys = {"episode_key": _key(args.episode_key), "reward_key": _key(args.reward_key)}
        report = describe(source, **keys)
    _print_report(report, _console())
    return 0


def _print_report(report: Any, console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    console.print(Text(f"{report.url}  (zarr_rb format {report.format_version})", style="bold"))
    rows = " x ".join(str(n) for n in report.shape)
    holes = ", ".join(f"{a}-{b - 1}" for a, b in report.holes) if report.holes else "none"
    writers = [
        f"{w.get('kind')}: pid {w.get('pid')} on {w.get('host')} since {w.get('since')}"
        for w in report.writers
    ]
    where = f"cursor {report.cursor}, commit {report.generation}"
    lines = {
        "rows": f"{rows} of {report.capacity} ({where})",
        "holes": holes,
        "episodes": report.episodes,
        "saved": report.saved,
        "writers": "; ".join(writers) or "none (no process holds the store)",
    }
    if report.objects is not None:
        lines["objects"] = report.objects
    budget = format_bytes(auto_ram_bytes())
    lines["in RAM"] = (
        f"a writer here keeps up to {budget} of the rows it writes in RAM, each frame once "
        '(ram_bytes="auto": a quarter of the memory available now)'
    )
    indent = " " * 10
    for label, value in lines.items():
        text = textwrap.fill(
            value,
            width=max(40, console.width),
            initial_indent=label.ljust(len(indent)),
            subsequent_indent=indent,
            break_on_hyphens=False,
        )
        console.print(Text(text))
    stored = format_bytes(sum(key.stored_bytes for key in report.keys))
    keys = f"{len(report.keys)} keys, {stored} stored"
    console.print(f"\n{keys} (store compression {report.codec}):")
    headers = ("key", "dtype", "shape", "shard", "chunk", "codec", "stored", "ratio")
    cells = [
        (
            key.dtype,
            key.shape,
            "-" if key.shard_rows is None else str(key.shard_rows),
            "?" if key.chunk_rows is None else str(key.chunk_rows),
            key.codec,
            format_bytes(key.stored_bytes),
            f"{key.ratio:.1f}x" if key.raw_bytes and key.stored_bytes else "-",
        )
        for key in report.keys
    ]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(headers[1:])]
    # The key column takes what the others leave of the console (2 spaces between
    # columns); longer keys wrap after a dot.
    key_width = max(_MIN_KEY_WIDTH, console.width - sum(widths) - 2 * len(widths))
    key_width = min(key_width, max([3, *(len(key.key) for key in report.keys)]))
    table = Table(box=None, padding=(0, 1), pad_edge=False, header_style="bold underline")
    table.add_column("key", width=key_width, overflow="fold")
    for name, width in zip(headers[1:], widths, strict=True):
        right = name in ("shard", "chunk", "stored", "ratio")
        table.add_column(name, justify="right" if right else "left", no_wrap=True, min_width=width)
    for key, row in zip(report.keys, cells, strict=True):
        table.add_row(_wrap_key(key.key, key_width), *row)
    console.print(table)
    notes = "shard, chunk: rows per stored object and per compressed chunk"
    if any(key.kind == "ragged" for key in report.keys):
        notes += "; *: a dimension whose length varies from row to row"
    notes = textwrap.fill(f"({notes}; ratio: raw bytes / stored bytes)", max(40, console.width))
    console.print(Text(notes, style="dim"))


_MIN_KEY_WIDTH = 12


def _wrap_key(key: str, width: int) -> str:
    """``key`` in lines of at most ``width`` characters, broken after dots where it can."""
    parts = [part + "." for part in key.split(".")]
    parts[-1] = parts[-1][:-1]
    lines = [""]
    for part in parts:
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        while len(lines[-1]) + len(part) > width:
            room = width - len(lines[-1])
            lines[-1] += part[:room]
            part = part[room:]
            lines.append("")
        lines[-1] += part
    return "\n".join(line for line in lines if line)


def _episodes(args: argparse.Namespace) -> int:
    from rich.table import Table

    url, episodes = _store_episodes(args)
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
    console.print(f"{n} episodes of {url}", soft_wrap=True)
    console.print(table)
    return 0


def _show(args: argparse.Namespace) -> int:
    from zarr_rb.analysis.pictures import (
        FRAME_SUFFIXES,
        check_suffix,
        episode_frames,
        write_frames,
    )

    check_suffix(args.output, FRAME_SUFFIXES, what="frames")
    if args.stride < 1:
        raise ValueError(f"expected --stride >= 1, got {args.stride}")
    key = None if args.key is None else _key(args.key)
    with _open(args) as view:
        frames = episode_frames(view, args.episode, key)
    written = write_frames(frames[:: args.stride], args.output, fps=args.fps)
    print(f"wrote {args.output}: {written} frames of episode {args.episode}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from zarr_rb.analysis.pictures import PLOT_SUFFIXES, check_suffix, plot_episodes

    check_suffix(args.output, PLOT_SUFFIXES, what="plots")
    url, episodes = _store_episodes(args)
    count = plot_episodes(episodes, args.output, title=os.path.basename(url.rstrip("/")))
    print(f"wrote {args.output}: {count} episodes")
    return 0


def _snapshot(args: argparse.Namespace) -> int:
    _check_store(args, args.source)
    from zarr_rb.locations import open_location
    from zarr_rb.torchrl.storage import ZarrStorage

    with ZarrStorage(path=args.source, read_only=True) as source:
        writers = source.store.engine.location.holders()
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
        copied = source.store.engine.snapshot_to(target, progress=True)
    print(
        f"wrote {args.dest} ({format_bytes(copied)} copied, the rest linked or copied server-side)"
    )
    return 0


def _import(args: argparse.Namespace) -> int:
    from zarr_rb.interop.dumps import buffer_like_dump, import_torchrl

    buffer = buffer_like_dump(args.dump, args.dest)
    try:
        path = import_torchrl(args.dump, buffer)
    finally:
        buffer.storage.close()
    print(f"wrote {path}: {type(buffer).__name__} of {len(buffer)} rows")
    return 0


def _export(args: argparse.Namespace) -> int:
    _check_store(args, args.source)
    from zarr_rb.interop.export import export_torchrl

    path = export_torchrl(args.source, args.dest, allow_pickle=args.allow_pickle)
    print(f"wrote {path}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    _check_store(args, args.path)
    from zarr_rb.verify import verify

    report = verify(args.path, repair=args.repair)
    print(report)
    return 0 if report.ok or (args.repair and not report.damaged_state) else 1


def _cell(value: Any) -> str:
    value = value.item() if hasattr(value, "item") else value
    return f"{value:.4g}" if isinstance(value, float) else str(value)
