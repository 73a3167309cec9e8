"""The decode step's gate/up product with the SiLU gate in its epilogue, in Triton.

Legend: M rows (the decode batch, B = G·N), K hidden size, I intermediate size.

The MLP of a decoder layer computes SiLU(x·W_gateᵀ) · (x·W_upᵀ). With the gate and up weights
concatenated into one [2·I, K] matrix (``rollout.fused_projections``) that is one cuBLAS product
writing [M, 2·I], then one elementwise kernel reading it back. Here each program streams BLOCK_N rows of
W_gate and the same rows of W_up, keeps both [M, BLOCK_N] sums in registers and writes only the gated
[M, BLOCK_N] result: one kernel instead of two. It rounds where transformers' eager MLP rounds: the
gate and up products to the output dtype, SiLU, then their product (SiLU goes through Triton's exp and
division, which compile to approximate instructions on NVIDIA GPUs: within float32 rounding of
PyTorch's, not bitwise).

Every [BLOCK_M ≤ 64]-row tile of x streams the whole weight, so the decode step uses the kernel for at
most ``MAX_ROWS`` = 64 rows (one row tile); a larger batch keeps cuBLAS's product.

Its time per call against cuBLAS's product alone, and why the q/k/v, o and down products stay with
cuBLAS (Triton split-K products for them were slower), are in benchmarks/README.md.

tests/rollout checks the kernel against float64 products through Triton's interpreter on the CPU and,
on CUDA, in bf16; tests/numerics checks a rollout through it against the trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rollplex.rollout.decode_kernel import _jit, _pow2, is_pow2, triton

if triton is not None:
    import triton.language as tl
else:  # pragma: no cover - exercised only on installs without Triton
    tl = None

MAX_ROWS = 64  # the decode step uses the kernel up to this many rows (one row tile; see above)


@dataclass(frozen=True)
class GateLaunch:
    """Launch settings: output features per program and K per inner iteration (powers of two >= 16),
    warps (a power of two) and pipeline stages (>= 1). The default comes from a tuning sweep
    (benchmarks/README.md; any setting is exact)."""

    block_n: int = 32
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        ok = is_pow2(self.block_n, 16) and is_pow2(self.block_k, 16) and is_pow2(self.num_warps)
        if not ok or not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(
                f"gate launch needs block_n, block_k powers of two >= 16, warps a power of two, stages >= 1: {self}"
            )


@_jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a·bᵀ; IEEE: full float32 products (Triton's default for float32 operands is tf32)."""
    if IEEE:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee", out_dtype=acc.dtype)
    return tl.dot(a, tl.trans(b), acc, out_dtype=acc.dtype)


@_jit
def _gated(
    x, w, out, M, INTER, K, up_offset, stride_xm, stride_wn, stride_om,
    F64: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program (n tile, m tile): SiLU(x·W_gate[n tile]ᵀ) · (x·W_up[n tile]ᵀ); W_up starts up_offset
    elements after W_gate."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < INTER
    if F64:  # a compile-time branch: float64 inputs sum in float64, the rest in float32
        gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float64)
    else:
        gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = gate
    x_rows = x + rm.to(tl.int64)[:, None] * stride_xm
    gate_rows = w + rn.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + up_offset
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = (k < K)[None, :]
        xk = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        gate = _dot(xk, tl.load(gate_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0), gate, IEEE)
        up = _dot(xk, tl.load(up_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0), up, IEEE)
    dtype = out.dtype.element_ty
    wide = gate.dtype
    gate = gate.to(dtype).to(wide)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(wide)
    result = (silu * up.to(dtype).to(wide)).to(dtype)
    tl.store(
        out + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], result, mask=m_ok[:, None] & n_ok[None, :]
    )


def gated_up_product(
    x: torch.Tensor, gate_up: torch.Tensor, launch: GateLaunch = GateLaunch()
) -> torch.Tensor:
    """SiLU(x·W_gateᵀ) · (x·W_upᵀ) of the concatenated weight gate_up = [W_gate; W_up].

    Args:
        x: [M, K] (the post-attention-normed hidden states), last dim contiguous. gate_up: [2·I, K],
            gate rows first, last dim contiguous, x's dtype and device. launch: ``GateLaunch`` (float64
            inputs run at most two of its pipeline stages).

    Returns:
        [M, I] in x's dtype. Products summed in float32 (float64 for float64 inputs; float32 operands
        multiplied in full float32, not tf32); gate and up rounded to x's dtype, SiLU rounded, their
        product rounded, where transformers' eager Qwen2 MLP rounds (module docstring).

    Raises:
        ValueError: mismatched shapes, dtypes, devices or a non-contiguous last dim.
        ImportError: Triton is not installed.
    """
    if triton is None:
        raise ImportError("the gated decode product needs Triton (installed with the CUDA builds of torch)")
    _check(x, gate_up)
    m, k = x.shape
    inter = gate_up.shape[0] // 2
    block_m = min(MAX_ROWS, _pow2(m))  # one power-of-two row tile of 16..64 rows, more tiles above 64
    out = torch.empty(m, inter, device=x.device, dtype=x.dtype)
    # float64 tiles take four times bf16's shared memory per stage: capped at two stages
    stages = min(launch.num_stages, 2) if x.dtype == torch.float64 else launch.num_stages
    _gated[(math.ceil(inter / launch.block_n), math.ceil(m / block_m))](
        x, gate_up, out, m, inter, k, inter * gate_up.stride(0), x.stride(0), gate_up.stride(0), out.stride(0),
        F64=x.dtype == torch.float64, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, num_warps=launch.num_warps, num_stages=stages,
    )  # fmt: skip
    return out


def _check(x: torch.Tensor, gate_up: torch.Tensor) -> None:
    """Shapes, dtypes, devices and strides ``gated_up_product`` assumes (metadata only: safe under capture)."""
    problems = []
    if x.dim() != 2 or gate_up.dim() != 2 or x.shape[1] != gate_up.shape[1] or gate_up.shape[0] % 2:
        problems.append(f"x [M, K] and gate_up [2·I, K], got {tuple(x.shape)} and {tuple(gate_up.shape)}")
    if gate_up.dtype != x.dtype or gate_up.device != x.device:
        problems.append(f"gate_up in x's dtype {x.dtype} on {x.device}")
    if x.stride(-1) != 1 or gate_up.stride(-1) != 1:
        problems.append("a contiguous last dimension")
    if problems:
        raise ValueError("gated decode product needs " + "; ".join(problems))
