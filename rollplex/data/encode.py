"""Record → Prompt: decode media, render the chat, run the checkpoint's processor, compute positions.

The processor from the checkpoint builds the tensors (placeholder expansion, patch rows). rollplex
samples and resizes frames itself (data.vision, qwen-vl-utils rules) and tells the processor not to
resample or resize, so the frames it encodes are exactly the frames sampled (field case B04);
``second_per_grid_ts`` is set from the fps of those frames, never from a library fallback, and the 3D
positions are computed by models.positions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from PIL import Image

from rollplex.data.prompts import chat_messages
from rollplex.data.records import media_path
from rollplex.data.vision import ImageSampling, VideoSampling, read_image, read_video
from rollplex.models.positions import VisionTokens, rope_positions
from rollplex.types import Prompt, Record, VisualInput


class SkipSample(ValueError):
    """A record that cannot become a prompt (unreadable media, over-long prompt); the run goes on."""


@dataclass(frozen=True)
class PromptBuilder:
    """Builds prompts of one dataset.

    Fields: processor (the checkpoint's ``Qwen2_5_VLProcessor``), template (data.prompts), data_root
    (media root), max_prompt_tokens (prompt budget; longer prompts are skipped whole, never cut through a
    vision span — B06), video/image sampling rules, tokens (placeholder ids and geometry),
    shuffled_twins (also build each video prompt's shuffled-frame twin, ``Prompt.shuffled``, for T-GRPO)
    and seed (the run seed, which with the prompt's content fixes the twin's frame order).
    """

    processor: object
    template: str
    data_root: Path
    max_prompt_tokens: int
    video: VideoSampling
    image: ImageSampling
    tokens: VisionTokens
    temporal_patch_size: int = 2
    shuffled_twins: bool = False
    seed: int = 0

    def read_media(self, record: Record) -> VisualInput:
        """Decoded frames of the record's media. Raises SkipSample on unreadable media."""
        path = media_path(record, self.data_root)
        try:
            if record.data_type == "video":
                return read_video(path, self.video)
            return read_image(path, self.image)
        except (OSError, ValueError, Image.DecompressionBombError) as err:  # MediaError is a ValueError
            raise SkipSample(f"unreadable {record.data_type} {record.path}: {err}") from err

    def build(self, record: Record) -> Prompt:
        """The prompt of ``record``.

        Raises:
            SkipSample: unreadable media, or a prompt longer than ``max_prompt_tokens`` (the message names
                the needed length and the budget).
        """
        visual = self.read_media(record)
        try:
            prompt = self.encode(record, visual)
            if self.shuffled_twins and visual.kind == "video":
                prompt.shuffled = shuffled_twin(self, record, visual, prompt.content_key)
            return prompt
        except SkipSample:
            raise
        except ValueError as err:  # processor or placeholder/grid mismatch (B06): skip, never crash
            raise SkipSample(f"cannot encode {record.path}: {err}") from err

    def encode(self, record: Record, visual: VisualInput) -> Prompt:
        """Tokenise ``record`` with already decoded media (see build)."""
        text = self.processor.apply_chat_template(
            chat_messages(record, self.template), tokenize=False, add_generation_prompt=True
        )
        kwargs = {"text": [text], "return_tensors": "pt"}
        if visual.kind == "video":
            kwargs.update(videos=[visual.frames], do_resize=False, do_sample_frames=False)
        elif visual.kind == "image":
            kwargs.update(images=[visual.frames[0]], do_resize=False)
        batch = self.processor(**kwargs)
        input_ids = batch["input_ids"][0]
        if input_ids.shape[0] > self.max_prompt_tokens:
            raise SkipSample(
                f"prompt needs {input_ids.shape[0]} tokens, over the prompt budget "
                f"data.max_prompt_tokens={self.max_prompt_tokens}"
            )
        return self._prompt(record, visual, batch, input_ids)

    def _prompt(self, record: Record, visual: VisualInput, batch, input_ids: torch.Tensor) -> Prompt:
        spg = None
        if visual.kind == "video":
            spg = torch.tensor([self.temporal_patch_size / visual.sample_fps], dtype=torch.float64)
        image_grid = batch.get("image_grid_thw")
        video_grid = batch.get("video_grid_thw")
        positions, next_position = rope_positions(input_ids, self.tokens, image_grid, video_grid, spg)
        pixels = batch.get("pixel_values")
        pixels_videos = batch.get("pixel_values_videos")
        return Prompt(
            record=record,
            input_ids=input_ids,
            position_ids=positions,
            next_position=next_position,
            content_key=content_key(input_ids, pixels, pixels_videos, image_grid, video_grid, spg),
            pixel_values=pixels,
            image_grid_thw=image_grid,
            pixel_values_videos=pixels_videos,
            video_grid_thw=video_grid,
            second_per_grid_ts=spg,
        )


def frame_permutation(num_frames: int, key: str, seed: int) -> torch.Tensor:
    """A random order of ``num_frames`` frames, fixed by the prompt's ``key`` (hex content key) and the run
    ``seed``, and never the identity when there are 2 frames or more.

    Video-R1's T-GRPO draws ``torch.randperm(T)`` afresh each step and may draw the identity; here the
    order is a pure function of the inputs, so a prompt's twin can be cached and a resumed run sees the
    same twins.

    Returns:
        int64 [num_frames].
    """
    generator = torch.Generator().manual_seed((int(key[:15], 16) + seed * 1_000_003) % 2**63)
    identity = torch.arange(num_frames)
    while True:
        order = torch.randperm(num_frames, generator=generator)
        if num_frames < 2 or not torch.equal(order, identity):
            return order


def shuffled_twin(builder: PromptBuilder, record: Record, visual: VisualInput, key: str) -> Prompt:
    """``record``'s prompt with its sampled video frames reordered by ``frame_permutation`` (T-GRPO,
    Video-R1 §3.2: the frames are shuffled before the processor, so temporal patches mix frames). Same
    tokens, grid and positions as the ordered prompt; other pixels and content key."""
    order = frame_permutation(int(visual.frames.shape[0]), key, builder.seed)
    return builder.encode(record, replace(visual, frames=visual.frames[order]))


def content_key(*tensors: torch.Tensor | None) -> str:
    """SHA-256 hex digest over the bytes of the given tensors (None entries mark an absent tensor).

    Two prompts with identical text but different pixels get different keys, so prefix state is shared
    only between identical inputs.
    """
    digest = hashlib.sha256()
    for tensor in tensors:
        if tensor is None:
            digest.update(b"\x00none")
            continue
        data = tensor.detach().cpu().contiguous()
        digest.update(str((tuple(data.shape), data.dtype)).encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()
