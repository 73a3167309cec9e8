"""Record → Prompt through the checkpoint's processor: no resampling (B04), exact placeholder counts,
over-long prompts rejected whole (B06), content keys that tell different pixels apart."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rollplex.data.encode import PromptBuilder, SkipSample, frame_permutation
from rollplex.data.prompts import chat_messages
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
    visual = VisualInput("video", _frames(8, 5), 2.0)
    length = builder.encode(_record(), visual).length  # the same prompt under the fixture's budget
    assert length > 20
    with pytest.raises(SkipSample, match=rf"needs {length} tokens.*max_prompt_tokens=20"):
        short.encode(_record(), visual)


# ---------------------------------------------------------------- T-GRPO shuffled-frame twins


@pytest.mark.parametrize("frames", [2, 3, 8, 16])
def test_frame_permutation_is_a_fixed_non_identity_order(frames):
    key = "9f" * 32
    order = frame_permutation(frames, key, seed=0)
    assert sorted(order.tolist()) == list(range(frames)) and order.tolist() != list(range(frames))
    assert torch.equal(order, frame_permutation(frames, key, seed=0))
    others = {tuple(frame_permutation(frames, key, seed=s).tolist()) for s in range(1, 8)}
    assert frames == 2 or len(others) > 1  # the seed moves the order (2 frames have one non-identity order)


def _slot_values(prompt, grid_hw: int) -> list[int]:
    """Channel 0's value of each temporal slot (frame position) in the first pixel row of every temporal
    grid: a row is [channel, temporal slot, 14, 14] (Qwen2-VL patch layout)."""
    rows = prompt.pixel_values_videos[::grid_hw]
    return [round(float(v) * 1000) for row in rows for v in (row[0], row[196])]


def test_shuffled_twin_holds_the_frames_in_the_permuted_order(builder, monkeypatch):
    """Frames of one flat value each: the twin's temporal slot k holds ordered frame order[k] (read off
    the patch rows); tokens and positions are the ordered prompt's; the twin equals the processor's own
    output on the permuted frames."""
    frames = torch.stack([torch.full((3, 56, 56), 20 + 30 * i, dtype=torch.uint8) for i in range(6)])
    visual = VisualInput("video", frames, 2.0)
    monkeypatch.setattr(PromptBuilder, "read_media", lambda self, record: visual)
    twins = dataclasses.replace(builder, shuffled_twins=True, seed=3)
    prompt = twins.build(_record())
    twin = prompt.shuffled
    order = frame_permutation(6, prompt.content_key, seed=3)
    hw = int(prompt.video_grid_thw[0, 1] * prompt.video_grid_thw[0, 2])
    ordered_slots, twin_slots = _slot_values(prompt, hw), _slot_values(twin, hw)
    assert len(set(ordered_slots)) == 6
    assert twin_slots == [ordered_slots[i] for i in order.tolist()]
    assert torch.equal(twin.input_ids, prompt.input_ids) and torch.equal(
        twin.position_ids, prompt.position_ids
    )
    assert twin.content_key != prompt.content_key and twin.shuffled is None
    text = builder.processor.apply_chat_template(
        chat_messages(_record(), "video_r1"), tokenize=False, add_generation_prompt=True
    )
    direct = builder.processor(
        text=[text], videos=[frames[order]], do_resize=False, do_sample_frames=False, return_tensors="pt"
    )
    assert torch.equal(twin.pixel_values_videos, direct["pixel_values_videos"])


def test_no_twin_for_images_or_when_off(builder, monkeypatch):
    image = VisualInput("image", _frames(1, 2, size=112), None)
    monkeypatch.setattr(PromptBuilder, "read_media", lambda self, record: image)
    assert dataclasses.replace(builder, shuffled_twins=True).build(_record("image")).shuffled is None
    video = VisualInput("video", _frames(4, 3), 2.0)
    monkeypatch.setattr(PromptBuilder, "read_media", lambda self, record: video)
    assert builder.build(_record()).shuffled is None
