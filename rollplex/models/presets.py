"""Model presets: published Qwen2.5-VL sizes plus a tiny one, and random-initialised checkpoints.

``preset_config`` writes every field a runtime depends on explicitly, because several class defaults
of ``Qwen2_5_VLVisionConfig`` are not the published values (hidden 3584 instead of 1280,
tokens_per_second 4 instead of 2; docs/qwen2.5-vl.md, "Config fields"). The real sizes' values are in
docs/qwen2.5-vl.md, "Published sizes", and their parameter counts (checked by the tests on the meta
device) in its "Parameter counts".

The construction uses only fields and APIs present in transformers 5.17 and 5.24: nested
``text_config`` / ``vision_config`` dicts, ``rope_parameters`` (5.x name; 4.x used ``rope_scaling``),
``tie_word_embeddings`` at the root (where 5.x ties) and mirrored into ``text_config`` for readers that
look there. A checkpoint written by either version loads in the other, and both write the on-disk names
of real checkpoints (``model.layers.*``, ``visual.*``, ``lm_head.weight``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from rollplex.files import make_readable
from rollplex.models.tokenizer import EOS_TOKEN, added_token_ids, build_processor, vocab_size

PRESETS = ("tiny", "qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen2.5-vl-32b", "tiny-tp")
# Presets that reuse another preset's tokenizer (same vocabulary and special ids).
TOKENIZER_OF = {"tiny-tp": "tiny"}
ROPE_THETA = 1_000_000.0
MAX_POSITION_EMBEDDINGS = 128000
RMS_NORM_EPS = 1e-6
HIDDEN_ACT = "silu"
PATCH_SIZE, SPATIAL_MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
TOKENS_PER_SECOND = 2
WINDOW_SIZE = 112
IN_CHANNELS = 3
INIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PresetShape:
    """The sizes that differ between presets.

    LM: ``hidden_size`` H, ``num_hidden_layers``, ``num_attention_heads`` (head_dim = H / heads),
    ``num_key_value_heads``, MLP ``intermediate_size``, ``tie_word_embeddings``, ``mrope_section`` (rotary
    frequency slots of the temporal / height / width rows; sums to head_dim / 2). Vision tower: ``depth``,
    ``hidden_size``, ``num_heads``, ``intermediate_size``, ``fullatt_block_indexes`` (blocks with full
    attention; the others use windows). The merger projects to the LM hidden size.

    Example:
        PresetShape(2048, 36, 16, 2, 11008, True, (16, 24, 24), 32, 1280, 16, 3420, (7, 15, 23, 31))  # 3B
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden_size: int
    vision_num_heads: int
    vision_intermediate_size: int
    fullatt_block_indexes: tuple[int, ...]
    initializer_range: float = 0.02


_FULLATT = (7, 15, 23, 31)
SHAPES = {
    # tiny: weights drawn with std 0.1 (not 0.02) so a model trained from scratch by RL picks up the
    # vision tokens within a few minutes on a CPU; real presets use the published 0.02.
    "tiny": PresetShape(64, 2, 4, 2, 128, False, (2, 3, 3), 2, 32, 2, 64, (1,), initializer_range=0.1),
    "qwen2.5-vl-3b": PresetShape(2048, 36, 16, 2, 11008, True, (16, 24, 24), 32, 1280, 16, 3420, _FULLATT),
    "qwen2.5-vl-7b": PresetShape(3584, 28, 28, 4, 18944, False, (16, 24, 24), 32, 1280, 16, 3420, _FULLATT),
    "qwen2.5-vl-32b": PresetShape(5120, 64, 40, 8, 27648, False, (16, 24, 24), 32, 1280, 16, 3456, _FULLATT),
    # tiny-tp: tiny with enough heads for tensor parallelism up to 4 (8 query / 4 key-value heads of dim
    # 16; MLP width 256 and the tiny vocabulary, 448, divisible by 4 and 8); the tiny tokenizer.
    "tiny-tp": PresetShape(128, 2, 8, 4, 256, False, (2, 3, 3), 2, 32, 2, 64, (1,), initializer_range=0.1),
}


def preset_shape(name: str) -> PresetShape:
    """The ``PresetShape`` of preset ``name``.

    Raises:
        ValueError: ``name`` is not one of ``PRESETS``.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}")
    return SHAPES[name]


def tokenizer_preset(name: str) -> str:
    """The tokenizer preset of model preset ``name`` (``TOKENIZER_OF``; itself for the others)."""
    return TOKENIZER_OF.get(name, name)


def _text_config(name: str, shape: PresetShape) -> dict:
    """LM fields of ``name`` (docs/qwen2.5-vl.md, "Config fields" and "Published sizes"); vocabulary and
    bos/eos from the preset's tokenizer."""
    ids = added_token_ids(tokenizer_preset(name))
    return dict(
        vocab_size=vocab_size(tokenizer_preset(name)),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        hidden_act=HIDDEN_ACT,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=RMS_NORM_EPS,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": ROPE_THETA,
            "mrope_section": list(shape.mrope_section),
        },
        use_sliding_window=False,
        attention_dropout=0.0,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids[EOS_TOKEN],
        tie_word_embeddings=shape.tie_word_embeddings,
        initializer_range=shape.initializer_range,
    )


def _vision_config(shape: PresetShape) -> dict:
    """Every vision field written explicitly (class defaults differ from the published values)."""
    return dict(
        depth=shape.vision_depth,
        hidden_size=shape.vision_hidden_size,
        num_heads=shape.vision_num_heads,
        intermediate_size=shape.vision_intermediate_size,
        out_hidden_size=shape.hidden_size,
        hidden_act=HIDDEN_ACT,
        in_channels=IN_CHANNELS,
        patch_size=PATCH_SIZE,
        spatial_merge_size=SPATIAL_MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        tokens_per_second=TOKENS_PER_SECOND,
        window_size=WINDOW_SIZE,
        fullatt_block_indexes=list(shape.fullatt_block_indexes),
        initializer_range=shape.initializer_range,
    )


def preset_config(name: str) -> Qwen2_5_VLConfig:
    """``Qwen2_5_VLConfig`` of preset ``name`` with every LM and vision field set explicitly.

    Real presets carry the published values (docs/qwen2.5-vl.md, "Published sizes") and token ids bos 151643,
    eos 151645, vision_start 151652, vision_end 151653, vision_token (``<|vision_pad|>``) 151654, image
    151655, video 151656; ``tiny`` takes its vocabulary size (448) and ids from the tiny tokenizer
    (``tokenizer.added_token_ids``). The model pad id is left unset, as in the published configs, so the
    ``<|endoftext|>`` embedding row is initialised and trained like any other.

    Raises:
        ValueError: ``name`` is not one of ``PRESETS``.
    """
    shape = preset_shape(name)
    ids = added_token_ids(tokenizer_preset(name))
    return Qwen2_5_VLConfig(
        text_config=_text_config(name, shape),
        vision_config=_vision_config(shape),
        tie_word_embeddings=shape.tie_word_embeddings,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        vision_token_id=ids["<|vision_pad|>"],
        initializer_range=shape.initializer_range,
    )


def vision_special_ids(config: Qwen2_5_VLConfig) -> list[int]:
    """Ids the policy must never sample (field case B05): vision_start, vision_end, vision_pad (when the
    config has ``vision_token_id``), image, video — in that order. Real presets: 151652 … 151656."""
    ids = [config.vision_start_token_id, config.vision_end_token_id]
    pad = getattr(config, "vision_token_id", None)
    if pad is not None:
        ids.append(pad)
    return [int(i) for i in (*ids, config.image_token_id, config.video_token_id)]


def generation_config(name: str) -> GenerationConfig:
    """Generation defaults saved with a checkpoint: eos [``<|im_end|>``, ``<|endoftext|>``] ids (the
    published Qwen2.5-VL list, [151645, 151643] for real presets), pad and bos ``<|endoftext|>``; no
    sampling settings (those belong to the run config)."""
    ids = added_token_ids(tokenizer_preset(name))
    end_of_text = ids["<|endoftext|>"]
    return GenerationConfig(
        bos_token_id=end_of_text, eos_token_id=[ids[EOS_TOKEN], end_of_text], pad_token_id=end_of_text
    )


def meta_model(name: str) -> torch.nn.Module:
    """``Qwen2_5_VLForConditionalGeneration`` of preset ``name`` on the meta device: shapes and parameter
    counts without allocating any weight memory (the 32B model builds in well under a second).

    Raises:
        ValueError: ``name`` is not one of ``PRESETS``.
    """
    config = preset_config(name)
    with torch.device("meta"):
        return Qwen2_5_VLForConditionalGeneration(config)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make ``dtype`` torch's default floating dtype, so modules allocate in it directly."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def init_model(
    name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Qwen2_5_VLForConditionalGeneration:
    """Random-initialised ``Qwen2_5_VLForConditionalGeneration`` of preset ``name`` on ``device`` (CPU by
    default; benchmarks build large presets directly on the GPU).

    Weights come from transformers' own initialisation under ``torch.manual_seed(seed)`` inside a forked
    CPU RNG (the caller's RNG state is untouched), so the same (name, seed, dtype) gives bitwise equal
    weights (also across transformers 5.17 and 5.24). Parameters are allocated directly in ``dtype`` (no
    float32 copy): 2 bytes per parameter in bfloat16, 4 in float32; use ``meta_model`` to inspect a size
    without allocating.

    Raises:
        ValueError: unknown preset name, or ``dtype`` not one of float32 / bfloat16 / float16.
    """
    if dtype not in INIT_DTYPES:
        raise ValueError(f"dtype={dtype} is not supported; expected one of {INIT_DTYPES}")
    config = preset_config(name)
    with torch.random.fork_rng(devices=[]), _default_dtype(dtype), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = generation_config(name)
    return model


def _check_target(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"checkpoint target {str(out)!r} already exists and is not an empty folder")


def init_checkpoint(preset: str, out: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Write a random-initialised checkpoint of ``preset`` to the folder ``out``; returns ``out``.

    Contents: ``config.json`` (all vision fields explicit), ``model.safetensors`` (``init_model`` weights
    in ``dtype``), ``generation_config.json`` (``generation_config``), and the processor written by
    ``Qwen2_5_VLProcessor.save_pretrained``: ``processor_config.json`` (image and video processors),
    ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``. The folder loads offline with
    ``AutoProcessor.from_pretrained(out)`` and ``Qwen2_5_VLForConditionalGeneration.from_pretrained(out)``.
    Everything is written into a hidden sibling folder first and renamed onto ``out`` at the end, so
    ``out`` is either absent or complete.

    Raises:
        ValueError: unknown preset, unsupported ``dtype``, or ``out`` exists and is not an empty folder.
    """
    out = Path(out)
    _check_target(out)
    processor = build_processor(tokenizer_preset(preset))
    # Large presets initialise on the GPU when there is one (seconds instead of minutes on the CPU).
    device = "cuda" if torch.cuda.is_available() and preset != "tiny" else "cpu"
    model = init_model(preset, seed=seed, dtype=dtype, device=device)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        make_readable(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
