"""The post-attention block kernel (rollout.block_kernel) against float64 layers rounded where
transformers' eager layer rounds (on the CPU through Triton's interpreter, which tests/conftest.py
switches on; on CUDA when present, there also in bf16 at the 3B shape)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollplex.rollout.block_kernel import BlockLaunch, counters_for, post_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = BlockLaunch(block_o=16, block_g=16, block_d=16, block_k=16, down_splits=3, num_stages=1)


def _layer(rows, hidden, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = {
        "hidden": torch.randn(rows, hidden, generator=g),
        "attention": torch.randn(rows, hidden, generator=g),
        "w_o": torch.randn(hidden, hidden, generator=g) * hidden**-0.5,
        "w_post": 1.0 + 0.1 * torch.randn(hidden, generator=g),
        "gate_up": torch.randn(2 * inter, hidden, generator=g) * hidden**-0.5,
        "w_down": torch.randn(hidden, inter, generator=g) * inter**-0.5,
    }
    return {k: v.to(DEVICE, dtype) for k, v in t.items()}


def reference(hidden, attention, w_o, w_post, gate_up, w_down, eps):
    """The layer after attention in float64 products, rounded to the dtype where transformers' eager
    Qwen2.5-VL layer rounds (rollout.decode.rms_norm's float32 normalisation, float64 for float64)."""
    dtype, inter = hidden.dtype, w_down.shape[1]
    wide = torch.promote_types(dtype, torch.float32)
    h1 = (hidden.to(wide) + (attention.double() @ w_o.double().T).to(dtype).to(wide)).to(dtype)
    h = h1.to(wide)
    x = w_post * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    products = x.double() @ gate_up.double().T
    gate, up = products[:, :inter].to(dtype), products[:, inter:].to(dtype)
    act = (F.silu(gate.double()).to(dtype).double() * up.double()).to(dtype)
    down = (act.double() @ w_down.double().T).to(dtype)
    return (h1.to(wide) + down.to(wide)).to(dtype)


@pytest.mark.parametrize(
    ("rows", "hidden", "inter", "dtype", "tol"),
    [
        (5, 48, 80, torch.float64, 1e-12),  # ragged: 3 o tiles, 5 gate/up tiles, 3 splits of 32
        (17, 64, 100, torch.float64, 1e-12),  # a second power-of-two row tile, a ragged last split
        (8, 40, 64, torch.float32, 1e-5),  # full float32 products
    ],
)
def test_block_equals_the_eager_layer(rows, hidden, inter, dtype, tol):
    t = _layer(rows, hidden, inter, dtype, seed=rows + hidden)
    counters = counters_for(hidden, SMALL, DEVICE)
    out = post_attention(**t, eps=1e-6, counters=counters, launch=SMALL)
    want = reference(**t, eps=1e-6)
    assert out.shape == (rows, hidden) and out.dtype == dtype
    assert float((out.double() - want.double()).norm() / want.double().norm()) <= tol
    assert int(counters.abs().sum()) == 0  # left zeroed for the next launch
    again = post_attention(**t, eps=1e-6, counters=counters, launch=SMALL)
    assert torch.equal(again, out)  # deterministic, and the counters were reset


def test_float16_rounds_where_the_eager_layer_rounds():
    """float16: each rounding of the reference happens once in the kernel: >= 97% of the outputs equal
    it exactly (float32 sums differ from float64 ones only in the last bits). Leaving out the rounding
    of the normalised hidden, of the down product or of the o product leaves fewer equal."""
    t = _layer(16, 64, 96, torch.float16, seed=3)
    out = post_attention(**t, eps=1e-6, counters=counters_for(64, SMALL, DEVICE), launch=SMALL)
    assert float((out == reference(**t, eps=1e-6)).float().mean()) >= 0.97


@pytest.mark.skipif(DEVICE != "cuda", reason="the 3B shape in bf16 runs on CUDA")
def test_bf16_block_at_the_3b_shape_matches_float64_and_the_separate_kernels():
    """64 rows, hidden 2048, intermediate 11008, the default launch: as close to the float64 layer as
    the decode step's separate kernels are (their compiled layer_post), and bitwise equal from launch
    to launch."""
    from rollplex.rollout.decode import DecodeShape, layer_post

    t = _layer(64, 2048, 11008, torch.bfloat16, seed=0)
    counters = counters_for(2048, device=DEVICE)
    out = post_attention(**t, eps=1e-6, counters=counters)
    want = reference(**t, eps=1e-6).double()
    shape = DecodeShape(1, 64, 16, 2, 128, 512, 128**-0.5, 1e-6, gated_kernel=True)
    weights = (None, None, None, t["w_o"], t["w_post"], (t["gate_up"],), t["w_down"])
    separate = layer_post(t["hidden"], t["attention"], weights, shape).double()
    error = float((out.double() - want).norm() / want.norm())
    assert error <= max(2 * float((separate - want).norm() / want.norm()), 1e-3)
    assert torch.equal(post_attention(**t, eps=1e-6, counters=counters), out)
    assert int(counters.abs().sum()) == 0
