"""A tiny float64 Qwen2.5-VL and hand-built prompts for the oracle tests.

The oracle for every numeric path is a plain full-sequence forward of the same HF model (eager
attention, its own causal mask) in float64, see ``full_logprobs``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rollplex.models.forward import prepare_model
from rollplex.models.positions import VisionTokens, rope_positions
from rollplex.types import Prompt, Record

VOCAB = 200
IMAGE, VIDEO, V_START, V_END = 190, 191, 192, 193
BANNED = torch.tensor([IMAGE, VIDEO, V_START, V_END])


def tiny_config(attn: str = "sdpa"):
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            num_heads=2,
            intermediate_size=48,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
            window_size=112,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=V_START,
        vision_end_token_id=V_END,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    config._attn_implementation = attn
    config.text_config._attn_implementation = attn
    config.vision_config._attn_implementation = attn
    return config


def _exact_rms_norm(module, hidden_states):
    """RMSNorm in the input's precision (transformers rounds it through float32)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return module.weight * (hidden_states * torch.rsqrt(variance + module.variance_epsilon))


def make_float64_exact(model) -> None:
    """Make every RMSNorm of ``model`` compute in float64, so that float64 comparisons test the
    prefix/suffix arithmetic rather than float32 rounding inside the norms (identical for both models)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _exact_rms_norm.__get__(module)


def _exact_vision_rotary(q, k, cos, sin):
    """The vision tower's rotary embedding in the input's precision (transformers rounds it through
    float32)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import rotate_half

    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.fixture(scope="module")
def models():
    """(rollplex model, oracle model) with identical float64 weights; the oracle uses SDPA attention."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    patch = pytest.MonkeyPatch()
    patch.setattr(modeling_qwen2_5_vl, "apply_rotary_pos_emb_vision", _exact_vision_rotary)
    torch.manual_seed(0)
    oracle = Qwen2_5_VLForConditionalGeneration(tiny_config()).double()
    with torch.no_grad():
        for p in oracle.parameters():
            p.normal_(0.0, 0.2)
    model = copy.deepcopy(oracle)
    make_float64_exact(oracle)
    make_float64_exact(model)
    prepare_model(model)
    yield model, oracle
    patch.undo()


TOKENS = VisionTokens(IMAGE, VIDEO, 2, 2.0)
_RECORD = Record(0, "q", "video", "multiple choice", ("A. a",), "<answer>A</answer>", "./x.mp4", "")


def make_prompt(texts: list[int], vision: list[tuple[str, tuple[int, int, int], float]], seed: int) -> Prompt:
    """A prompt of text runs (lengths ``texts``) interleaved with vision spans (kind, grid, spg)."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    image_grids, video_grids, spgs, image_px, video_px = [], [], [], [], []
    for i, n in enumerate(texts):
        ids += torch.randint(3, 150, (n,), generator=g).tolist()
        if i < len(vision):
            kind, grid, spg = vision[i]
            rows = grid[0] * grid[1] * grid[2]
            ids += [V_START] + [IMAGE if kind == "image" else VIDEO] * (rows // 4) + [V_END]
            px = torch.randn(rows, 1176, generator=g, dtype=torch.float64)
            (image_px if kind == "image" else video_px).append(px)
            (image_grids if kind == "image" else video_grids).append(grid)
            if kind == "video":
                spgs.append(spg)
    input_ids = torch.tensor(ids)
    igrid = torch.tensor(image_grids) if image_grids else None
    vgrid = torch.tensor(video_grids) if video_grids else None
    spg = torch.tensor(spgs, dtype=torch.float64) if spgs else None
    positions, nxt = rope_positions(input_ids, TOKENS, igrid, vgrid, spg)
    return Prompt(
        record=_RECORD,
        input_ids=input_ids,
        position_ids=positions,
        next_position=nxt,
        content_key=f"k{seed}",
        pixel_values=torch.cat(image_px) if image_px else None,
        image_grid_thw=igrid,
        pixel_values_videos=torch.cat(video_px) if video_px else None,
        video_grid_thw=vgrid,
        second_per_grid_ts=spg,
    )


def full_logprobs(
    oracle, prompt: Prompt, response: torch.Tensor, temperature: float, banned: torch.Tensor = BANNED
) -> torch.Tensor:
    """Oracle: teacher-forced log-probs float64 [R] of ``response`` after ``prompt`` (``vocab_logprobs``
    at the response's own tokens)."""
    vocab = vocab_logprobs(oracle, prompt, response, temperature, banned)
    return vocab.gather(1, response[:, None]).squeeze(1)


def vocab_logprobs(
    oracle, prompt: Prompt, response: torch.Tensor, temperature: float, banned: torch.Tensor = BANNED
) -> torch.Tensor:
    """Oracle: the whole vocabulary's log-probs float64 [R, V] at each position of ``response`` after
    ``prompt`` (teacher-forced), at ``temperature``, banned ids -inf: one full-sequence forward (SDPA
    causal attention), vision features from the HF model's own feature functions, placed at the prompt's
    placeholders only."""
    lm = oracle.model.language_model
    ids = torch.cat([prompt.input_ids, response])
    embeds = lm.embed_tokens(ids)
    p_len = prompt.length
    for px, grid, token, fn in (
        (prompt.pixel_values, prompt.image_grid_thw, IMAGE, oracle.model.get_image_features),
        (prompt.pixel_values_videos, prompt.video_grid_thw, VIDEO, oracle.model.get_video_features),
    ):
        if px is None:
            continue
        out = fn(px, grid)
        feats = torch.cat(list(out.pooler_output if hasattr(out, "pooler_output") else out))
        slot = torch.zeros(ids.shape[0], dtype=torch.bool)
        slot[:p_len] = prompt.input_ids == token
        embeds = embeds.masked_scatter(slot[:, None], feats)
    r = response.shape[0]
    positions = torch.cat([prompt.position_ids, (prompt.next_position + torch.arange(r)).expand(3, r)], dim=1)
    hidden = lm(inputs_embeds=embeds[None], position_ids=positions[:, None, :]).last_hidden_state
    logits = oracle.lm_head(hidden[0, p_len - 1 : -1])
    logits = logits.masked_fill(torch.isin(torch.arange(VOCAB), banned), float("-inf"))
    return torch.log_softmax(logits / temperature, dim=-1)
