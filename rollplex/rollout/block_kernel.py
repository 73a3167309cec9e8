"""The post-attention half of a decoder layer in one Triton launch, for the decode step.

Legend: M rows (the decode batch, B = G·N), Hd hidden size, I intermediate size.

After the attention, a Qwen2.5-VL decoder layer computes

    h1  = hidden + attention·W_oᵀ                         (o projection, residual)
    x   = RMSNorm(h1) · w_post                              (post-attention norm)
    act = SiLU(x·W_gateᵀ) · (x·W_upᵀ)                       (gated MLP)
    out = h1 + act·W_downᵀ                                  (down projection, residual)

As separate kernels that is a cuBLAS o product, a norm kernel, the gated gate/up kernel
(rollout.linear_kernel), cuBLAS's split-K down product and its reduction: five launches per layer,
each with its own ramp-up and tail, and the small o product bound by its latency, not its bytes
(docs/benchmarks.md, the decode sections). Here one launch runs three kinds of work items:

- o items, one per BLOCK_O output features: h1 for those features, and their partial sums of squares
  per row;
- gate/up items, one per BLOCK_G intermediate features: wait for every o item, form 1/rms per row from
  the partial sums, normalise h1 block by block as they stream it, and write the gated activations;
- down items, one per (BLOCK_D output features, K split of the intermediate features): wait for the
  gate/up items of their split, write a float32 partial; the last item of an output tile to arrive
  sums the tile's partials in split order, rounds, and adds the residual.

**No grid-wide barrier.** Each program takes a ticket from a counter as it starts, and the ticket, not
the program id, picks its work item: items are numbered in dependency order (o, then gate/up, then
down), so a program waits only on tickets taken before its own, by programs already running. Nothing
requires every program of the launch to be resident at once, so the launch cannot hang when another
stream holds part of the GPU (the Rollplex schedule co-runs prefix kernels with decode, Phase 1). The
last down item resets the counters, so the next launch finds them at zero. Producers publish with a
block barrier and a release increment; consumers spin on a volatile load, then acquire, and read what
other programs wrote through L2 (``.cg``).

**Rounding.** Where transformers' eager layer rounds: the o product, the residual sums, the normalised
hidden (before its weight), the gate and up products, SiLU, their product and the down product are
each rounded to the model's dtype once; sums are float32 (float64 for float64 inputs). The sums' order
differs from cuBLAS's and from torch's mean, and SiLU and 1/rms go through Triton's approximate
instructions on NVIDIA GPUs: within float32 rounding of the separate kernels, not bitwise. Summation
order is fixed (partials in split order), so the result is deterministic from launch to launch.

tests/rollout checks the kernel against float64 layers rounded where transformers rounds, through
Triton's interpreter on the CPU and in bf16 at the 3B shape on CUDA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rollplex.rollout.decode_kernel import _jit, _pow2, is_pow2, triton
from rollplex.rollout.linear_kernel import _dot

if triton is not None:
    import triton.language as tl
else:  # pragma: no cover - exercised only on installs without Triton
    tl = None

MAX_ROWS = 64  # one row tile: every item streams its weights once for all rows

# counters (int32): ticket, o items done, gate/up items done per K split, down arrivals per output tile,
# output tiles finished
_TICKET, _O_DONE, _G_DONE = 0, 1, 2
if tl is not None:  # globals a kernel reads must be Triton constexprs
    _TICKET, _O_DONE, _G_DONE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@dataclass(frozen=True)
class BlockLaunch:
    """Launch settings: output features per o / gate-up / down item, K per inner iteration (powers of
    two >= 16), K splits of the down product (>= 1), warps (a power of two) and pipeline stages (>= 1).
    Any setting is exact."""

    block_o: int = 32
    block_g: int = 32
    block_d: int = 64
    block_k: int = 64
    down_splits: int = 8
    num_warps: int = 4
    num_stages: int = 4
    backoff: bool = False  # sleep ~100 ns between polls of a counter (CUDA only)
    prefetch: bool = False  # waiting items ask L2 for their weights (CUDA only)

    def __post_init__(self) -> None:
        blocks = (self.block_o, self.block_g, self.block_d, self.block_k)
        ok = all(is_pow2(b, 16) for b in blocks) and is_pow2(self.num_warps)
        ints = all(isinstance(v, int) and v >= 1 for v in (self.down_splits, self.num_stages))
        if not ok or not ints:
            raise ValueError(
                "block launch needs block sizes powers of two >= 16, warps a power of two, down_splits "
                f"and stages >= 1: {self}"
            )


def counters_for(hidden_size: int, launch: BlockLaunch = BlockLaunch(), device=None) -> torch.Tensor:
    """The zeroed int32 counters one caller passes to every ``post_attention`` launch on one stream
    (each launch leaves them at zero; two launches running at once need two)."""
    return torch.zeros(_counter_count(hidden_size, launch), dtype=torch.int32, device=device)


def _counter_count(hidden_size: int, launch: BlockLaunch) -> int:
    return int(_G_DONE) + launch.down_splits + math.ceil(hidden_size / launch.block_d) + 1


@_jit
def _wait(counter, target, SLEEP: tl.constexpr):
    """Spin until the int32 at ``counter`` reaches ``target``, then acquire: the loads that follow see
    every store the producers made before their release. SLEEP: back off ~100 ns between polls."""
    seen = tl.load(counter, volatile=True)
    while seen < target:
        if SLEEP:
            seen = tl.inline_asm_elementwise(
                "nanosleep.u32 100;\n mov.u32 $0, $1;", "=r,r", [seen], dtype=tl.int32, is_pure=False, pack=1
            )
        seen = tl.load(counter, volatile=True)
    tl.atomic_add(counter, 0, sem="acquire")


@_jit
def _prefetch(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs`` (no data returned to the program)."""
    return tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@_jit
def _signal(counter):
    """Release this program's stores: every thread's stores first (block barrier), then the increment;
    returns the count before it."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel")


@_jit
def _zeros(BM: tl.constexpr, BN: tl.constexpr, F64: tl.constexpr):
    if F64:  # a compile-time branch: float64 inputs sum in float64, the rest in float32
        return tl.zeros((BM, BN), tl.float64)
    return tl.zeros((BM, BN), tl.float32)


@_jit
def _o_item(
    i, attn, hidden, wo, h1, sq, counters, M, HD, s_attn, s_hidden, s_wo, s_h1,
    F64: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """h1[:, tile] = hidden + attention·W_o[tile]ᵀ (each rounded), and sq[i, row] = Σ h1[row, tile]²."""
    rm, rn, rk = tl.arange(0, BM), i * BO + tl.arange(0, BO), tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < HD
    acc = _zeros(BM, BO, F64)
    a_rows, w_rows = attn + rm.to(tl.int64)[:, None] * s_attn, wo + rn.to(tl.int64)[:, None] * s_wo
    for k0 in range(0, HD, BK):
        k = k0 + rk
        k_ok = (k < HD)[None, :]
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        acc = _dot(a, tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0), acc, IEEE)
    dtype = h1.dtype.element_ty
    wide = acc.dtype
    tile = m_ok[:, None] & n_ok[None, :]
    res = tl.load(hidden + rm.to(tl.int64)[:, None] * s_hidden + rn[None, :], mask=tile, other=0.0)
    h = (res.to(wide) + acc.to(dtype).to(wide)).to(dtype)
    tl.store(h1 + rm.to(tl.int64)[:, None] * s_h1 + rn[None, :], h, mask=tile)
    hw = h.to(wide)
    tl.store(sq + i * BM + rm, tl.sum(hw * hw, 1), mask=m_ok)
    _signal(counters + _O_DONE)


@_jit
def _g_item(
    j, h1, sq, ln, wgu, act, counters, M, HD, INTER, up_offset, eps, n_o, ksplit, s_h1, s_w, s_act,
    F64: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr, BK: tl.constexpr,
    NO: tl.constexpr, SLEEP: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """act[:, tile] = SiLU(x·W_gate[tile]ᵀ)·(x·W_up[tile]ᵀ), x = RMSNorm(h1)·w_post, once every o item is
    done; then counts itself done for its K split of the down product."""
    if PREFETCH:  # the first half of the item's gate and up rows, into L2 while the o items run
        lines = wgu + tl.minimum(j * BG + tl.arange(0, BG), INTER - 1).to(tl.int64)[:, None] * s_w
        lines += tl.arange(0, 16)[None, :] * (HD // 32)
        _prefetch(lines)
        _prefetch(lines + up_offset)
    _wait(counters + _O_DONE, n_o, SLEEP)
    rm, rn, rk = tl.arange(0, BM), j * BG + tl.arange(0, BG), tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < INTER
    io = tl.arange(0, NO)
    parts = tl.load(
        sq + io[:, None] * BM + rm[None, :],
        mask=(io < n_o)[:, None] & m_ok[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    total = tl.sum(parts, 0)
    rstd = 1.0 / tl.sqrt(total / HD + eps)
    gate = _zeros(BM, BG, F64)
    up = gate
    dtype = h1.dtype.element_ty
    x_rows = h1 + rm.to(tl.int64)[:, None] * s_h1
    gate_rows = wgu + rn.to(tl.int64)[:, None] * s_w
    up_rows = gate_rows + up_offset
    for k0 in range(0, HD, BK):
        k = k0 + rk
        k_ok = (k < HD)[None, :]
        xk = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0, cache_modifier=".cg")
        w_ln = tl.load(ln + k, mask=k < HD, other=0.0)
        xn = (xk.to(rstd.dtype) * rstd[:, None]).to(dtype) * w_ln[None, :]
        gate = _dot(xn, tl.load(gate_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0), gate, IEEE)
        up = _dot(xn, tl.load(up_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0), up, IEEE)
    wide = gate.dtype
    gate = gate.to(dtype).to(wide)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(wide)
    result = (silu * up.to(dtype).to(wide)).to(dtype)
    tile = m_ok[:, None] & n_ok[None, :]
    tl.store(act + rm.to(tl.int64)[:, None] * s_act + rn[None, :], result, mask=tile)
    _signal(counters + _G_DONE + (j * BG) // ksplit)


@_jit
def _d_item(
    e, act, wd, h1, part, out, counters, n_counters, M, HD, INTER, ksplit, n_tiles, s_act, s_wd, s_h1, s_out,
    F64: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr,
    BK: tl.constexpr, KS: tl.constexpr, N_COUNTERS: tl.constexpr, SLEEP: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """The float32 partial act[:, split]·W_down[tile, split]ᵀ, once the split's gate/up items are done;
    the tile's last item to arrive writes out[:, tile] = h1 + Σ_split partial (rounded), and the last
    tile resets the counters."""
    split, t = e // n_tiles, e % n_tiles
    lo = split * ksplit
    width = tl.minimum(ksplit, INTER - lo)
    if PREFETCH:  # the item's down weights, into L2 while the gate/up items run
        rows = tl.minimum(t * BD + tl.arange(0, BD), HD - 1).to(tl.int64)
        cols = lo + tl.minimum(tl.arange(0, 32) * (ksplit // 32), width - 1)
        _prefetch(wd + rows[:, None] * s_wd + cols[None, :])
    _wait(counters + _G_DONE + split, (width + BG - 1) // BG, SLEEP)
    rm, rn, rk = tl.arange(0, BM), t * BD + tl.arange(0, BD), tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < HD
    acc = _zeros(BM, BD, F64)
    a_rows, w_rows = act + rm.to(tl.int64)[:, None] * s_act, wd + rn.to(tl.int64)[:, None] * s_wd
    for k0 in range(0, ksplit, BK):
        k = lo + k0 + rk
        k_ok = (k0 + rk < width)[None, :]
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0, cache_modifier=".cg")
        acc = _dot(a, tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0), acc, IEEE)
    cells = rm.to(tl.int64)[:, None] * HD + rn[None, :]
    tile = m_ok[:, None] & n_ok[None, :]
    tl.store(part + split * (BM * HD) + cells, acc, mask=tile)
    arrived = _signal(counters + _G_DONE + KS + t)
    if arrived == KS - 1:
        total = _zeros(BM, BD, F64)
        for s in tl.static_range(KS):
            total += tl.load(part + s * (BM * HD) + cells, mask=tile, other=0.0, cache_modifier=".cg")
        dtype = out.dtype.element_ty
        wide = total.dtype
        res = tl.load(
            h1 + rm.to(tl.int64)[:, None] * s_h1 + rn[None, :], mask=tile, other=0.0, cache_modifier=".cg"
        )
        result = (res.to(wide) + total.to(dtype).to(wide)).to(dtype)
        tl.store(out + rm.to(tl.int64)[:, None] * s_out + rn[None, :], result, mask=tile)
        finished = _signal(counters + _G_DONE + KS + n_tiles)
        if finished == n_tiles - 1:  # every item of the launch is past its last wait: reset
            c = tl.arange(0, N_COUNTERS)
            tl.store(counters + c, tl.zeros((N_COUNTERS,), tl.int32), mask=c < n_counters)


@_jit
def _block(
    attn, hidden, wo, ln, wgu, wd, h1, sq, act, part, out, counters, n_counters, times,
    M, HD, INTER, up_offset, eps, n_o, n_g, ksplit, n_tiles,
    s_attn, s_hidden, s_wo, s_w, s_wd, s_h1, s_act, s_out,
    F64: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BO: tl.constexpr, BG: tl.constexpr,
    BD: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, NO: tl.constexpr, N_COUNTERS: tl.constexpr,
    TIMES: tl.constexpr, SLEEP: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """One program: take a ticket, run the work item it names (o, gate/up, then down items). With
    TIMES, the GPU's global timer (ns) as the item starts and ends goes to times[ticket, 0:2]."""
    ticket = tl.atomic_add(counters + _TICKET, 1, sem="relaxed")
    if TIMES:
        tl.store(times + 2 * ticket, _now(ticket))
    if ticket < n_o:
        _o_item(
            ticket, attn, hidden, wo, h1, sq, counters, M, HD, s_attn, s_hidden, s_wo, s_h1,
            F64, IEEE, BM, BO, BK,
        )  # fmt: skip
    elif ticket < n_o + n_g:
        _g_item(
            ticket - n_o, h1, sq, ln, wgu, act, counters, M, HD, INTER, up_offset, eps, n_o, ksplit,
            s_h1, s_w, s_act, F64, IEEE, BM, BG, BK, NO, SLEEP, PREFETCH,
        )  # fmt: skip
    else:
        _d_item(
            ticket - n_o - n_g, act, wd, h1, part, out, counters, n_counters, M, HD, INTER, ksplit, n_tiles,
            s_act, s_wd, s_h1, s_out, F64, IEEE, BM, BG, BD, BK, KS, N_COUNTERS, SLEEP, PREFETCH,
        )  # fmt: skip
    if TIMES:
        tl.store(times + 2 * ticket + 1, _now(ticket))


@_jit
def _now(like):
    """The GPU's global timer in ns (int64; ``like`` only gives the asm an operand)."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64, is_pure=False, pack=1
    )


def post_attention(
    hidden: torch.Tensor,
    attention: torch.Tensor,
    w_o: torch.Tensor,
    w_post: torch.Tensor,
    gate_up: torch.Tensor,
    w_down: torch.Tensor,
    eps: float,
    counters: torch.Tensor,
    launch: BlockLaunch = BlockLaunch(),
    times: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder layer after its attention, one launch: o projection, residual, post-attention
    RMSNorm, SiLU-gated MLP, residual (module docstring).

    Args:
        hidden: [M, Hd], the layer's input (the first residual), M <= MAX_ROWS. attention: [M, Hd] (the
            attention output, H·D = Hd). w_o: [Hd, Hd]. w_post: [Hd], the post-attention norm's weight.
            gate_up: [2·I, Hd], W_gate rows then W_up rows. w_down: [Hd, I]. All in one dtype on one
            device, last dims contiguous. eps: the norm's epsilon.
        counters: ``counters_for(Hd, launch)``, zeroed, used by one launch at a time (left zeroed).
        launch: ``BlockLaunch`` (float64 inputs run at most two of its pipeline stages).

    Returns:
        [M, Hd] in hidden's dtype: the layer's output hidden state.

    Raises:
        ValueError: more than MAX_ROWS rows, mismatched shapes, dtypes or devices, a non-contiguous last
            dim, or counters of the wrong size or dtype.
        ImportError: Triton is not installed.
    """
    if triton is None:
        raise ImportError(
            "the post-attention block kernel needs Triton (installed with the CUDA builds of torch)"
        )
    _check(hidden, attention, w_o, w_post, gate_up, w_down, counters, launch)
    m, hd = hidden.shape
    inter = w_down.shape[1]
    bm = _pow2(m)
    n_o, n_g, n_tiles = (
        math.ceil(hd / launch.block_o),
        math.ceil(inter / launch.block_g),
        math.ceil(hd / launch.block_d),
    )
    align = max(launch.block_g, launch.block_k)
    ksplit = math.ceil(math.ceil(inter / launch.down_splits) / align) * align
    splits = math.ceil(inter / ksplit)
    dev, dtype = hidden.device, hidden.dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    h1 = torch.empty(m, hd, device=dev, dtype=dtype)
    sq = torch.empty(n_o, bm, device=dev, dtype=wide)
    act = torch.empty(m, inter, device=dev, dtype=dtype)
    part = torch.empty(splits, bm, hd, device=dev, dtype=wide)
    out = torch.empty(m, hd, device=dev, dtype=dtype)
    stages = min(launch.num_stages, 2) if dtype == torch.float64 else launch.num_stages
    _block[(n_o + n_g + splits * n_tiles,)](
        attention, hidden, w_o, w_post, gate_up, w_down, h1, sq, act, part, out, counters, counters.numel(),
        times if times is not None else counters,
        m, hd, inter, inter * gate_up.stride(0), eps, n_o, n_g, ksplit, n_tiles,
        attention.stride(0), hidden.stride(0), w_o.stride(0), gate_up.stride(0), w_down.stride(0),
        h1.stride(0), act.stride(0), out.stride(0),
        F64=dtype == torch.float64, IEEE=dtype == torch.float32, BM=bm, BO=launch.block_o, BG=launch.block_g,
        BD=launch.block_d, BK=launch.block_k, KS=splits, NO=_pow2(n_o, 2), N_COUNTERS=_pow2(counters.numel(), 2), TIMES=times is not None, SLEEP=launch.backoff, PREFETCH=launch.prefetch,
        num_warps=launch.num_warps, num_stages=stages,
    )  # fmt: skip
    return out


def _check(hidden, attention, w_o, w_post, gate_up, w_down, counters, launch: BlockLaunch) -> None:
    """Shapes, dtypes, devices and strides ``post_attention`` assumes (metadata only: safe under capture)."""
    problems = []
    m, hd = hidden.shape if hidden.dim() == 2 else (0, 0)
    inter = w_down.shape[1] if w_down.dim() == 2 else 0
    if hidden.dim() != 2 or not 1 <= m <= MAX_ROWS:
        problems.append(f"hidden [M, Hd] with 1 <= M <= {MAX_ROWS}, got {tuple(hidden.shape)}")
    shapes = {
        "attention": (attention, (m, hd)),
        "w_o": (w_o, (hd, hd)),
        "w_post": (w_post, (hd,)),
        "gate_up": (gate_up, (2 * inter, hd)),
        "w_down": (w_down, (hd, inter)),
    }
    for name, (t, want) in shapes.items():
        if tuple(t.shape) != want:
            problems.append(f"{name} of shape {want}, got {tuple(t.shape)}")
    tensors = [hidden, *(t for t, _ in shapes.values())]
    if any(t.dtype != hidden.dtype or t.device != hidden.device for t in tensors):
        problems.append(f"every tensor in hidden's dtype {hidden.dtype} on {hidden.device}")
    if any(t.stride(-1) != 1 for t in tensors):
        problems.append("a contiguous last dimension")
    want = _counter_count(hd, launch)
    if counters.dtype != torch.int32 or counters.shape != (want,) or counters.device != hidden.device:
        problems.append(f"counters int32 [{want}] on {hidden.device} (counters_for)")
    if problems:
        raise ValueError("post-attention block kernel needs " + "; ".join(problems))
