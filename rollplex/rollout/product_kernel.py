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
    x, w, bias, residual, out, M, N, K, sx_m, sw_n, sr_m, so_m,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Program (column block, row block): out[rows, cols] = x[rows]·W[cols]ᵀ (+ b) (+ residual)."""
    cols = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    rows = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BM, BN), tl.float32)
    for start in range(0, K, BK):
        ks = start + tl.arange(0, BK)
        if EVEN_K:
            a = tl.load(x + rows[:, None] * sx_m + ks[None, :], mask=row_ok[:, None], other=0.0)
            b = tl.load(w + cols[None, :] * sw_n + ks[:, None], mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K
            a = tl.load(
                x + rows[:, None] * sx_m + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            b = tl.load(
                w + cols[None, :] * sw_n + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0
            )
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:
        r = tl.load(residual + rows[:, None] * sr_m + cols[None, :], mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + rows[:, None] * so_m + cols[None, :], y, mask=mask)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    config: ProductConfig | None = None,
) -> torch.Tensor:
    """x·Wᵀ (+ bias) (+ residual) with the product accumulated in float32.

    Args:
        x: [M, K]. weight: [N, K] (the layout of ``nn.Linear``), last dim contiguous. bias: [N] or None.
        residual: [M, N] or None, added after the product is rounded to x's dtype. config: block sizes
            (None: ``default_config``).

    Returns:
        [M, N] in x's dtype.

    Raises:
        ValueError: shapes, dtypes, devices or strides other than these (the message names them).
        ImportError: Triton is not installed.
    """
    if triton is None:
        raise ImportError("the decode products need Triton (installed with the CUDA builds of torch)")
    m, k = x.shape
    n = weight.shape[0]
    _check(x, weight, bias, residual)
    cfg = config or default_config(n, k)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm = max(16, min(64, 1 << (m - 1).bit_length()))
    grid = (triton.cdiv(n, cfg.bn), triton.cdiv(m, bm))
    _linear_kernel[grid](
        x, weight, bias if bias is not None else x, residual if residual is not None else x, out,
        m, n, k, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, EVEN_K=k % cfg.bk == 0,
        BM=bm, BN=cfg.bn, BK=cfg.bk, num_stages=cfg.stages, num_warps=cfg.warps,
    )  # fmt: skip
    return out


def _check(x, weight, bias, residual) -> None:
    """Shapes, strides, dtypes and devices the kernel assumes (metadata only: safe under capture)."""
    m, k = x.shape
    n = weight.shape[0]
    problems = []
    if weight.dim() != 2 or weight.shape[1] != k:
        problems.append(f"weight [N, K] with K = {k}, got {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        problems.append("a contiguous last dimension in x and weight")
    if bias is not None and bias.shape != (n,):
        problems.append(f"bias [N] = [{n}], got {tuple(bias.shape)}")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        problems.append(f"residual [M, N] = [{m}, {n}] with a contiguous last dimension")
    others = [t for t in (weight, bias, residual) if t is not None]
    if any(t.dtype != x.dtype for t in others):
        problems.append(f"every tensor in x's dtype {x.dtype}")
    if any(t.device != x.device for t in others):
        problems.append(f"every tensor on {x.device}")
    if problems:
        raise ValueError("decode product needs " + "; ".join(problems))
