"""The decode products' Triton kernel equals ``F.linear`` (+ bias, + residual): float32 on the CPU
through Triton's interpreter (tests/conftest.py switches it on), bf16 at the 3B shapes on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollplex.rollout.product_kernel import ProductConfig, linear  # noqa: E402

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("n", "k"), [(2560, 2048), (2048, 2048), (22016, 2048), (2048, 11008)])
def test_bf16_at_the_3b_shapes(n, k):
    """64 rows in bf16 against a float64 product of the same inputs: within bf16 rounding."""
    x = _rand(64, k, dtype=torch.bfloat16)
    w, b = _rand(n, k, seed=1, dtype=torch.bfloat16) * k**-0.5, _rand(n, seed=2, dtype=torch.bfloat16)
    ref = F.linear(x.double(), w.double(), b.double())
    err = (linear(x, w, b).double() - ref).abs().max()
    assert err <= 2e-2 * float(ref.abs().max()), float(err)
