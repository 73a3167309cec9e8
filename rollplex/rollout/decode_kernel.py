"""Fused shared-prefix decode attention in Triton (split-K over the boundary KV, scores kept on chip).

Legend: G groups, N group size, B = G·N rows, H query heads, Hkv key/value heads, rep = H / Hkv,
D head dim, P padded prompt length, L own-key window.

The dense decode attention (rollout.decode.decode_attention) writes float32 score tensors
[B, Hkv, rep, P + L] to memory and reads them back several times per layer, passes that take most
of the captured dense step's device time (benchmarks/README.md). Here, as in flash-decoding, each program
streams one chunk of keys through an online softmax and writes only a partial result (running max m,
normaliser l, unnormalised output acc) per query; a merge kernel combines the partials:

    out = Σ_s exp(m_s − M) acc_s / Σ_s exp(m_s − M) l_s,   M = max_s m_s

One launch runs two kinds of programs. Prefix programs, one per (group, kv head, chunk of the boundary
KV): the N·rep queries of the group that share a kv head are one [N·rep, D] block against each key
block, so every boundary key is loaded once per group (prefix sharing) and the products run on tensor
cores. Own-key programs, one per (row, kv head, chunk of the own-key window): the row's rep queries
against its own keys 0..step (the step is read on the device, so the kernels can be captured in a
CUDA graph and read no unwritten cache slot; chunks past the step store empty partials). The own-key
program whose chunk holds the step first writes the step's key and value into the cache, so the step
needs no separate cache write. Given the rotary tables, every program applies RoPE to the queries it
loads, and the cache write to the step's key, so the step needs no RoPE kernel either.

The CUDA default (``rollout.decode_attention: auto``); the decode step's time with it and with the
dense attention is in benchmarks/README.md. tests/rollout checks it against the dense path through
Triton's interpreter on the CPU and, on CUDA, in bf16 at the 3B shape against float64.
"""

from __future__ import annotations

import math

import torch

try:  # Triton ships with the CUDA builds of torch; the CPU builds lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without Triton
    triton = tl = None

PREFIX_CHUNK = 512  # boundary keys per prefix program
OWN_CHUNK = 512  # own keys per own-key program (both chunk sizes from a tuning sweep: benchmarks/README.md)
BLOCK_KEYS = 64  # keys per inner iteration
NUM_WARPS, NUM_STAGES = 4, 3  # the partials launch (Triton's defaults, kept by the same sweep)
MERGE_WARPS = 1  # the merge launch, one (row, head) per program (from the same sweep)


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernels can run here for these head counts: Triton imported, H a multiple of Hkv, and
    D a power of two >= 16 (Triton block sizes)."""
    return triton is not None and heads % kv_heads == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _jit(fn):
    """``triton.jit`` where Triton is installed (its interpreter on the CPU under ``TRITON_INTERPRET=1``,
    which must be set before this module is imported); the plain function otherwise."""
    return triton.jit(fn) if triton is not None else fn


@_jit
def _online_block(qb, k_base, v_base, sk, sv, j, hi, d, m, s_sum, acc, scale):
    """One block of keys j (< hi valid) through the online softmax of queries qb [NQ, D]; returns the
    updated running max m, normaliser s_sum and unnormalised output acc (float32)."""
    valid = j < hi
    kb = tl.load(k_base + j[None, :] * sk + d[:, None], mask=valid[None, :], other=0.0)
    scores = tl.where(valid[None, :], tl.dot(qb, kb).to(tl.float32) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    vb = tl.load(v_base + j[:, None] * sv + d[None, :], mask=valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb).to(tl.float32)
    return m_new, s_sum * alpha + tl.sum(p, 1), acc


@_jit
def _attend_range(
    qb, k_base, v_base, sk, sv, lo, hi, d, scale, NQ: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr
):
    """Online softmax of queries qb [NQ, D] over keys lo..hi-1 (an empty range gives m = -inf, l = 0,
    acc = 0); returns (m, l, acc) in float32."""
    m = tl.full((NQ,), float("-inf"), tl.float32)
    s_sum = tl.zeros((NQ,), tl.float32)
    acc = tl.zeros((NQ, D), tl.float32)
    for start in range(lo, hi, BLOCK):
        j = start + tl.arange(0, BLOCK)
        m, s_sum, acc = _online_block(qb, k_base, v_base, sk, sv, j, hi, d, m, s_sum, acc, scale)
    return m, s_sum, acc


@_jit
def _load_rotated(x, x_at, cs_at, cos, sin, d, mask, D: tl.constexpr, ROPE: tl.constexpr):
    """Vectors x[x_at + d] (d along the last axis of the offsets), rotated by the rotary embedding when
    ROPE: x·cos + rotate_half(x)·sin with cos/sin[cs_at + d], computed in float32 (float64 for float64
    x) and rounded once to x's dtype, as torch.compile computes RoPE; masked-off lanes load 0."""
    v = tl.load(x + x_at + d, mask=mask, other=0.0)
    if ROPE:
        half = D // 2
        partner = tl.load(x + x_at + (d + half) % D, mask=mask, other=0.0)
        c = tl.load(cos + cs_at + d, mask=mask, other=0.0)
        s = tl.load(sin + cs_at + d, mask=mask, other=0.0)
        wide = v
        if v.dtype != tl.float64:  # a compile-time branch: lower precisions rotate in float32
            wide, partner, c, s = v.to(tl.float32), partner.to(tl.float32), c.to(tl.float32), s.to(tl.float32)
        v = (wide * c + tl.where(d < half, -partner, partner) * s).to(v.dtype)
    return v


@_jit
def _store(m_out, l_out, acc_out, at, acc_at, d, m, s_sum, acc, valid_q):
    tl.store(m_out + at, m, mask=valid_q)
    tl.store(l_out + at, s_sum, mask=valid_q)
    tl.store(acc_out + acc_at[:, None] + d[None, :], acc, mask=valid_q[:, None])


@_jit
def _prefix_program(
    pid, q, cos, sin, pk, pv, lens, m_out, l_out, acc_out,
    sq_b, sq_h, scs_b, spk_g, spk_h, spk_p, spv_g, spv_h, spv_p,
    so_s, so_b, so_h, sa_s, sa_b, sa_h,
    splits, scale, N: tl.constexpr, REP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    NQ: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    """Program (group·Hkv + kv head)·splits + chunk: the group's N·rep queries of one kv head against
    one chunk of its boundary keys."""
    gk, split = pid // splits, pid % splits
    g, k = gk // HKV, gk % HKV
    iq, d = tl.arange(0, NQ), tl.arange(0, D)
    valid_q = iq < N * REP
    b, h = g * N + iq // REP, k * REP + iq % REP
    q_at, cs_at = b[:, None] * sq_b + h[:, None] * sq_h, b[:, None] * scs_b
    qb = _load_rotated(q, q_at, cs_at, cos, sin, d[None, :], valid_q[:, None], D, ROPE)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, tl.load(lens + g))
    k_base, v_base = pk + g * spk_g + k * spk_h, pv + g * spv_g + k * spv_h
    m, s_sum, acc = _attend_range(qb, k_base, v_base, spk_p, spv_p, lo, hi, d, scale, NQ, D, BLOCK)
    at = split * so_s + b * so_b + h * so_h
    _store(m_out, l_out, acc_out, at, split * sa_s + b * sa_b + h * sa_h, d, m, s_sum, acc, valid_q)


@_jit
def _own_program(
    pid, q, cos, sin, ok, ov, nk, nv, step, m_out, l_out, acc_out,
    sq_b, sq_h, scs_b, sok_b, sok_h, sok_l, sov_b, sov_h, sov_l, snk_b, snk_h, snv_b, snv_h,
    so_s, so_b, so_h, sa_s, sa_b, sa_h,
    first_split, own_chunks, scale, REP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    NQ: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    """Program (row·Hkv + kv head)·own_chunks + chunk: the row's rep queries of one kv head against one
    chunk of its own keys 0..step (a chunk past the step stores an empty partial). The program whose
    chunk holds the step first writes the step's key and value (nk, nv) into the cache slot."""
    bk, chunk = pid // own_chunks, pid % own_chunks
    b, k = bk // HKV, bk % HKV
    split = first_split + chunk
    iq, d = tl.arange(0, NQ), tl.arange(0, D)
    valid_q = iq < REP
    h = k * REP + iq
    qb = _load_rotated(
        q, b * sq_b + h[:, None] * sq_h, b * scs_b, cos, sin, d[None, :], valid_q[:, None], D, ROPE
    )
    lo, now = chunk * CHUNK, tl.load(step)
    k_base, v_base = ok + b * sok_b + k * sok_h, ov + b * sov_b + k * sov_h
    if (now >= lo) & (now < lo + CHUNK):
        new_k = _load_rotated(nk, b * snk_b + k * snk_h, b * scs_b, cos, sin, d, d < D, D, ROPE)
        tl.store(k_base + now * sok_l + d, new_k)
        tl.store(v_base + now * sov_l + d, tl.load(nv + b * snv_b + k * snv_h + d))
        tl.debug_barrier()  # the block's own stores are visible to its loads below
    hi = tl.minimum(lo + CHUNK, now + 1)
    m, s_sum, acc = _attend_range(qb, k_base, v_base, sok_l, sov_l, lo, hi, d, scale, NQ, D, BLOCK)
    at = split * so_s + b * so_b + h * so_h
    _store(m_out, l_out, acc_out, at, split * sa_s + b * sa_b + h * sa_h, d, m, s_sum, acc, valid_q)


@_jit
def _partials(
    q, cos, sin, pk, pv, lens, ok, ov, nk, nv, step, m_out, l_out, acc_out,
    sq_b, sq_h, scs_b, spk_g, spk_h, spk_p, spv_g, spv_h, spv_p,
    sok_b, sok_h, sok_l, sov_b, sov_h, sov_l, snk_b, snk_h, snv_b, snv_h,
    so_s, so_b, so_h, sa_s, sa_b, sa_h,
    prefix_programs, splits, own_chunks, scale,
    N: tl.constexpr, REP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NQ_PREFIX: tl.constexpr,
    NQ_OWN: tl.constexpr, PREFIX_CHUNK_: tl.constexpr, OWN_CHUNK_: tl.constexpr, BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
):  # fmt: skip
    """One launch for both kinds of partials: programs 0..prefix_programs-1 are prefix programs, the
    rest own-key programs (so the two bandwidth-bound halves share the device instead of queueing)."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < prefix_programs:
        _prefix_program(
            pid, q, cos, sin, pk, pv, lens, m_out, l_out, acc_out,
            sq_b, sq_h, scs_b, spk_g, spk_h, spk_p, spv_g, spv_h, spv_p,
            so_s, so_b, so_h, sa_s, sa_b, sa_h,
            splits, scale, N, REP, HKV, D, NQ_PREFIX, PREFIX_CHUNK_, BLOCK, ROPE,
        )  # fmt: skip
    else:
        _own_program(
            pid - prefix_programs, q, cos, sin, ok, ov, nk, nv, step, m_out, l_out, acc_out,
            sq_b, sq_h, scs_b, sok_b, sok_h, sok_l, sov_b, sov_h, sov_l, snk_b, snk_h, snv_b, snv_h,
            so_s, so_b, so_h, sa_s, sa_b, sa_h,
            splits, own_chunks, scale, REP, HKV, D, NQ_OWN, OWN_CHUNK_, BLOCK, ROPE,
        )  # fmt: skip


@_jit
def _merge(m, l_, acc, out, splits, so_s, sa_s, D: tl.constexpr, S: tl.constexpr):
    """Program per (row, head): out = Σ_s exp(m_s − M) acc_s / Σ_s exp(m_s − M) l_s, written in the
    output dtype. Partials of (row, head) sit at m[s, bh], acc[s, bh, :] (bh = row·H + head)."""
    bh = tl.program_id(0).to(tl.int64)
    s, d = tl.arange(0, S), tl.arange(0, D)
    valid = s < splits
    ms = tl.load(m + s * so_s + bh, mask=valid, other=float("-inf"))
    weight = tl.where(valid, tl.exp(ms - tl.max(ms, 0)), 0.0)  # own key 0 keeps the max finite
    norm = tl.sum(weight * tl.load(l_ + s * so_s + bh, mask=valid, other=0.0), 0)
    parts = tl.load(acc + s[:, None] * sa_s + bh * D + d[None, :], mask=valid[:, None], other=0.0)
    tl.store(out + bh * D + d, (tl.sum(parts * weight[:, None], 0) / norm).to(out.dtype.element_ty))


def is_pow2(value: object, least: int = 1) -> bool:
    """Whether ``value`` is an int power of two >= ``least`` (the kernels' block sizes and warps)."""
    return isinstance(value, int) and value >= least and value & (value - 1) == 0


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def fused_decode_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_lens: torch.Tensor,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    step: torch.Tensor,
    scaling: float,
    group_size: int,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    prefix_chunk: int = PREFIX_CHUNK,
    own_chunk: int = OWN_CHUNK,
    block_keys: int = BLOCK_KEYS,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    merge_warps: int = MERGE_WARPS,
) -> torch.Tensor:
    """Write the step's key/value into the cache, then attend: one query per row over [its group's
    boundary KV ; its own keys 0..step].

    Args:
        q: [B, H, D] with a contiguous last dim (strided rows and heads are fine, e.g. views of one q/k/v
            product's output), after RoPE unless cos/sin are given. prefix_k/prefix_v: [G, Hkv, P, D]
            (last dim contiguous).
        prefix_lens: int32 [G]; keys at index >= prefix_lens[g] are padding. own_k/own_v: [B, Hkv, L, D]
            views of the cache (last dim contiguous); slot ``step`` is overwritten with new_k/new_v.
        new_k/new_v: [B, Hkv, D] (last dim contiguous), the step's key (after RoPE unless cos/sin are
            given) and value.
        step: int64 [1], own keys 0..step are valid after the write. scaling: softmax scale.
        cos/sin: [B, D] in q's dtype (last dim contiguous), or None: the rotary tables of the rows'
            current positions (rollout.decode.rope_tables), with equal strides. Given, q and new_k come
            before RoPE and the kernel rotates them as it loads them (in float32, float64 for float64
            inputs, rounded once), so the step needs no RoPE kernel; None: q and new_k come rotated.
        group_size: N. prefix_chunk/own_chunk: keys per prefix / own-key program (positive; tuning
            knobs; any size is exact). block_keys (a power of two >= 16), num_warps (a power of two),
            num_stages: keys per inner iteration and the partials launch's warps and pipeline stages;
            merge_warps (a power of two): the merge launch's warps (tuning knobs as well).

    Returns:
        [B, H·D] in the dtype of ``q`` (softmax statistics and accumulation in float32).

    Raises:
        ValueError: H not a multiple of Hkv, D not a power of two ≥ 16 (Triton block sizes), knobs out
            of range, or shapes, strides, dtypes or devices other than the ones above (the message lists
            them).
        ImportError: Triton is not installed.
    """
    b, h, d = q.shape
    g, hkv, p = prefix_k.shape[:3]
    _check_inputs(q, prefix_k, prefix_v, prefix_lens, own_k, own_v, new_k, new_v, step, group_size)
    _check_rope(q, cos, sin)
    knobs = (prefix_chunk, own_chunk, num_warps, num_stages, merge_warps)
    powers = is_pow2(num_warps) and is_pow2(merge_warps)
    if not all(isinstance(c, int) and c >= 1 for c in knobs) or not powers:
        raise ValueError(
            "fused decode attention needs integer chunk sizes, warps and stages >= 1, warps a power of "
            f"two, got {knobs}"
        )
    if not is_pow2(block_keys, 16):
        raise ValueError(f"fused decode attention needs block_keys a power of two >= 16, got {block_keys!r}")
    rep, splits = h // hkv, math.ceil(p / prefix_chunk)
    own_chunks = math.ceil(own_k.shape[2] / own_chunk)
    m = torch.empty(splits + own_chunks, b, h, device=q.device, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(splits + own_chunks, b, h, d, device=q.device, dtype=torch.float32)
    prefix_programs = g * hkv * splits
    rope = cos is not None
    cos, sin = (cos, sin) if rope else (q, q)  # unread without RoPE
    _partials[(prefix_programs + b * hkv * own_chunks,)](
        q, cos, sin, prefix_k, prefix_v, prefix_lens, own_k, own_v, new_k, new_v, step, m, l_, acc,
        q.stride(0), q.stride(1), cos.stride(0) if rope else 0, *prefix_k.stride()[:3], *prefix_v.stride()[:3],
        *own_k.stride()[:3], *own_v.stride()[:3], *new_k.stride()[:2], *new_v.stride()[:2],
        *m.stride(), *acc.stride()[:3],
        prefix_programs, splits, own_chunks, scaling,
        N=group_size, REP=rep, HKV=hkv, D=d, NQ_PREFIX=_pow2(group_size * rep), NQ_OWN=_pow2(rep),
        PREFIX_CHUNK_=prefix_chunk, OWN_CHUNK_=own_chunk, BLOCK=block_keys, ROPE=rope,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    out = torch.empty(b, h * d, device=q.device, dtype=q.dtype)
    parts = splits + own_chunks
    _merge[(b * h,)](
        m, l_, acc, out, parts, m.stride(0), acc.stride(0), D=d, S=_pow2(parts, 2), num_warps=merge_warps
    )
    return out


def _check_rope(q: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
    """cos and sin both given, [B, D] in q's dtype and device with a contiguous last dim and equal strides
    (the kernel reads both with cos's), or both None."""
    if cos is None and sin is None:
        return
    tables = [t for t in (cos, sin) if t is not None]
    b, _, d = q.shape
    if (
        len(tables) != 2
        or cos.stride() != sin.stride()
        or any(
            t.shape != (b, d) or t.dtype != q.dtype or t.device != q.device or t.stride(-1) != 1
            for t in tables
        )
    ):
        raise ValueError(
            f"fused decode attention needs cos and sin both None or both [B, D] = [{b}, {d}] in q's "
            f"dtype {q.dtype} on {q.device}, last dim contiguous, with equal strides"
        )


def _check_inputs(
    q, prefix_k, prefix_v, prefix_lens, own_k, own_v, new_k, new_v, step, group_size: int
) -> None:
    """Shapes, strides, dtypes and devices the kernels assume (metadata only: safe under capture)."""
    if triton is None:
        raise ImportError("the fused decode attention needs Triton (installed with the CUDA builds of torch)")
    b, h, d = q.shape
    g, hkv = prefix_k.shape[:2]
    problems = []
    if not supports(h, hkv, d):
        problems.append(f"H % Hkv == 0 and D a power of two >= 16 (H {h}, Hkv {hkv}, D {d})")
    if b != g * group_size or prefix_v.shape != prefix_k.shape:
        problems.append(f"B = G·N and matching prefix keys/values (B {b}, G {g}, N {group_size})")
    if own_k.shape[:2] != (b, hkv) or own_k.shape[3] != d or own_v.shape != own_k.shape:
        problems.append(f"own keys/values of shape [B, Hkv, L, D], got {tuple(own_k.shape)}")
    if new_k.shape != (b, hkv, d) or new_v.shape != new_k.shape:
        problems.append(f"the step's key/value of shape [B, Hkv, D], got {tuple(new_k.shape)}")
    if any(t.stride(-1) != 1 for t in (q, prefix_k, prefix_v, own_k, own_v, new_k, new_v)):
        problems.append("a contiguous last (head) dimension in q and every key/value tensor")
    if new_k.dtype != own_k.dtype or new_v.dtype != own_v.dtype:
        problems.append("the step's key/value in the cache's dtype")
    if prefix_lens.dtype != torch.int32 or prefix_lens.shape != (g,) or step.dtype != torch.int64:
        problems.append("prefix_lens int32 [G] and step int64 [1]")
    if any(t.device != q.device for t in (prefix_k, prefix_v, own_k, own_v, new_k, new_v, prefix_lens, step)):
        problems.append(f"every tensor on {q.device}")
    if problems:
        raise ValueError("fused decode attention needs " + "; ".join(problems))
