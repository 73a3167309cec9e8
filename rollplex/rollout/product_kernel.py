"""Weight products of the decode step for few rows, in Triton: y = x·Wᵀ (+ b) (+ residual).

Legend: M rows (B = 64 on the 3B workload), K input features, N output features.

A decode step multiplies 64 rows by every weight matrix of the model once, so each product is bound by
the bytes of its weight. cuBLAS picks kernels made for large M: on one H200 the q/k/v and o products of
the 3B model reached about 35–40% of the copy bandwidth, the down product 67% (docs/benchmarks.md).
Here one program owns BN output columns for all M rows (M ≤ BM, so every weight byte is read once) and
streams its [BN, K] slice of W through a software-pipelined loop of BK-wide blocks; narrow BN gives
the small matrices enough programs to occupy the device. The bias and the residual are added in the
epilogue, with the rounding of the unfused ops: the product in float32 plus the bias, rounded to the
output dtype, then residual + that, computed in float32 and rounded again (as ``hidden + linear(x)``
does in bf16), so the fused and unfused decode steps differ only by the product's summation order.

tests/rollout checks it against ``F.linear`` through Triton's interpreter on the CPU and in bf16 on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollplex.rollout.decode_kernel import _jit, tl, triton


@dataclass(frozen=True)
class ProductConfig:
    """Block sizes and launch options of one product: BN output columns and BK inputs per block step,
    ``stages`` pipelined loads in flight, ``warps`` per program."""

    bn: int = 32
    bk: int = 128
    stages: int = 4
    warps: int = 4


def default_config(n: int, k: int) -> ProductConfig:
    """The block sizes ``linear`` uses for an [N, K] weight (a sweep on one H200 picked them:
    scripts/product_sweep.py)."""
    return ProductConfig(bn=64 if n >= 8192 else 32)


@_jit
def _linear_kernel(
    x, w, bias, residual, norm, out, M, N, K, eps, sx_m, sw_n, sr_m, so_m,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
    EVEN_K: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):  # fmt: skip
    """Program (column block, row block): out[rows, cols] = x[rows]·W[cols]ᵀ (+ b) (+ residual); with
    NORM the rows of x are RMS-normalised first (scale applied after the product), with GATED the
    columns come as (gate, up) pairs and the program writes silu(gate)·up for its BN/2 pairs."""
    cols = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    rows = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BM, BN), ACC)
    squares = tl.zeros((BM,), ACC)
    for start in range(0, K, BK):
        ks = start + tl.arange(0, BK)
        k_ok = ks < K
        if EVEN_K:
            a = tl.load(x + rows[:, None] * sx_m + ks[None, :], mask=row_ok[:, None], other=0.0)
            b = tl.load(w + cols[None, :] * sw_n + ks[:, None], mask=col_ok[None, :], other=0.0)
        else:
            a = tl.load(
                x + rows[:, None] * sx_m + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            b = tl.load(
                w + cols[None, :] * sw_n + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0
            )
        if NORM:
            wide = a.to(ACC)
            squares += tl.sum(wide * wide, 1)
            a = (wide * tl.load(norm + ks, mask=k_ok, other=0.0).to(ACC)[None, :]).to(a.dtype)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if NORM:
        acc = acc * (1.0 / tl.sqrt(squares / K + eps))[:, None]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
    dtype = out.dtype.element_ty
    if GATED:
        gate, up = tl.split(tl.reshape(acc.to(dtype).to(ACC), (BM, BN // 2, 2)))
        y = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(ACC) * up).to(dtype)
        cols = tl.program_id(0).to(tl.int64) * (BN // 2) + tl.arange(0, BN // 2)
        col_ok = cols < N // 2
    else:
        y = acc.to(dtype)
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:
        r = tl.load(residual + rows[:, None] * sr_m + cols[None, :], mask=mask, other=0.0)
        y = (r.to(ACC) + y.to(ACC)).to(dtype)
    tl.store(out + rows[:, None] * so_m + cols[None, :], y, mask=mask)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    config: ProductConfig | None = None,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
) -> torch.Tensor:
    """rms_norm(x)·Wᵀ (+ bias) (+ residual), or silu(gate)·up of such a product, accumulated in float32
    (float64 for float64 inputs).

    Args:
        x: [M, K]. weight: [N, K] (the layout of ``nn.Linear``), last dim contiguous. bias: [N] or None.
        residual: [M, N] (or [M, N/2] with ``gated``) or None, added after the product is rounded to x's
            dtype. config: block sizes (None: ``default_config``).
        norm: [K] RMSNorm weight or None. Given, each row x is replaced by norm ⊙ x / sqrt(mean(x²) + eps),
            the Qwen2.5-VL RMSNorm; the row scale multiplies the accumulated product (one pass over
            x), so the result differs from normalise-round-multiply by the rounding of the normalised x.
        gated: weight rows are interleaved (gate_0, up_0, gate_1, up_1, …) and the result is
            silu(gate)·up [M, N/2], each of gate, up and silu(gate) rounded to x's dtype as the unfused
            ops round them (``interleave_gate_up`` builds such a weight).

    Returns:
        [M, N] (gated: [M, N/2]) in x's dtype.

    Raises:
        ValueError: shapes, dtypes, devices or strides other than these (the message names them).
        ImportError: Triton is not installed.
    """
    if triton is None:
        raise ImportError("the decode products need Triton (installed with the CUDA builds of torch)")
    m, k = x.shape
    n = weight.shape[0]
    _check(x, weight, bias, residual, norm, gated)
    cfg = config or default_config(n, k)
    out = torch.empty(m, n // 2 if gated else n, device=x.device, dtype=x.dtype)
    bm = max(16, min(64, 1 << (m - 1).bit_length()))
    grid = (triton.cdiv(n, cfg.bn), triton.cdiv(m, bm))
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    _linear_kernel[grid](
        x, weight, bias if bias is not None else x, residual if residual is not None else x,
        norm if norm is not None else x, out, m, n, k, eps,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, NORM=norm is not None, GATED=gated,
        EVEN_K=k % cfg.bk == 0, ACC=acc, PRECISION=_precision(x.dtype), BM=bm, BN=cfg.bn, BK=cfg.bk, num_stages=cfg.stages,
        num_warps=cfg.warps,
    )  # fmt: skip
    return out


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: float32 inputs as ``F.linear`` multiplies them (TF32 only where torch
    allows it for matrix products), float64 exactly; 16-bit inputs are multiplied exactly either way."""
    exact = dtype == torch.float64 or (dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32)
    return "ieee" if exact else "tf32"


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[2I, K] weight with rows gate_0, up_0, gate_1, up_1, … of gate/up [I, K] (a copy), the layout
    ``linear(..., gated=True)`` reads."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], gate.shape[1])


def _check(x, weight, bias, residual, norm, gated: bool) -> None:
    """Shapes, strides, dtypes and devices the kernel assumes (metadata only: safe under capture)."""
    m, k = x.shape
    n = weight.shape[0]
    problems = []
    if gated and n % 2:
        problems.append(f"an even number of (gate, up) rows with gated, got N = {n}")
    if norm is not None and norm.shape != (k,):
        problems.append(f"norm [K] = [{k}], got {tuple(norm.shape)}")
    if weight.dim() != 2 or weight.shape[1] != k:
        problems.append(f"weight [N, K] with K = {k}, got {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        problems.append("a contiguous last dimension in x and weight")
    if bias is not None and bias.shape != (n,):
        problems.append(f"bias [N] = [{n}], got {tuple(bias.shape)}")
    width = n // 2 if gated else n
    if residual is not None and (residual.shape != (m, width) or residual.stride(1) != 1):
        problems.append(f"residual [M, N] = [{m}, {width}] with a contiguous last dimension")
    others = [t for t in (weight, bias, residual, norm) if t is not None]
    if any(t.dtype != x.dtype for t in others):
        problems.append(f"every tensor in x's dtype {x.dtype}")
    if any(t.device != x.device for t in others):
        problems.append(f"every tensor on {x.device}")
    if problems:
        raise ValueError("decode product needs " + "; ".join(problems))
