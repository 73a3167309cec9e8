"""The decode products' Triton kernel equals ``F.linear`` (+ bias, + residual): float32 on the CPU
through Triton's interpreter (tests/conftest.py switches it on), bf16 at the 3B shapes on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollplex.rollout.decode import rms_norm  # noqa: E402
from rollplex.rollout.product_kernel import ProductConfig, interleave_gate_up, linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEVICE == "cpu" else 2e-2  # float32 products run as TF32 on the GPU's tensor cores


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (64, 96, 256, ProductConfig(bn=32, bk=128)),
        (5, 37, 100, ProductConfig(bn=16, bk=64)),  # partial row, column and K blocks
        (70, 40, 64, ProductConfig(bn=32, bk=64)),  # two row blocks
        (64, 64, 192, None),
    ],
)
def test_linear_equals_f_linear(m, n, k, config):
    x, w, b, r = _rand(m, k), _rand(n, k, seed=1), _rand(n, seed=2), _rand(m, n, seed=3)
    assert (linear(x, w, config=config) - F.linear(x, w)).abs().max() <= TOL
    assert (linear(x, w, b, config=config) - F.linear(x, w, b)).abs().max() <= TOL
    assert (linear(x, w, b, r, config=config) - (r + F.linear(x, w, b))).abs().max() <= TOL
    assert (linear(x, w, None, r, config=config) - (r + F.linear(x, w))).abs().max() <= TOL


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bf16 products need CUDA (the interpreter's are wrong)"
)
def test_residual_is_added_after_rounding_the_product():
    """bf16: residual + round(x·Wᵀ), as the unfused step computes it, not round(residual + x·Wᵀ): the
    product 1 + 2⁻⁸ rounds to 1.0 in bf16, then 256 + 1 = 257 ties to even, 256; rounded once, the sum
    257.0039 would give 258 (bf16 spacing at 256 is 2)."""
    x = torch.tensor([[1.0, 2**-8]], device=DEVICE, dtype=torch.bfloat16)
    w = torch.tensor([[1.0, 1.0]], device=DEVICE, dtype=torch.bfloat16)
    r = torch.tensor([[256.0]], device=DEVICE, dtype=torch.bfloat16)
    unfused = r + F.linear(x, w)
    assert float(unfused) == 256.0
    assert torch.equal(linear(x, w, None, r, config=ProductConfig(bn=16, bk=16)), unfused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_and_gate_equal_the_unfused_ops(dtype, gated):
    """rms_norm(x)·Wᵀ + b, and silu(gate)·up of the normalised x through (gate, up) rows interleaved:
    the decoder layer's unfused ops (rollout.decode.rms_norm, F.linear, F.silu), to float32 rounding or
    1e-12 in float64 (norm scale applied after the product only reorders exact arithmetic)."""
    if dtype == torch.float64 and DEVICE == "cuda":
        pytest.skip("Triton has no float64 matrix product on the GPU (the interpreter checks float64)")
    m, k, inter = 6, 96, 40
    x, ln = _rand(m, k, dtype=dtype) * 3, _rand(k, seed=4, dtype=dtype)
    gate, up = _rand(inter, k, seed=5, dtype=dtype), _rand(inter, k, seed=6, dtype=dtype)
    normed = rms_norm(x, ln, 1e-6)
    cfg, tol = ProductConfig(bn=16, bk=32), 1e-4 if dtype == torch.float32 else 1e-12
    if gated:
        want = F.silu(F.linear(normed, gate)) * F.linear(normed, up)
        got = linear(x, interleave_gate_up(gate, up), config=cfg, norm=ln, eps=1e-6, gated=True)
    else:
        b = _rand(inter, seed=7, dtype=dtype)
        want, got = F.linear(normed, gate, b), linear(x, gate, b, config=cfg, norm=ln, eps=1e-6)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= tol * float(want.abs().max())


def test_wrong_inputs_are_named():
    x, w = _rand(4, 32), _rand(8, 32, seed=1)
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        linear(x, _rand(8, 16))
    with pytest.raises(ValueError, match="bias \\[N\\]"):
        linear(x, w, _rand(7))
    with pytest.raises(ValueError, match="residual \\[M, N\\]"):
        linear(x, w, None, _rand(4, 7))
    with pytest.raises(ValueError, match="x's dtype"):
        linear(x, w.double())
    with pytest.raises(ValueError, match="contiguous last"):
        linear(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="norm \\[K\\]"):
        linear(x, w, norm=_rand(16))
    with pytest.raises(ValueError, match="even number"):
        linear(x, _rand(7, 32), gated=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("n", "k", "norm", "gated"),
    [
        (2560, 2048, True, False),
        (2048, 2048, False, False),
        (22016, 2048, True, True),
        (2048, 11008, False, False),
    ],
)
def test_bf16_at_the_3b_shapes(n, k, norm, gated):
    """64 rows in bf16 at the 3B layer's products (q/k/v with the input norm, o, gate/up with the post
    norm and the SiLU gate, down) against float64 ops on the same inputs: within bf16 rounding."""
    x = _rand(64, k, dtype=torch.bfloat16) * 4
    w, b = _rand(n, k, seed=1, dtype=torch.bfloat16) * k**-0.5, _rand(n, seed=2, dtype=torch.bfloat16)
    ln = _rand(k, seed=3, dtype=torch.bfloat16) if norm else None
    x64, w64 = x.double(), w.double()
    if norm:
        x64 = ln.double() * x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6)
    if gated:
        pairs = F.linear(x64, w64).view(64, n // 2, 2)
        ref, got = F.silu(pairs[..., 0]) * pairs[..., 1], linear(x, w, norm=ln, gated=True)
    else:
        ref, got = F.linear(x64, w64, b.double()), linear(x, w, b, norm=ln)
    err = (got.double() - ref).abs().max()
    assert err <= 2e-2 * float(ref.abs().max()), float(err)
