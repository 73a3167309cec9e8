"""Decode-step matrix products for few rows in Triton: split-K with a deterministic in-kernel reduction,
and the SiLU-gated MLP product with its activation in the epilogue.

Legend: M rows (the decode batch, B = G·N), K input features, N output features, S K-slices.

A decode step multiplies ~64 rows by each weight matrix once, so a product's time is the time to
stream the weight through the chip. cuBLAS reaches 1.4-1.5 TB/s on the 3B model's q/k/v and o
products and 2.7 TB/s on its down product (docs/benchmarks.md), against ~4.2 TB/s of copy bandwidth:
too few output tiles to keep every SM streaming. Here the K dimension is cut into S slices, so a
product of few output tiles still runs as many programs as the chip has SMs, each streaming its own
[BLOCK_N, K/S] block of the weight. Every program writes its float32 partial tile to a workspace and
increments the tile's counter; the program that arrives last sums the S partials **in slice order**
(so the result does not depend on which program finishes first: replays are bitwise reproducible),
applies the epilogue and resets the counter for the next call.

Epilogues: the bias (added in float32 before the single rounding, as cuBLAS's bias epilogue does), or,
for the MLP's concatenated [W_gate; W_up] weight, SiLU(x·W_gateᵀ) · (x·W_upᵀ) with the rounding of
transformers' eager MLP (gate and up rounded to the output dtype, SiLU rounded, then the product
rounded), so the [M, 2·I] gate/up tensor and the separate SiLU kernel disappear.

tests/rollout checks every path against float64 products through Triton's interpreter on the CPU and,
on CUDA, at the 3B shapes; scripts/linear_sweep.py times them against cuBLAS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rollplex.rollout.decode_kernel import _jit, triton

if triton is not None:
    import triton.language as tl
else:  # pragma: no cover - exercised only on installs without Triton
    tl = None


@dataclass(frozen=True)
class LinearLaunch:
    """Launch settings of one product: output features per program (a power of two >= 16), K per inner
    iteration (a power of two >= 16), K-slices (>= 1), warps (a power of two) and pipeline stages."""

    block_n: int = 64
    block_k: int = 128
    splits: int = 4
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        pow2 = lambda v, least: isinstance(v, int) and v >= least and v & (v - 1) == 0  # noqa: E731
        if not (pow2(self.block_n, 16) and pow2(self.block_k, 16) and pow2(self.num_warps, 1)):
            raise ValueError(
                f"linear launch needs block_n, block_k powers of two >= 16 and warps a power of two: {self}"
            )
        if not all(isinstance(v, int) and v >= 1 for v in (self.splits, self.num_stages)):
            raise ValueError(f"linear launch needs splits and stages >= 1: {self}")


@_jit
def _epilogue(acc, acc_up, bias, out, rm, rn, M, N, stride_om, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """Bias or SiLU gate on the sums (in their accumulation dtype), one rounding to out's dtype per step
    of the reference."""
    dtype = out.dtype.element_ty
    wide = acc.dtype
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(wide)[None, :]
    if GATED:
        gate = acc.to(dtype).to(wide)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(wide)
        acc = silu * acc_up.to(dtype).to(wide)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(out + rm[:, None] * stride_om + rn[None, :], acc.to(dtype), mask=mask)


@_jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a·bᵀ; IEEE: full float32 products (Triton's default for float32 operands is tf32)."""
    if IEEE:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


@_jit
def _linear(
    x, w, bias, out, partials, counters, M, N, K, k_slice, up_offset, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLITS: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program (n tile, K-slice, m tile): x[m tile, slice] · w[n tile, slice]ᵀ (and, GATED, the up rows
    w[N + n tile]), then the split-K reduction by the last arriving slice and the epilogue."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    lo = pid_s * k_slice
    hi = tl.minimum(lo + k_slice, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    x_rows = x + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w + rn.to(tl.int64)[:, None] * stride_wn
    up_rows = w_rows + up_offset
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + rk
        k_ok = (k < hi)[None, :]
        xk = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        wk = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        acc = _dot(xk, wk, acc, IEEE)
        if GATED:
            uk = tl.load(up_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
            acc_up = _dot(xk, uk, acc_up, IEEE)
    if SPLITS == 1:
        _epilogue(acc, acc_up, bias, out, rm, rn, M, N, stride_om, HAS_BIAS, GATED)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        parts = 2 if GATED else 1
        at = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        slot = partials + tile.to(tl.int64) * (SPLITS * parts * BLOCK_M * BLOCK_N)
        tl.store(slot + pid_s * (parts * BLOCK_M * BLOCK_N) + at, acc)
        if GATED:
            tl.store(slot + pid_s * (parts * BLOCK_M * BLOCK_N) + BLOCK_M * BLOCK_N + at, acc_up)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        arrived = tl.atomic_add(counters + tile, 1, sem="acq_rel")
        if arrived == SPLITS - 1:  # the last slice of this tile to finish sums all of them, in order
            acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), ACC)
            for s in range(SPLITS):
                part = slot + s * (parts * BLOCK_M * BLOCK_N) + at
                acc += tl.load(part, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part + BLOCK_M * BLOCK_N, cache_modifier=".cg")
            tl.atomic_xchg(counters + tile, 0)
            _epilogue(acc, acc_up, bias, out, rm, rn, M, N, stride_om, HAS_BIAS, GATED)


class LinearWorkspace:
    """Partial tiles (in the accumulation dtype, ``accumulation_dtype``) and int32 per-tile counters (zero between calls) of the split-K reduction,
    grown on demand and reused by every product issued on one stream: the products run one after
    another, and each leaves its counters at zero. Allocate it before capturing a CUDA graph that uses
    it (``reserve``), so the graph reads memory that outlives it."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32):
        self.device, self.dtype = torch.device(device), dtype
        self.partials = torch.empty(0, device=self.device, dtype=dtype)
        self.counters = torch.zeros(0, device=self.device, dtype=torch.int32)

    def reserve(self, partial_floats: int, tiles: int) -> None:
        """Grow to at least ``partial_floats`` partials and ``tiles`` counters (counters zeroed).
        Must not run during a capture (it allocates)."""
        if self.partials.numel() < partial_floats:
            self.partials = torch.empty(partial_floats, device=self.device, dtype=self.dtype)
        if self.counters.numel() < tiles:
            self.counters = torch.zeros(tiles, device=self.device, dtype=torch.int32)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums and split-K partials are float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grid(m: int, n: int, k: int, launch: LinearLaunch) -> tuple[int, int, int, int, int]:
    """(n tiles, slices, m tiles, K per slice, BLOCK_M) of a product: the K-slices are whole multiples of
    block_k, so every slice but the last is full (a launch with more slices than K blocks uses fewer)."""
    block_m = max(16, min(64, 1 << (m - 1).bit_length()))
    blocks = math.ceil(k / launch.block_k)
    splits = min(launch.splits, blocks)
    k_slice = math.ceil(blocks / splits) * launch.block_k
    splits = math.ceil(k / k_slice)
    return math.ceil(n / launch.block_n), splits, math.ceil(m / block_m), k_slice, block_m


def workspace_size(m: int, n: int, k: int, launch: LinearLaunch, gated: bool = False) -> tuple[int, int]:
    """(partials, counters) a product needs in a ``LinearWorkspace``."""
    n_tiles, splits, m_tiles, _, block_m = _grid(m, n, k, launch)
    if splits == 1:
        return 0, 0
    tiles = n_tiles * m_tiles
    return tiles * splits * (2 if gated else 1) * block_m * launch.block_n, tiles


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gated: bool = False,
    launch: LinearLaunch = LinearLaunch(),
    workspace: LinearWorkspace | None = None,
) -> torch.Tensor:
    """x · weightᵀ (+ bias), or with ``gated`` the SiLU-gated product of a concatenated [W_gate; W_up].

    Args:
        x: [M, K] with a contiguous last dim. weight: [N, K] (gated: [2·I, K], gate rows first), last
            dim contiguous, x's dtype and device. bias: [N] or None (not with ``gated``).
        launch: tile sizes, K-slices, warps and stages (``LinearLaunch``; any setting is exact, the
            reduction order fixed by it). workspace: where the split-K partials go; required when the
            launch splits K, and sized beforehand (``workspace_size``) when the call is captured.

    Returns:
        [M, N] (gated: [M, I] = SiLU(x·W_gateᵀ)·(x·W_upᵀ)) in x's dtype; products accumulated in
        ``accumulation_dtype`` (float32 operands multiplied in full float32, not tf32), rounded once (gated: as transformers' eager MLP
        rounds, see the module docstring).

    Raises:
        ValueError: mismatched shapes, dtypes, devices or strides, a bias with ``gated``, a split launch
            without a large enough workspace.
        ImportError: Triton is not installed.
    """
    if triton is None:
        raise ImportError("the decode products need Triton (installed with the CUDA builds of torch)")
    _check(x, weight, bias, gated)
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    n_tiles, splits, m_tiles, k_slice, block_m = _grid(m, n, k, launch)
    partials, counters = x, x  # unread without a split
    if splits > 1:
        floats, tiles = workspace_size(m, n, k, launch, gated)
        acc = accumulation_dtype(x.dtype)
        if (
            workspace is None
            or workspace.partials.numel() < floats
            or workspace.counters.numel() < tiles
            or workspace.partials.dtype != acc
            or workspace.partials.device != x.device
        ):
            raise ValueError(
                f"a split-K decode product needs a workspace on {x.device} of {floats} {acc} partials and "
                f"{tiles} counters"
            )
        partials, counters = workspace.partials, workspace.counters
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _linear[(n_tiles, splits, m_tiles)](
        x, weight, bias if bias is not None else x, out, partials, counters, m, n, k, k_slice, n * weight.stride(0),
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, SPLITS=splits,
        ACC=tl.float64 if x.dtype == torch.float64 else tl.float32, IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> None:
    """Shapes, dtypes, devices and strides ``decode_linear`` assumes (metadata only: safe under capture)."""
    problems = []
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        problems.append(f"x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if gated and (weight.shape[0] % 2 or bias is not None):
        problems.append("gated: a weight of even height [2·I, K] and no bias")
    if bias is not None and bias.shape != (weight.shape[0],):
        problems.append(f"bias [N] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    tensors = [t for t in (x, weight, bias) if t is not None]
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors):
        problems.append(f"every tensor in x's dtype {x.dtype} on {x.device}")
    if any(t.stride(-1) != 1 for t in tensors):
        problems.append("a contiguous last dimension")
    if problems:
        raise ValueError("decode product needs " + "; ".join(problems))
