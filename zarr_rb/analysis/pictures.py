"""Pictures of a store: an episode's frames as an animated GIF or a PNG strip (Pillow) or an
MP4 video (OpenCV, with the FFmpeg its wheels carry), and its episodes' returns and lengths
as a plot (matplotlib). Optional: the ``analysis`` extra (``pip install -e '.[analysis]'``
in a checkout of zarr_rb)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from zarr_rb.analysis._keys import KeyLike, public_key
from zarr_rb.errors import NotAnImageError
from zarr_rb.util.optional import require

if TYPE_CHECKING:
    from zarr_rb.analysis.episodes import Episodes
    from zarr_rb.analysis.view import View

STRIP_FRAMES = 12
"""Frames in a PNG strip (evenly spaced over the episode)."""
FRAME_SUFFIXES = {".gif": "an animated GIF", ".png": "a PNG strip", ".mp4": "an MP4 video"}
"""What :func:`write_frames` writes, by the suffix of the file's name."""
PLOT_SUFFIXES = {".png": "a PNG"}
"""What :func:`plot_episodes` writes, by the suffix of the file's name."""


def check_suffix(path: str | os.PathLike[str], suffixes: dict[str, str], *, what: str) -> str:
    """The suffix of ``path`` (lower case), if it is one of ``suffixes``; else a
    ``ValueError`` naming those that are."""
    suffix = os.path.splitext(str(path))[1].lower()
    if suffix not in suffixes:
        written = " or ".join(f"{name} ({suffixes[name]})" for name in suffixes)
        got = f"the suffix {suffix!r}" if suffix else "no suffix"
        instead = os.path.splitext(str(path))[0] + next(iter(suffixes))
        raise ValueError(
            f"cannot write {str(path)!r}, whose name has {got}: {what} are written as "
            f"{written}; name the file so, e.g. {instead!r}"
        )
    return suffix


def image_keys(view: View) -> list[KeyLike]:
    """The keys whose rows are images (``uint8`` ``[C, H, W]``, ``[H, W, 3]`` or ``[H, W]``)."""
    return [key for key, column in view.schema.items() if _image_problem(column) is None]


def _image_problem(column: Any) -> str | None:
    if column.kind != "tensor" or str(column.dtype) != "torch.uint8":
        return f"{str(column.dtype).removeprefix('torch.')} values"
    shape = column.shape
    if len(shape) not in (2, 3) or (min(shape[-2:]) < 8 and shape[-1] != 3):
        return f"rows of shape {list(shape)}"
    return None


def to_frames(images: np.ndarray) -> np.ndarray:
    """Rows of an image key as frames: ``[N, H, W]`` (grey) or ``[N, H, W, 3]`` (RGB).
    A stack of frames (``[C, H, W]`` with ``C`` other than 1 or 3) shows its last frame."""
    if images.ndim == 3:
        return images
    if images.shape[-1] == 3 and images.shape[1] != 3:
        return images  # channels last
    if images.shape[1] == 3:
        return np.ascontiguousarray(images.transpose(0, 2, 3, 1))
    return images[:, -1]


def episode_frames(view: View, episode: int, key: KeyLike | None = None) -> np.ndarray:
    """The frames of ``episode`` (see :func:`to_frames`), of ``key`` or the first image key."""
    key = _image_key(view, key)
    images = view.select(key).episode(episode)[key]
    return to_frames(images.numpy())


def _image_key(view: View, key: KeyLike | None) -> KeyLike:
    schema = view.schema
    if key is None:
        found = image_keys(view)
        if not found:
            shown = ", ".join(f"{k!r}: {c!r}" for k, c in schema.items())
            raise NotAnImageError(
                f"{view.url!r} holds no image key (uint8 [C, H, W] or [H, W]); it holds {shown}"
            )
        return found[0]
    key = public_key(view.key_of(key))
    problem = _image_problem(schema[key])
    if problem is not None:
        raise NotAnImageError(
            f"key {key!r} of {view.url!r} holds {problem}, not images (uint8 [C, H, W], "
            f"[H, W, 3] or [H, W]); image keys: {image_keys(view) or 'none'}"
        )
    return key


def write_frames(frames: np.ndarray, path: str | os.PathLike[str], *, fps: float = 15) -> int:
    """Write ``frames`` as an animated GIF (``.gif``), an MP4 video (``.mp4``) or a PNG
    strip of up to :data:`STRIP_FRAMES` of them (``.png``). Returns the number of frames
    written.

    Raises:
        ValueError: ``path`` has another suffix (nothing is written), no frame is given, or
            ``fps`` is not positive.
        FileNotFoundError: the folder of ``path`` does not exist.
        OSError: the MP4 encoder could not write ``path``.
    """
    suffix = check_suffix(path, FRAME_SUFFIXES, what="frames")
    if not len(frames):
        raise ValueError("no frame to write: the episode has no row")
    if not fps > 0:
        raise ValueError(f"expected a positive number of frames per second, got {fps}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {str(path)!r}: there is no folder {folder!r}")
    if suffix == ".mp4":
        return _write_mp4(frames, path, fps=fps)
    image = require("PIL.Image", extra="analysis", what="writing frames as a GIF or PNG")
    mode = "RGB" if frames.ndim == 4 else "L"
    if suffix == ".gif":
        pictures = [image.fromarray(frame, mode) for frame in frames]
        pictures[0].save(
            path,
            save_all=True,
            append_images=pictures[1:],
            duration=max(1, round(1000 / fps)),
            loop=0,
        )
        return len(pictures)
    picked = np.unique(np.linspace(0, len(frames) - 1, min(STRIP_FRAMES, len(frames))).round())
    strip = np.concatenate([frames[int(i)] for i in picked], axis=1)
    image.fromarray(strip, mode).save(path, format="PNG")
    return int(picked.size)


def _write_mp4(frames: np.ndarray, path: str | os.PathLike[str], *, fps: float) -> int:
    """Frames as MPEG-4 video (``mp4v``, which every FFmpeg build encodes), in colour, each
    frame padded with black to an even width and height (the encoder's unit)."""
    cv2 = require("cv2", extra="analysis", what="writing frames as an MP4 video")
    height, width = frames.shape[1:3]
    size = (width + width % 2, height + height % 2)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, size, True)
    if not writer.isOpened():
        raise OSError(f"cannot write {str(path)!r}: OpenCV's MP4 encoder did not open it")
    try:
        for frame in frames:
            bgr = cv2.cvtColor(frame, cv2.COLOR_GRAY2BGR if frame.ndim == 2 else cv2.COLOR_RGB2BGR)
            writer.write(np.pad(bgr, ((0, height % 2), (0, width % 2), (0, 0))))
    finally:
        writer.release()
    return len(frames)


def plot_episodes(episodes: Episodes, path: str | os.PathLike[str], *, title: str) -> int:
    """Plot the returns and lengths of ``episodes`` (of the store named ``title``), oldest
    first, into a PNG. Returns the number of episodes plotted."""
    check_suffix(path, PLOT_SUFFIXES, what="plots")
    matplotlib = require("matplotlib", extra="analysis", what="plotting episodes")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    number = np.arange(len(episodes))
    done = episodes.complete
    figure, (returns, lengths) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    for axes, values, label in (
        (returns, episodes.returns, "return"),
        (lengths, episodes.length, "length (rows)"),
    ):
        axes.plot(number[done], values[done], ".", label="complete")
        axes.plot(number[~done], values[~done], "x", color="tab:red", label="incomplete")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    returns.legend(loc="best", fontsize="small")
    lengths.set_xlabel("episode (oldest first)")
    returns.set_title(f"{len(episodes)} episodes of {title}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return len(episodes)
