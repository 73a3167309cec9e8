"""The sampling race of one decode step as two Triton kernels (plain temperature sampling).

Legend: B rows, V vocabulary, S vocabulary splits.

``rollout.sampler.race_tokens`` makes about ten passes over float32 [B, V] tensors per step (mask,
cast, scale, log-softmax, finiteness, log of the noise, subtraction, argmax, gather), and torch.compile
fuses them into one reduction per row (B programs for the whole device, too few to fill it; both
timed in benchmarks/README.md). Here the vocabulary is split over S programs per row, each streaming
its slice of the logits and the noise once:

    x_v = logit_v / T (−inf at banned ids),   m_s = max x,   l_s = Σ exp(x − m_s),
    best_s = max (x_v − log E_v) and its first index,

and a merge per row gives lse = M + log Σ_s l_s exp(m_s − M), the token = argmax over splits (first
index on ties, as ``argmax``), and its log-prob x_token − lse — the trainer's definition
(``token_logprobs``) up to float32 summation order. Each program keeps one running max m_s (a block's
max joins it once per block), so a logit costs one exp (a running max per lane costs two, and was
slower with int64 ids: benchmarks/README.md). The argmax is
over x − log E instead of log p − log E: the two differ by the row constant lse, the same law. Top-p /
top-k / greedy keep the eager race (``fused_race`` falls back), and so do vocabularies over
``MAX_VOCAB`` = 2³⁰ ids (ids within a row are int32, with room for a slice's and a block's overshoot).
"""

from __future__ import annotations

import torch

from rollplex.rollout.decode_kernel import _jit, _pow2, tl, triton
from rollplex.rollout.sampler import race_tokens

SPLITS = 32  # vocabulary slices per row (at most: a small vocabulary takes fewer, a power of two)
BLOCK = 1024  # vocabulary entries per inner iteration (at most: a short slice takes the next power of two)
NUM_WARPS = 4  # warps of the partials launch
MAX_VOCAB = 2**30  # larger vocabularies take the eager race (int32 ids within a row; module docstring)


@_jit
def _race_partials(
    logits, noise, banned, m_out, l_out, s_out, i_out, V, slice_len, temperature,
    sl_b, sn_b, NB: tl.constexpr, S: tl.constexpr, BLOCK_: tl.constexpr, SCALE: tl.constexpr,
):  # fmt: skip
    """Program (row, split): max, sum of exp and best race score (with its index) of one slice.

    The running max is one number per program (the block's max joins it once per block), so each
    logit costs one exp; ids within the row are int32 (V ≤ MAX_VOCAB); SCALE is off at T = 1 (x / 1 = x)."""
    b, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    row_logits, row_noise = logits + b * sl_b, noise + b * sn_b
    lo = split * slice_len
    hi = tl.minimum(lo + slice_len, V)
    m = tl.max(tl.full((BLOCK_,), float("-inf"), tl.float32), 0)
    l_ = tl.zeros((BLOCK_,), tl.float32)
    best = tl.full((BLOCK_,), float("-inf"), tl.float32)
    best_i = tl.full((BLOCK_,), 2**31 - 1, tl.int32)
    for start in range(lo, hi, BLOCK_):
        v = start + tl.arange(0, BLOCK_)
        valid = v < hi
        x = tl.load(row_logits + v, mask=valid, other=float("-inf")).to(tl.float32)
        if SCALE:
            x = x / temperature
        for k in range(NB):
            x = tl.where(v == tl.load(banned + k).to(tl.int32), float("-inf"), x)
        e = tl.load(row_noise + v, mask=valid, other=1.0)
        score = tl.where(x > float("-inf"), x - tl.log(e), float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        l_ = l_ * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
        better = score > best
        best_i = tl.where(better, v, best_i)
        best = tl.where(better, score, best)
    s_row = tl.max(best, 0)
    at = b * S + split
    tl.store(m_out + at, m)
    tl.store(l_out + at, tl.sum(l_, 0))
    tl.store(s_out + at, s_row)
    tl.store(i_out + at, tl.min(tl.where(best == s_row, best_i, 2**31 - 1), 0).to(tl.int64))


@_jit
def _race_merge(logits, m_in, l_in, s_in, i_in, tokens, logprobs, temperature, sl_b, S: tl.constexpr):
    """Program per row: log-sum-exp over the splits, the winning token, its log-prob."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S)
    m = tl.load(m_in + b * S + s)
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(tl.load(l_in + b * S + s) * tl.exp(m - top), 0))
    score = tl.load(s_in + b * S + s)
    win = tl.max(score, 0)
    token = tl.min(tl.where(score == win, tl.load(i_in + b * S + s), 2**62), 0)
    token = tl.where(win > float("-inf"), token, 0)  # no finite score (a NaN or fully banned row): id 0
    x = tl.load(logits + b * sl_b + token).to(tl.float32) / temperature
    tl.store(tokens + b, token)
    tl.store(logprobs + b, x - lse)


def fused_race(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    *,
    temperature: float,
    banned_ids: torch.Tensor,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rollout.sampler.race_tokens`` as two kernels for plain temperature sampling (same arguments and
    results; log-probs equal up to float32 summation order). Greedy, top-p < 1, top-k > 0, float64
    logits or a vocabulary of more than ``MAX_VOCAB`` ids run ``race_tokens`` itself.

    Args:
        logits: bf16/fp16/fp32 [B, V], last dim contiguous. noise: float32 [B, V] (Exp(1)), last dim
            contiguous. banned_ids: int64 [K] on the logits' device.

    Returns:
        (tokens int64 [B], logprobs float32 [B]).

    Raises:
        ImportError: Triton is not installed.
    """
    if (
        noise is None
        or top_p < 1.0
        or top_k > 0
        or logits.dtype == torch.float64
        or logits.shape[-1] > MAX_VOCAB
    ):
        return race_tokens(
            logits, noise, temperature=temperature, banned_ids=banned_ids, top_p=top_p, top_k=top_k
        )
    if triton is None:
        raise ImportError("the fused sampling race needs Triton (installed with the CUDA builds of torch)")
    rows, vocab = logits.shape
    splits = min(SPLITS, _pow2(-(-vocab // BLOCK), least=2))
    slice_len = -(-vocab // splits)
    partial = {n: torch.empty(rows, splits, device=logits.device, dtype=torch.float32) for n in "mls"}
    index = torch.empty(rows, splits, device=logits.device, dtype=torch.int64)
    _race_partials[(rows, splits)](
        logits, noise, banned_ids, partial["m"], partial["l"], partial["s"], index, vocab, slice_len,
        float(temperature), logits.stride(0), noise.stride(0),
        NB=banned_ids.numel(), S=splits, BLOCK_=min(BLOCK, _pow2(slice_len)), SCALE=float(temperature) != 1.0,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    tokens = torch.empty(rows, device=logits.device, dtype=torch.int64)
    logprobs = torch.empty(rows, device=logits.device, dtype=torch.float32)
    _race_merge[(rows,)](
        logits, partial["m"], partial["l"], partial["s"], index, tokens, logprobs, float(temperature), logits.stride(0),
        S=splits,
    )  # fmt: skip
    return tokens, logprobs
