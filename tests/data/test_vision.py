"""Frame sampling, resizing and decoding against qwen-vl-utils (docs/video-r1-format.md, "Video sampling") and
field case B04."""

import re
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.functional import resize as tv_resize

from rollplex.data.vision import (
    ImageSampling,
    MediaError,
    VideoSampling,
    frame_indices,
    read_image,
    read_video,
    resize_frames,
    smart_nframes,
    smart_resize,
    video_max_pixels,
)

VIDEO_R1 = VideoSampling()
# qwen-vl-utils 0.0.10 module defaults without Video-R1's edits (docs/video-r1-format.md, "Video sampling",
# upstream values).
UPSTREAM = VideoSampling(max_frames=768, max_pixels=602112)


@pytest.mark.parametrize(
    ("source_wh", "resized_wh"),
    [
        ((640, 360), (420, 224)),
        ((1280, 720), (420, 224)),
        ((1920, 1080), (420, 224)),
        ((854, 480), (420, 224)),
        ((480, 320), (392, 252)),
        ((640, 480), (364, 280)),
        ((320, 240), (392, 280)),
    ],
)
def test_video_r1_worked_resize_table(source_wh, resized_wh):
    max_pixels = video_max_pixels(16, VIDEO_R1)
    height, width = smart_resize(source_wh[1], source_wh[0], 28, VIDEO_R1.min_pixels, max_pixels)
    assert (width, height) == resized_wh


def test_video_r1_per_frame_budget_is_105369():
    # max(min(100352, 90316800 / n * 2), int(1.05 * 100352)) for every n in 4..16.
    assert {video_max_pixels(n, VIDEO_R1) for n in range(4, 17, 2)} == {105369}


def test_upstream_budget_shrinks_with_frame_count():
    assert video_max_pixels(200, UPSTREAM) == 602112  # 90316800 / 200 * 2 = 903168 > VIDEO_MAX
    assert video_max_pixels(768, UPSTREAM) == 235200  # 90316800 / 768 * 2
    assert video_max_pixels(3600, UPSTREAM) == 105369  # 50176 < int(1.05 * min)


@pytest.mark.parametrize(
    ("hw", "bounds", "expected"),
    [
        ((100, 200), (3136, 200704), (112, 196)),  # round(100/28)=4, round(200/28)=7, inside bounds
        ((70, 70), (3136, 200704), (56, 56)),  # 70/28 = 2.5 rounds half to even -> 2
        ((98, 98), (3136, 200704), (112, 112)),  # 3.5 -> 4
        ((10, 10), (3136, 200704), (56, 56)),  # 28x28 < min: scale sqrt(31.36)=5.6, ceil(56/28)
        ((1000, 2000), (3136, 200704), (308, 616)),  # beta=sqrt(2e6/200704), floor(316.8/28), floor(633.6/28)
        ((112, 112), (100352, 105369), (336, 336)),  # ceil(112*sqrt(8)/28)=12: lands above max
    ],
)
def test_smart_resize_hand_computed(hw, bounds, expected):
    assert smart_resize(*hw, 28, *bounds) == expected


@pytest.mark.parametrize("hw", [(1, 201), (0, 10), (10, -1)])
def test_smart_resize_rejects_bad_sides(hw):
    with pytest.raises(ValueError):
        smart_resize(*hw)


@pytest.mark.parametrize(
    ("total_frames", "video_fps", "expected"),
    [
        (60, 30.0, 4),  # 2 s -> 4 frames
        (150, 30.0, 10),  # 5 s -> 10
        (135, 30.0, 8),  # 4.5 s -> 9, floored to even
        (200, 25.0, 16),  # 8 s -> 16
        (3000, 30.0, 16),  # 100 s -> capped at 16
        (30, 30.0, 4),  # 1 s -> 2, raised to min_frames 4
        (3, 30.0, 2),  # max_frames = floor_even(min(16, 3)) = 2
    ],
)
def test_smart_nframes_video_r1(total_frames, video_fps, expected):
    assert smart_nframes(total_frames, video_fps, VIDEO_R1) == expected


@pytest.mark.parametrize(("total_frames", "video_fps"), [(1, 30.0), (0, 30.0), (10, 0.0)])
def test_smart_nframes_rejects_unsampleable_sources(total_frames, video_fps):
    with pytest.raises(ValueError):
        smart_nframes(total_frames, video_fps, VIDEO_R1)


@pytest.mark.parametrize(
    ("target_fps", "frames", "seconds_per_grid"),
    [
        (1.0, 18, 19 / 9),  # 19 frames floored to 18: sample fps 18/19, so 2/(18/19), not exactly 2.0
        (2.0, 38, 1.0),
        (4.0, 76, 0.5),
    ],
)
def test_b04_second_per_grid_follows_the_sampled_fps(target_fps, frames, seconds_per_grid):
    total_frames, video_fps = 19 * 30, 30.0  # a 19 s source
    sampling = VideoSampling(fps=target_fps, max_frames=768)
    n = smart_nframes(total_frames, video_fps, sampling)
    sample_fps = n / total_frames * video_fps
    assert n == frames and n // 2 == {1.0: 9, 2.0: 19, 4.0: 38}[target_fps]
    assert 2 / sample_fps == pytest.approx(seconds_per_grid, rel=1e-12)


def test_b04_frame_cap_lowers_the_effective_fps():
    total_frames, video_fps = 600 * 30, 30.0  # 600 s at target fps 2 with a 768-frame cap
    n = smart_nframes(total_frames, video_fps, UPSTREAM)
    sample_fps = n / total_frames * video_fps
    assert n == 768
    assert sample_fps == pytest.approx(1.28, rel=1e-12)
    assert 2 / sample_fps == pytest.approx(1.5625, rel=1e-12)


def test_frame_indices_round_linspace():
    assert frame_indices(10, 4) == [0, 3, 6, 9]
    assert frame_indices(570, 4) == [0, 190, 379, 569]  # 0, 189.67, 379.33, 569
    assert frame_indices(7, 7) == list(range(7))
    with pytest.raises(ValueError):
        frame_indices(4, 6)


def test_resize_frames_matches_torchvision_uint8_path():
    generator = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (2, 3, 40, 60), dtype=torch.uint8, generator=generator)
    ours = resize_frames(frames, 28, 56)
    reference = tv_resize(frames, [28, 56], interpolation=InterpolationMode.BICUBIC, antialias=True)
    assert ours.dtype == torch.uint8 and ours.shape == (2, 3, 28, 56)
    assert (ours.int() - reference.int()).abs().max() <= 1


def test_resize_frames_keeps_constants_and_same_size():
    flat = torch.full((1, 3, 30, 50), 77, dtype=torch.uint8)
    assert torch.equal(resize_frames(flat, 56, 84), torch.full((1, 3, 56, 84), 77, dtype=torch.uint8))
    assert resize_frames(flat, 30, 50) is flat


def write_grey_ramp_video(path, num_frames=12, fps=6, width=84, height=56):
    """MP4 whose frame k is a flat grey of value 20*k, so a decoded frame reveals its source index."""
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps), options={"qp": "0"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for k in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 20 * k, np.uint8), format="rgb24")
            frame.pts = k
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


@pytest.mark.parametrize(
    ("target_fps", "max_frames", "indices", "sample_fps"),
    [
        (3.0, 16, [0, 2, 4, 7, 9, 11], 3.0),  # 12 frames at 6 fps -> 6 frames, round(linspace(0, 11, 6))
        (2.5, 16, [0, 4, 7, 11], 2.0),  # 5 frames floored to 4: the sampled rate is 4 / 12 * 6 = 2.0
        (6.0, 8, [0, 2, 3, 5, 6, 8, 9, 11], 4.0),  # capped at 8 frames: 8 / 12 * 6 = 4.0
    ],
)
def test_read_video_samples_the_right_frames_and_fps(tmp_path, target_fps, max_frames, indices, sample_fps):
    path = write_grey_ramp_video(tmp_path / "ramp.mp4")
    sampling = VideoSampling(fps=target_fps, max_frames=max_frames, min_pixels=3136, max_pixels=56 * 84)
    clip = read_video(path, sampling)
    assert clip.kind == "video" and clip.frames.dtype == torch.uint8
    assert clip.frames.shape == (len(indices), 3, 56, 84)
    assert clip.sample_fps == pytest.approx(sample_fps, rel=1e-12)
    means = clip.frames.float().mean(dim=(1, 2, 3))
    assert torch.allclose(means, 20.0 * torch.tensor(indices).float(), atol=1.0)


def test_read_video_resizes_with_video_r1_defaults(tmp_path):
    clip = read_video(write_grey_ramp_video(tmp_path / "ramp.mp4"), VIDEO_R1)
    # 2 s at 6 fps -> 4 frames at indices 0, 4, 7, 11; 56x84 = 4704 px < 100352: scale by
    # sqrt(100352/4704) = 4.619 and ceil to 28 -> 280 x 392.
    assert clip.frames.shape == (4, 3, 280, 392)
    assert clip.sample_fps == 2.0
    means = clip.frames.float().mean(dim=(1, 2, 3))
    assert torch.allclose(means, 20.0 * torch.tensor([0, 4, 7, 11]).float(), atol=1.0)


def test_corrupt_or_missing_video_raises_media_error(tmp_path):
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    for path in (garbage, tmp_path / "absent.mp4"):
        with pytest.raises(MediaError, match=re.escape(path.name)):
            read_video(path, VIDEO_R1)


def test_single_frame_source_is_too_short(tmp_path):
    path = tmp_path / "still.png"
    Image.new("RGB", (56, 56), (10, 20, 30)).save(path)
    with pytest.raises(MediaError, match=r"still\.png"):
        read_video(path, VIDEO_R1)


def test_read_image_composites_rgba_on_white(tmp_path):
    pixels = np.zeros((56, 84, 4), np.uint8)
    pixels[:, :42] = (255, 0, 0, 255)  # opaque red
    pixels[:, 42:] = (0, 0, 255, 0)  # fully transparent
    pixels[0, 0] = (255, 0, 0, 128)  # half transparent red: 255*128/255 + 255*127/255 = 255, 0 + 127
    path = tmp_path / "rgba.png"
    Image.fromarray(pixels, "RGBA").save(path)
    image = read_image(path, ImageSampling())
    assert image.kind == "image" and image.sample_fps is None
    assert image.frames.shape == (1, 3, 56, 84) and image.frames.dtype == torch.uint8
    assert image.frames[0, :, 10, 10].tolist() == [255, 0, 0]
    assert image.frames[0, :, 10, 60].tolist() == [255, 255, 255]
    assert image.frames[0, :, 0, 0].tolist() == [255, 127, 127]


def test_read_image_resizes_to_smart_resize(tmp_path):
    path = tmp_path / "grey.jpg"
    Image.new("L", (200, 100), 90).save(path)
    image = read_image(path, ImageSampling())
    assert image.frames.shape == (1, 3, 112, 196)
    assert (image.frames.int() - 90).abs().max() <= 1


def test_corrupt_image_raises_media_error(tmp_path):
    path = tmp_path / "broken.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    with pytest.raises(MediaError, match=r"broken\.png"):
        read_image(path, ImageSampling())
