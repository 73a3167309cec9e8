"""Vocabulary-parallel log-probs, entropy, their gradients and the sampling race == the full-vocabulary
definitions of rollout.sampler, on 4 CPU processes (TP 2 twice and TP 4).

Oracle: rollout.sampler.token_logprobs / entropy / race_tokens / sample_tokens on the whole [.., V]
logits in one process. Banned ids lie in several shards, one target is banned (-inf, zero gradient).
float64 runs must agree to 1e-12 (only summation order differs); float32 to 1e-5 (values of a few
nats, sums of 200 exponentials in another order). Sampled tokens must be equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollplex.models.logprobs import entropy, token_logprobs
from rollplex.parallel.vocab_parallel import (
    TensorParallelHead,
    VocabShard,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_race,
)
from rollplex.rollout.sampler import race_tokens, sample_tokens
from tests.parallel.common import context

V, T = 200, 0.7
BANNED = torch.tensor([5, 60, 130, 190, 191, 199])


def _shard(tp: int):
    comm = context(tp, 1, 4 // tp).train_tp
    return VocabShard(comm, comm.rank * (V // tp), V)


def _columns(x: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    return x[..., shard.start : shard.start + shard.width]


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        return float("inf")
    finite = torch.isfinite(want)
    return float((got[finite] - want[finite]).abs().max())


def logprobs_against_full(tp: int, dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    shard = _shard(tp)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, V, generator=g, dtype=dtype) * 3
    targets = torch.randint(0, V, (3, 4), generator=g)
    targets[0, 0], targets[2, 1] = 191, 60  # banned targets: -inf
    a, b = torch.randn(3, 4, generator=g, dtype=dtype), torch.randn(3, 4, generator=g, dtype=dtype)

    local = _columns(logits, shard).clone().requires_grad_(True)
    lp = vocab_parallel_logprobs(local, targets, T, BANNED, shard)
    ent = vocab_parallel_entropy(local, T, BANNED, shard)
    (a * lp.masked_fill(torch.isinf(lp), 0.0) + b * ent).sum().backward()
    # the banned targets' -inf log-probs carry a gradient too: both sides must give 0 there
    local_banned = _columns(logits, shard).clone().requires_grad_(True)
    vocab_parallel_logprobs(local_banned, targets, T, BANNED, shard).sum().backward()

    full = logits.clone().requires_grad_(True)
    full_lp = token_logprobs(full, T, BANNED)
    ref_lp = full_lp.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = entropy(full_lp)
    (a * ref_lp.masked_fill(torch.isinf(ref_lp), 0.0) + b * ref_ent).sum().backward()
    full_banned = logits.clone().requires_grad_(True)
    token_logprobs(full_banned, T, BANNED).gather(-1, targets[..., None]).sum().backward()
    return {
        "logprobs": _diff(lp.detach(), ref_lp.detach()),
        "entropy": _diff(ent.detach(), ref_ent.detach()),
        "grad": float((local.grad - _columns(full.grad, shard)).abs().max()),
        "grad_banned_targets": float((local_banned.grad - _columns(full_banned.grad, shard)).abs().max()),
        "dtypes": (lp.dtype, ent.dtype),
    }


@pytest.mark.parametrize(("dtype", "tol"), [("float64", 1e-12), ("float32", 1e-5)])
def test_logprobs_entropy_and_gradients_match_full_vocabulary(ranks, dtype, tol):
    for tp in (2, 4):
        for rank, out in enumerate(ranks(4, logprobs_against_full, tp, dtype)):
            assert out["dtypes"] == (getattr(torch, dtype),) * 2
            for what in ("logprobs", "entropy", "grad", "grad_banned_targets"):
                assert out[what] <= tol, (tp, rank, what, out[what])


def race_against_single_process(tp: int) -> dict:
    shard = _shard(tp)
    head = TensorParallelHead(shard.comm, shard.start, V, heads=1, kv_heads=1)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(64, V, generator=g) * 2
    noise = torch.empty(64, V).exponential_(generator=g)
    out = {}
    for name, temperature, kw in (
        ("t0.7", 0.7, {}),
        ("t1.3", 1.3, {}),
        ("top_p", 0.7, {"top_p": 0.9}),
        ("top_k", 0.7, {"top_k": 5}),
    ):
        got = vocab_parallel_race(
            _columns(logits, shard), noise, temperature=temperature, banned_ids=BANNED, shard=shard, **kw
        )
        want = race_tokens(logits, noise, temperature=temperature, banned_ids=BANNED, **kw)
        out[name] = (got, want)
    greedy = head.race(_columns(logits, shard), None, temperature=0.0, banned_ids=BANNED)
    out["greedy"] = (greedy, race_tokens(logits, None, temperature=0.0, banned_ids=BANNED))
    options = {"temperature": 0.9, "banned_ids": BANNED, "top_p": 1.0, "top_k": 0}
    sampled = head.sample(_columns(logits, shard), torch.Generator().manual_seed(11), **options)
    out["sample"] = (sampled, sample_tokens(logits, generator=torch.Generator().manual_seed(11), **options))
    weight = torch.randn(V, 8, generator=g)
    ids = torch.randint(0, V, (5, 3), generator=g)
    out["embed"] = float(
        (head.embed(ids, _columns(weight.t(), shard).t()) - F.embedding(ids, weight)).abs().max()
    )
    return out


def test_sampling_race_gives_the_single_process_tokens(ranks):
    for tp in (2, 4):
        for rank, out in enumerate(ranks(4, race_against_single_process, tp)):
            assert out.pop("embed") == 0.0, (tp, rank)
            for name, ((tokens, logprobs), (want_tokens, want_logprobs)) in out.items():
                assert torch.equal(tokens, want_tokens), (tp, rank, name)
                assert not torch.isin(tokens, BANNED).any()
                assert (logprobs - want_logprobs).abs().max() <= 1e-5, (tp, rank, name)
