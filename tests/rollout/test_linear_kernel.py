"""The gated gate/up product (rollout.linear_kernel) against float64 products rounded as transformers'
eager MLP rounds (on the CPU through Triton's interpreter, which tests/conftest.py switches on; on CUDA
when present, there also in bf16 at the 3B shape)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollplex.rollout.linear_kernel import GateLaunch, gated_up_product  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = GateLaunch(block_n=16, block_k=32, num_warps=4, num_stages=1)


def _inputs(rows, inter, hidden, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * scale
    w = torch.randn(2 * inter, hidden, generator=g) * hidden**-0.5
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype)


def reference(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' eager MLP gate on float64 products: gate and up rounded to x's dtype, SiLU rounded,
    the product rounded."""
    inter, dtype = gate_up.shape[0] // 2, x.dtype
    products = x.double() @ gate_up.double().T
    gate, up = products[:, :inter].to(dtype), products[:, inter:].to(dtype)
    return (F.silu(gate.double()).to(dtype).double() * up.double()).to(dtype)


@pytest.mark.parametrize(
    ("rows", "inter", "hidden", "dtype", "tol"),
    [
        (5, 40, 96, torch.float64, 1e-13),  # ragged everywhere: 3 tiles of 16 for 40, K blocks 32 + 32 + 32
        (70, 33, 130, torch.float64, 1e-13),  # two row tiles, a ragged last K block
        (64, 48, 200, torch.float32, 1e-6),  # full float32 products (on CUDA, tf32 would miss by ~1e-4)
        (3, 17, 64, torch.float16, 1e-3),
    ],
)
def test_gated_product_equals_the_eager_mlp_gate(rows, inter, hidden, dtype, tol):
    x, w = _inputs(rows, inter, hidden, dtype, seed=rows + inter)
    out = gated_up_product(x, w, SMALL)
    want = reference(x, w)
    assert out.shape == (rows, inter) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert float((out.double() - want.double()).norm() / want.double().norm()) <= tol


def test_float16_rounds_where_the_eager_mlp_rounds():
    """float16: gate, up, SiLU and the product each rounded once, as the reference: ≥ 99% of the
    elements equal it exactly (the float32 sums differ from float64 ones only in the last bits). Leaving
    out any one of the four roundings leaves 72-79% equal."""
    x, w = _inputs(16, 200, 256, torch.float16, seed=5)
    out = gated_up_product(x, w, SMALL)
    assert float((out == reference(x, w)).float().mean()) >= 0.99


def test_row_strided_inputs():
    """x and the weight as row-strided views (row stride > K) give the contiguous inputs' result."""
    x, w = _inputs(9, 20, 64, torch.float64, seed=4)
    wide_x = torch.zeros(9, 96, dtype=x.dtype, device=x.device)
    wide_w = torch.zeros(40, 80, dtype=w.dtype, device=w.device)
    wide_x[:, :64], wide_w[:, :64] = x, w
    strided = gated_up_product(wide_x[:, :64], wide_w[:, :64], SMALL)
    assert torch.equal(strided, gated_up_product(x, w, SMALL))


def test_gate_and_up_halves_are_not_swapped():
    """Swapping W_gate and W_up changes the result (SiLU(a)·b ≠ SiLU(b)·a): the kernel reads gate rows first."""
    x, w = _inputs(8, 24, 64, torch.float64, seed=3)
    swapped = torch.cat([w[24:], w[:24]])
    out = gated_up_product(x, w, SMALL)
    assert torch.allclose(out, reference(x, w), rtol=0, atol=1e-12)
    assert not torch.allclose(out, reference(x, swapped), rtol=0, atol=1e-3)


def test_bad_inputs_raise():
    x, w = _inputs(4, 8, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"gate_up \[2·I, K\]"):
        gated_up_product(x, w[:, :16])
    with pytest.raises(ValueError, match=r"gate_up \[2·I, K\]"):
        gated_up_product(x, w[:15])
    with pytest.raises(ValueError, match="dtype"):
        gated_up_product(x, w.double())
    with pytest.raises(ValueError, match="contiguous"):
        gated_up_product(x, w.T.contiguous().T)
    for bad in ({"block_n": 24}, {"block_k": 8}, {"num_warps": 3}, {"num_stages": 0}):
        with pytest.raises(ValueError, match="gate launch"):
            GateLaunch(**bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_at_the_3b_shape():
    """bf16, 64 rows × 2048 → 2 × 11008 with the default launch: rounded where the reference rounds
    (≥ 99% of the elements equal, relative error ≤ 1e-2 norm-wise), bitwise repeatable."""
    x, w = _inputs(64, 11008, 2048, torch.bfloat16, seed=7, scale=1.0)
    out = gated_up_product(x, w)
    want = reference(x, w)
    assert float((out.double() - want.double()).norm() / want.double().norm()) <= 1e-2
    assert float((out == want).float().mean()) >= 0.99
    assert torch.equal(out, gated_up_product(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float64_with_the_default_launch():
    """float64 on CUDA with the default launch (capped at two pipeline stages to fit shared memory)."""
    x, w = _inputs(64, 300, 2048, torch.float64, seed=8)
    assert float((gated_up_product(x, w) - reference(x, w)).abs().max()) <= 1e-12
