"""Record → Prompt through the checkpoint's processor: no resampling (B04), exact placeholder counts,
over-long prompts rejected whole (B06), content keys that tell different pixels apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollplex.data.encode import PromptBuilder, SkipSample
from rollplex.data.vision import ImageSampling, VideoSampling
from rollplex.models.positions import VisionTokens
from rollplex.models.presets import preset_config
from rollplex.models.tokenizer import build_processor
from rollplex.types import Record, VisualInput


@pytest.fixture(scope="module")
def builder():
    processor = build_processor("tiny")
    tokens = VisionTokens.from_config(preset_config("tiny"))
    return PromptBuilder(processor, "video_r1", Path("."), 4096, VideoSampling(), ImageSampling(), tokens)


def _record(data_type="video"):
    return Record(
        1,
        "What colour is it?",
        data_type,
        "multiple choice",
        ("A. red", "B. blue"),
        "<answer>A</answer>",
        "./CLEVRER/x.mp4",
        "",
    )


def _frames(n, seed, size=56):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)


def test_presampled_frames_are_not_resampled(builder):
    """B04 (1): 8 frames of 56×56 sampled at 2 fps → grid (4, 4, 4), 16 placeholders, 1.0 s per grid,
    64 pixel rows."""
    prompt = builder.encode(_record(), VisualInput("video", _frames(8, 0), 2.0))
    assert prompt.video_grid_thw.tolist() == [[4, 4, 4]]
    assert int((prompt.input_ids == builder.tokens.video_token_id).sum()) == 16
    assert prompt.pixel_values_videos.shape == (64, 1176)
    assert prompt.second_per_grid_ts.tolist() == [1.0]
    assert prompt.position_ids.shape == (3, prompt.length)


@pytest.mark.parametrize(("fps", "spg"), [(1.0, 2.0), (2.0, 1.0), (4.0, 0.5), (1.28, 1.5625)])
def test_second_per_grid_from_sampled_fps(builder, fps, spg):
    prompt = builder.encode(_record(), VisualInput("video", _frames(4, 1), fps))
    assert prompt.second_per_grid_ts.tolist() == [pytest.approx(spg)]


def test_image_prompt(builder):
    prompt = builder.encode(_record("image"), VisualInput("image", _frames(1, 2, size=112), None))
    assert prompt.image_grid_thw.tolist() == [[1, 8, 8]]
    assert int((prompt.input_ids == builder.tokens.image_token_id).sum()) == 16
    assert prompt.pixel_values.shape == (64, 1176) and prompt.second_per_grid_ts is None


def test_content_key_tells_pixels_apart(builder):
    a = builder.encode(_record(), VisualInput("video", _frames(4, 3), 2.0))
    b = builder.encode(_record(), VisualInput("video", _frames(4, 4), 2.0))
    again = builder.encode(_record(), VisualInput("video", _frames(4, 3), 2.0))
    assert torch.equal(a.input_ids, b.input_ids)
    assert a.content_key != b.content_key and a.content_key == again.content_key


def test_over_long_prompt_is_rejected_whole(builder):
    """B06: the budget is checked on the expanded prompt; the message names both lengths."""
    short = PromptBuilder(
        builder.processor, "video_r1", Path("."), 20, builder.video, builder.image, builder.tokens
    )
    with pytest.raises(SkipSample, match=r"needs \d+ tokens.*max_prompt_tokens=20"):
        short.encode(_record(), VisualInput("video", _frames(8, 5), 2.0))
