"""The batched vision attention (``models.attention.chunked_attention``) equals transformers' per-chunk
SDPA loop: on random packed chunks (ragged, equal, empty) and through the whole vision tower, values
and gradients, in float64."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F

from rollplex.models import attention
from rollplex.models.attention import VISION_ATTENTION_NAME, chunked_attention
from rollplex.models.forward import enable_checkpointing, prepare_model
from tests.numerics.conftest import tiny_config


def _loop(q, k, v, bounds, scale):
    """transformers' non-flash path: one SDPA call per chunk, concatenated → [1, S, H, D]."""
    outs = [
        F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale=scale)
        for s, e in zip(bounds, bounds[1:])
        if e > s
    ]
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize(
    "bounds", [[0, 64, 128, 160, 176, 240, 240, 272], [0, 40, 80, 120], [0, 7, 8, 50, 51]]
)
def test_chunked_equals_the_per_chunk_loop(bounds):
    g = torch.Generator().manual_seed(len(bounds))
    seq = bounds[-1]
    q, k, v = (
        torch.randn(1, 3, seq, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    cu = torch.tensor(bounds, dtype=torch.int32)
    got, _ = chunked_attention(None, q, k, v, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    want = _loop(q, k, v, bounds, 0.3)
    assert got.shape == want.shape == (1, seq, 3, 8)
    assert (got - want).abs().max() <= 1e-12
    weights = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad((got * weights).sum(), (q, k, v)),
        torch.autograd.grad((want * weights).sum(), (q, k, v)),
    ):
        assert (a - b).abs().max() <= 1e-12


def test_without_boundaries_is_one_chunk():
    q, k, v = (torch.randn(1, 2, 10, 8, dtype=torch.float64) for _ in range(3))
    got, _ = chunked_attention(None, q, k, v, scaling=None)
    assert (got - _loop(q, k, v, [0, 10], None)).abs().max() <= 1e-12


@pytest.mark.parametrize("bounds", [[0, 4, 9], [0, 6, 4, 10], [1, 10]])
def test_boundaries_must_cover_the_sequence(bounds):
    q = torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match="do not cover 10 tokens"):
        chunked_attention(None, q, q, q, cu_seq_lens_q=torch.tensor(bounds))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ({"attention_mask": torch.ones(1)}, "no mask"),
        ({"is_causal": True}, "non-causal"),
        ({"cu_seq_lens_q": torch.tensor([0, 10]), "cu_seq_lens_k": torch.tensor([0, 5, 10])}, "key chunk"),
        ({"cu_seqlens_q": torch.tensor([0, 5, 10])}, "boundaries as cu_seq_lens_q"),
    ],
)
def test_calls_it_is_not_written_for_are_refused(call, message):
    q = torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match=message):
        chunked_attention(None, q, q, q, **call)


def spy_batching(monkeypatch) -> dict[str, int]:
    """Counts of chunk-boundary reads ("reads": one per boundary tensor transformers hands over, see
    ``chunk_plan``) and of batched SDPA calls (one per distinct chunk length and layer)."""
    counts = {"reads": 0, "buckets": 0, "sdpa": 0}
    buckets, sdpa = attention._buckets, attention._chunk_sdpa

    def counted_buckets(bounds, seq):
        out = buckets(bounds, seq)
        counts["reads"] += 1
        counts["buckets"] += len(out)
        return out

    def counted_sdpa(*args):
        counts["sdpa"] += 1
        return sdpa(*args)

    monkeypatch.setattr(attention, "_buckets", counted_buckets)
    monkeypatch.setattr(attention, "_chunk_sdpa", counted_sdpa)
    return counts


@pytest.mark.parametrize(
    ("grid", "buckets"), [((2, 12, 20), 3 + 1), ((1, 8, 8), 1 + 1), ((4, 16, 12), 2 + 1)]
)
def test_vision_tower_batched_equals_transformers(grid, buckets, monkeypatch):
    """Windowed (ragged edge windows) and full-attention layers; gradients into pixels and weights.
    transformers hands each layer's window boundaries over in one call: one batched SDPA call per
    distinct window length (windowed layer) plus one (full-attention layer)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    reference = Qwen2_5_VLForConditionalGeneration(tiny_config()).double()
    batched = copy.deepcopy(reference)
    prepare_model(batched, vision_attention="batched")
    grid_thw = torch.tensor([grid])
    pixels = torch.randn(int(grid_thw.prod()), 3 * 2 * 14 * 14, dtype=torch.float64)
    counts = spy_batching(monkeypatch)
    outs, grads = [], []
    for model in (reference, batched):
        px = pixels.clone().requires_grad_(True)
        out = model.model.visual(px, grid_thw=grid_thw).pooler_output
        weight = model.model.visual.blocks[0].attn.qkv.weight
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (px, weight)))
    assert counts == {"reads": 2, "buckets": buckets, "sdpa": buckets}  # the batched model's forward only
    assert (outs[0] - outs[1]).abs().max() <= 1e-12
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-12 * max(1.0, float(a.abs().max()))


def test_a_boundary_tensor_is_read_once(monkeypatch):
    """``chunk_plan`` keeps the plan of a boundary tensor (each read makes the host wait for the device):
    the same tensor again is not read again and gives the same values; equal values in another tensor,
    or the tensor changed in place, are read again, and the changed boundaries are the ones used."""
    counts = spy_batching(monkeypatch)
    q, k, v = (torch.randn(1, 2, 51, 8, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 7, 8, 50, 51])
    first, _ = chunked_attention(None, q, k, v, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    again, _ = chunked_attention(None, q, k, v, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert counts["reads"] == 1 and torch.equal(first, again)
    other = cu.clone()
    chunked_attention(None, q, k, v, cu_seq_lens_q=other)
    assert counts["reads"] == 2
    cu[1] = 3
    got, _ = chunked_attention(None, q, k, v, cu_seq_lens_q=cu)
    assert counts["reads"] == 3
    assert (got - _loop(q, k, v, [0, 3, 8, 50, 51], None)).abs().max() <= 1e-12


def test_plans_of_boundary_tensors_that_are_gone_are_dropped():
    """A kept plan holds its token order on the device; once its boundary tensor is gone, the next new
    plan drops it."""
    q = torch.randn(1, 2, 51, 8, dtype=torch.float64)
    gone = torch.tensor([0, 7, 8, 50, 51])
    kept = torch.tensor([0, 3, 51])  # made while ``gone`` lives, so it cannot take over its id (the key)
    chunked_attention(None, q, q, q, cu_seq_lens_q=gone)
    entry = next(e for e in attention._PLANS.values() if e[0]() is gone)
    del gone
    chunked_attention(None, q, q, q, cu_seq_lens_q=kept)
    assert all(e is not entry for e in attention._PLANS.values())
    assert all(ref() is not None for ref, _, _ in attention._PLANS.values())
    assert any(ref() is kept for ref, _, _ in attention._PLANS.values())


def test_a_kept_plan_serves_only_its_own_tensor():
    """A plan kept under a tensor's key is used only while that very tensor lives (its id may be taken
    over by a later tensor once it is gone) and for the same sequence length: a wrong plan planted under
    the key of a gone tensor, or of the same tensor at another length, is not used."""
    q = torch.randn(1, 2, 51, 8, dtype=torch.float64)
    cu = torch.tensor([0, 7, 8, 50, 51])
    wrong = attention.ChunkPlan(51, [(51, [0])], None)  # one chunk of 51: attention across all tokens
    key = attention._plan_key(cu, q.device)
    attention._PLANS[key] = (weakref.ref(torch.tensor([0])), cu._version, wrong)  # a gone tensor's plan
    got, _ = chunked_attention(None, q, q, q, cu_seq_lens_q=cu)
    assert (got - _loop(q, q, q, [0, 7, 8, 50, 51], None)).abs().max() <= 1e-12
    attention._PLANS[key] = (weakref.ref(cu), cu._version, attention.ChunkPlan(40, [(40, [0])], None))
    got, _ = chunked_attention(None, q, q, q, cu_seq_lens_q=cu)
    assert (got - _loop(q, q, q, [0, 7, 8, 50, 51], None)).abs().max() <= 1e-12


def test_a_plan_made_again_is_the_newest_and_the_oldest_goes(monkeypatch):
    """Past ``_PLAN_SLOTS`` the oldest plan goes; a plan made again for its tensor (changed in place)
    counts as the newest, and a kept plan is the one used."""
    monkeypatch.setattr(attention, "_PLANS", {})
    monkeypatch.setattr(attention, "_PLAN_SLOTS", 2)
    q = torch.randn(1, 2, 51, 8, dtype=torch.float64)
    a, b, c = (torch.tensor([0, n, 51]) for n in (3, 5, 9))
    for cu in (a, b):
        chunked_attention(None, q, q, q, cu_seq_lens_q=cu)
    a[1] = 4  # a's plan is made again: now the newest
    chunked_attention(None, q, q, q, cu_seq_lens_q=a)
    chunked_attention(None, q, q, q, cu_seq_lens_q=c)
    assert [ref() for ref, _, _ in attention._PLANS.values()] == [a, c]
    kept = attention._PLANS[attention._plan_key(c, q.device)][2]
    assert attention.chunk_plan(c, 51, q.device) is kept


def test_inference_tensors_get_a_plan_that_is_not_kept():
    """Inference tensors have no version counter: their plan is made each call and not kept."""
    q = torch.randn(1, 2, 51, 8, dtype=torch.float64)
    with torch.inference_mode():
        cu = torch.tensor([0, 7, 8, 50, 51])
        got, _ = chunked_attention(None, q, q, q, cu_seq_lens_q=cu)
    assert (got - _loop(q, q, q, [0, 7, 8, 50, 51], None)).abs().max() <= 1e-12
    assert not any(ref() is cu for ref, _, _ in attention._PLANS.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_plan_is_kept_per_stream(monkeypatch):
    """On CUDA a plan's token order was copied on the stream that made it, so another stream makes its
    own; both give the per-chunk loop's values."""
    counts = spy_batching(monkeypatch)
    q = torch.randn(1, 2, 51, 8, device="cuda")
    cu = torch.tensor([0, 7, 8, 50, 51], device="cuda")
    want = _loop(q, q, q, [0, 7, 8, 50, 51], None)
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.current_stream()):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got, _ = chunked_attention(None, q, q, q, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        torch.cuda.current_stream().wait_stream(stream)
        assert (got - want).abs().max() <= 1e-5
    assert counts["reads"] == 2


def test_the_tower_reads_each_boundary_tensor_once(monkeypatch):
    """A four-block tower (windows in blocks 0 and 2, whole frames in 1 and 3) reads its two boundary
    tensors once per forward, and activation checkpointing's recompute in backward reads none again
    (read per block, that was 4 reads in forward and 4 more in backward); values as transformers'."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = tiny_config()
    config.vision_config.depth, config.vision_config.fullatt_block_indexes = 4, [1, 3]
    torch.manual_seed(0)
    reference = Qwen2_5_VLForConditionalGeneration(config).double()
    model = copy.deepcopy(reference)
    prepare_model(model, vision_attention="batched")
    enable_checkpointing(model)
    grid_thw = torch.tensor([(2, 12, 20)])
    pixels = torch.randn(int(grid_thw.prod()), 3 * 2 * 14 * 14, dtype=torch.float64)
    counts = spy_batching(monkeypatch)
    out = model.model.visual(pixels.clone().requires_grad_(True), grid_thw=grid_thw).pooler_output
    assert counts["reads"] == 2
    out.square().sum().backward()
    assert counts["reads"] == 2
    want = reference.model.visual(pixels, grid_thw=grid_thw).pooler_output
    assert (out - want).abs().max() <= 1e-12


def test_unknown_vision_attention_is_named():
    from transformers import Qwen2_5_VLForConditionalGeneration

    with pytest.raises(ValueError, match="vision_attention 'flash'"):
        prepare_model(Qwen2_5_VLForConditionalGeneration(tiny_config()), vision_attention="flash")


def test_prepare_model_switches_the_vision_tower_both_ways(monkeypatch):
    """batched → per_chunk puts back the backend the model was built with, and the switch takes effect:
    the batched function runs only while batched is set."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration(tiny_config()).double()
    built_with = model.model.visual.config._attn_implementation
    grid_thw = torch.tensor([(1, 8, 8)])
    pixels = torch.randn(int(grid_thw.prod()), 3 * 2 * 14 * 14, dtype=torch.float64)
    counts = spy_batching(monkeypatch)
    for mode, reads in (("batched", 2), ("per_chunk", 2), ("batched", 4)):
        prepare_model(model, vision_attention=mode)
        model.model.visual(pixels, grid_thw=grid_thw)
        assert counts["reads"] == reads
    prepare_model(model, vision_attention="per_chunk")
    assert model.model.visual.config._attn_implementation == built_with != VISION_ATTENTION_NAME
