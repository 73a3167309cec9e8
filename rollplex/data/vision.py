"""Video and image decoding with the qwen-vl-utils 0.0.10 sampling and resizing rules.

The defaults are the constants Video-R1 trains with (docs/video-r1-format.md, "Video sampling"): 4-16 frames
sampled at 2 fps, about 100k pixels per video frame, images within [3136, 200704] pixels. The arithmetic of
``smart_resize``, ``smart_nframes`` and the per-frame video budget follows qwen-vl-utils exactly
(docs/video-r1-format.md, "Video sampling"), so the frame count, the resized size and the ``sample_fps`` match
what the reference pipeline hands to the processor. ``sample_fps`` is always the rate of the frames actually
sampled, ``n / total_frames * video_fps``; it is the one value that defines ``second_per_grid_ts`` downstream
(field case B04).

Example:
    clip = read_video(Path("Video-R1-data/CLEVRER/video_1.mp4"), VideoSampling())
    clip.frames.shape   # torch.Size([16, 3, 252, 392]) for a 480x320 source of >= 8 s
    clip.sample_fps     # 2.0 for a 25 fps source of 8 s (16 / 200 * 25)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from rollplex.types import VisualInput

IMAGE_FACTOR = 28  # patch size 14 x spatial merge 2: resized sides are multiples of this
FRAME_FACTOR = 2  # temporal patch size: frame counts are multiples of this
MAX_RATIO = 200  # largest accepted aspect ratio


class MediaError(ValueError):
    """A media file cannot be decoded into frames; the message names the path and the reason."""


@dataclass(frozen=True)
class VideoSampling:
    """Frame-count and pixel-budget rules for videos (Video-R1 defaults; docs/video-r1-format.md,
    "Video sampling").

    Fields:
        fps: target sampling rate, frames per second of source time.
        min_frames, max_frames: bounds on the sampled frame count (``max_frames`` plays the role of
            qwen-vl-utils' ``FPS_MAX_FRAMES``; it is further capped by the source frame count).
        min_pixels: per-frame lower pixel bound (``VIDEO_MIN_PIXELS``).
        max_pixels: per-frame upper pixel bound before the total budget (``VIDEO_MAX_PIXELS``).
        total_pixels: pixel budget of the whole clip (``VIDEO_TOTAL_PIXELS``).

    Example:
        VideoSampling(fps=4.0, max_frames=64, min_pixels=200704, max_pixels=200704)
    """

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 16
    min_pixels: int = 100352
    max_pixels: int = 100352
    total_pixels: int = 90316800

    def __post_init__(self) -> None:
        if not self.fps > 0:
            raise ValueError(f"VideoSampling.fps must be > 0, got {self.fps}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(
                f"VideoSampling needs 1 <= min_frames <= max_frames, got {self.min_frames}, {self.max_frames}"
            )
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"VideoSampling needs 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}"
            )
        if self.total_pixels <= 0:
            raise ValueError(f"VideoSampling.total_pixels must be > 0, got {self.total_pixels}")


@dataclass(frozen=True)
class ImageSampling:
    """Pixel bounds for images: ``MIN_PIXELS`` 4·28², Video-R1 ``MAX_PIXELS`` 256·28²
    (docs/video-r1-format.md, "Video sampling").

    Example:
        ImageSampling(max_pixels=401408)
    """

    min_pixels: int = 3136
    max_pixels: int = 200704

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"ImageSampling needs 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}"
            )


def smart_resize(
    height: int,
    width: int,
    factor: int = IMAGE_FACTOR,
    min_pixels: float = 3136,
    max_pixels: float = 200704,
) -> tuple[int, int]:
    """Target (height, width) in pixels: multiples of ``factor`` near the source aspect ratio.

    qwen-vl-utils (docs/video-r1-format.md, "Video sampling"): round each side to the nearest multiple of
    ``factor`` (Python ``round``, so halves go to even; at least ``factor``); if the area exceeds
    ``max_pixels`` scale both sides by ``1/sqrt(h·w/max_pixels)`` and floor to the factor; if it is below
    ``min_pixels`` scale by ``sqrt(min_pixels/(h·w))`` and ceil. The bounds are not re-checked afterwards, so
    the result can land slightly outside them (e.g. 112x112 with min 100352 gives 336x336 = 112896 px).

    Raises:
        ValueError: a side is not positive, ``min_pixels > max_pixels``, or the aspect ratio exceeds 200.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"smart_resize needs positive sides, got height={height}, width={width}")
    if min_pixels > max_pixels:
        raise ValueError(f"smart_resize needs min_pixels <= max_pixels, got {min_pixels} > {max_pixels}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"aspect ratio of {width}x{height} exceeds {MAX_RATIO}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_nframes(total_frames: int, video_fps: float, sampling: VideoSampling) -> int:
    """Number of frames to sample from a video of ``total_frames`` frames at ``video_fps``
    (docs/video-r1-format.md, "Video sampling").

    n = total_frames / video_fps · sampling.fps, clamped to
    [ceil_even(min_frames), floor_even(min(max_frames, total_frames))] and to total_frames, then
    floored to a multiple of 2. Example: a 19 s, 30 fps source at fps 1 gives 19 -> 18 frames.

    Raises:
        ValueError: ``total_frames`` or ``video_fps`` is not positive, or the result is outside
            [2, total_frames] (a source of fewer than 2 frames).
    """
    if total_frames <= 0 or not video_fps > 0:
        raise ValueError(
            f"smart_nframes needs total_frames > 0 and video_fps > 0, got {total_frames}, {video_fps}"
        )
    min_frames = math.ceil(sampling.min_frames / FRAME_FACTOR) * FRAME_FACTOR
    max_frames = math.floor(min(sampling.max_frames, total_frames) / FRAME_FACTOR) * FRAME_FACTOR
    n = total_frames / video_fps * sampling.fps
    n = min(max(n, min_frames), max_frames, total_frames)
    n = math.floor(n / FRAME_FACTOR) * FRAME_FACTOR
    if not FRAME_FACTOR <= n <= total_frames:
        raise ValueError(
            f"sampled frame count {n} is outside [{FRAME_FACTOR}, {total_frames}] (total_frames)"
        )
    return n


def frame_indices(total_frames: int, n: int) -> list[int]:
    """Source frame indices to keep: ``round(linspace(0, total_frames - 1, n))`` (docs/video-r1-format.md,
    "Video sampling").

    Computed as qwen-vl-utils does, with a float32 ``torch.linspace`` and ``torch.round`` (halves to
    even). Example: ``frame_indices(10, 4) == [0, 3, 6, 9]``.

    Raises:
        ValueError: ``n`` is not in [1, total_frames].
    """
    if not 1 <= n <= total_frames:
        raise ValueError(f"frame count n={n} must be in [1, total_frames={total_frames}]")
    return torch.linspace(0, total_frames - 1, n).round().long().tolist()


def video_max_pixels(n_frames: int, sampling: VideoSampling) -> float:
    """Per-frame upper pixel bound for a clip of ``n_frames`` frames (docs/video-r1-format.md,
    "Video sampling").

    max(min(max_pixels, total_pixels / n_frames · 2), int(1.05 · min_pixels)); with Video-R1's
    defaults this is 105,369 for any n <= 1800 (docs/video-r1-format.md, "Video sampling").

    Raises:
        ValueError: ``n_frames`` is not positive.
    """
    if n_frames <= 0:
        raise ValueError(f"n_frames must be > 0, got {n_frames}")
    budget = min(sampling.max_pixels, sampling.total_pixels / n_frames * FRAME_FACTOR)
    return max(budget, int(sampling.min_pixels * 1.05))


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Resize uint8 [T, 3, H, W] frames to uint8 [T, 3, height, width] (docs/video-r1-format.md,
    "Video sampling").

    Bicubic with antialias on float32 values in 0-255, then rounded and clamped to uint8. Frames
    already at the target size are returned unchanged.
    """
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    resized = torch.nn.functional.interpolate(
        frames.float(), size=(height, width), mode="bicubic", antialias=True
    )
    return resized.round().clamp(0, 255).to(torch.uint8)


def read_video(path: Path | str, sampling: VideoSampling) -> VisualInput:
    """Decode a video file with PyAV into sampled, resized frames (qwen-vl-utils 0.0.10 ``fetch_video``).

    Steps: count the packets of the first video stream (total_frames) and read its average frame
    rate (video_fps); n = :func:`smart_nframes`; keep the frames at :func:`frame_indices`; resize to
    :func:`smart_resize` (factor 28, ``sampling.min_pixels``, :func:`video_max_pixels`) with
    :func:`resize_frames`.

    Returns:
        VisualInput(kind="video", frames=uint8 [n, 3, H, W] with n even and H, W multiples of 28,
        sample_fps=n / total_frames · video_fps in frames per second of source time).

    Raises:
        MediaError: the file is missing, not a video, has no video stream or frame rate, is too
            short to sample (fewer than 2 frames), or decodes to fewer frames than it declares.
    """
    path = Path(path)
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError(f"{path}: no video stream")
            stream = container.streams.video[0]
            if not stream.average_rate:
                raise MediaError(f"{path}: video stream has no average frame rate")
            video_fps = float(stream.average_rate)
            total_frames = sum(1 for packet in container.demux(stream) if packet.size > 0)
            n = smart_nframes(total_frames, video_fps, sampling)
            container.seek(0)
            frames = _decode_selected(container, stream, frame_indices(total_frames, n))
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError) as error:
        raise MediaError(f"{path}: cannot decode video ({error})") from error
    if len(frames) < n:
        raise MediaError(f"{path}: decoded {len(frames)} of {n} sampled frames ({total_frames} declared)")
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)
    height, width = smart_resize(
        video.shape[2], video.shape[3], IMAGE_FACTOR, sampling.min_pixels, video_max_pixels(n, sampling)
    )
    return VisualInput(
        kind="video", frames=resize_frames(video, height, width), sample_fps=n / total_frames * video_fps
    )


def read_image(path: Path | str, sampling: ImageSampling) -> VisualInput:
    """Decode an image file with Pillow (qwen-vl-utils 0.0.10 ``fetch_image``; docs/video-r1-format.md,
    "Video sampling").

    RGBA is composited on white using the alpha channel; other modes are converted to RGB. The image
    is resized with Pillow bicubic to :func:`smart_resize` (factor 28, ``sampling`` bounds).

    Returns:
        VisualInput(kind="image", frames=uint8 [1, 3, H, W] with H, W multiples of 28, sample_fps=None).

    Raises:
        MediaError: the file is missing or not a decodable image.
    """
    path = Path(path)
    try:
        with Image.open(path) as image:
            image.load()
            rgb = _to_rgb(image)
    except (OSError, UnidentifiedImageError, ValueError) as error:
        raise MediaError(f"{path}: cannot decode image ({error})") from error
    height, width = smart_resize(
        rgb.height, rgb.width, IMAGE_FACTOR, sampling.min_pixels, sampling.max_pixels
    )
    resized = rgb.resize((width, height), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy())
    return VisualInput(kind="image", frames=pixels.permute(2, 0, 1)[None].contiguous(), sample_fps=None)


def _decode_selected(container: av.container.InputContainer, stream: av.VideoStream, keep: list[int]) -> list:
    """RGB24 arrays uint8 [H, W, 3] of the decoded frames at the sorted indices ``keep`` (repeats allowed)."""
    wanted: dict[int, int] = {}
    for index in keep:
        wanted[index] = wanted.get(index, 0) + 1
    frames = []
    for position, frame in enumerate(container.decode(stream)):
        if position in wanted:
            frames.extend([frame.to_ndarray(format="rgb24")] * wanted[position])
        if position >= keep[-1]:
            break
    return frames


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.getchannel("A"))
        return background
    return image.convert("RGB")
