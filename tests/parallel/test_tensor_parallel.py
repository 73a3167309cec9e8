"""Tensor parallelism == one process: prefix prefill through the real HF modules with rollplex attention,
suffix scoring through models.forward, and the gradient of every parameter (float32, gloo).

Tolerances: the sharded model computes the same float32 operations except that each row-parallel
product is a sum of tp partial products taken in another order, and the log-softmax sums exp in
shards; those roundings (about 1e-7 relative per operation) pass through two decoder layers (observed:
about 1e-6), so log-probs, entropy and boundary KV must agree to 1e-5 and gradients to 2e-5 of each
parameter's largest gradient entry. A missing or doubled all-reduce, a wrong shard or head count is
off by O(1).
"""

from __future__ import annotations

import pytest
import torch

from rollplex.parallel.layout import Placement, entry, shard_index
from rollplex.parallel.tensor_parallel import grad_norm, shard_model
from tests.parallel.common import batch, build_model, context, flat_grads, reference_copy, score

LOGPROB_TOL = 1e-5
GRAD_TOL = 2e-5


def _loss(logprobs: torch.Tensor) -> torch.Tensor:
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(7))
    return (weights * logprobs).sum()


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got − want| over finite entries; infinite where the -inf entries (banned ids) differ."""
    got, want = got.detach(), want.detach()
    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        return float("inf")
    finite = torch.isfinite(want)
    return float((got[finite] - want[finite]).abs().max())


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def tp_against_single_process(tp: int, dp: int) -> dict:
    ctx = context(tp, 1, dp)
    model = build_model()
    oracle = reference_copy(model)
    prompts, responses = batch()
    ref_prefix, ref_lp, ref_ent = score(oracle, prompts, responses)
    _loss(ref_lp).backward()
    full = shard_model(model, ctx.train_tp)
    prefix, lp, ent = score(model, prompts, responses, comm=ctx.train_tp)
    _loss(lp).backward()
    comm, want = ctx.train_tp, flat_grads(oracle)
    kv = slice(comm.rank * prefix.keys[0].shape[1], (comm.rank + 1) * prefix.keys[0].shape[1])
    grads = flat_grads(model)
    errors = {
        "logprobs": _diff(lp, ref_lp),
        "entropy": _diff(ent, ref_ent),
        "last_logprobs": _diff(prefix.last_logprobs, ref_prefix.last_logprobs),
        "keys": max(_diff(k, r[:, kv]) for k, r in zip(prefix.keys, ref_prefix.keys, strict=True)),
        "values": max(_diff(v, r[:, kv]) for v, r in zip(prefix.values, ref_prefix.values, strict=True)),
    }
    whole = torch.stack([g.pow(2).sum() for g in want.values()]).sum().sqrt()
    errors["grad_norm"] = _rel(grad_norm(model.named_parameters(), comm), whole)
    grad_errors = {}
    for name, g in want.items():
        index = shard_index(name, full[name], comm.size, comm.rank)
        grad_errors[name] = _rel(grads[name], g[index])
    replicated = torch.cat(
        [grads[n].reshape(-1) for n in sorted(grads) if entry(n).train is Placement.REPLICATED]
    )
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {
        "errors": errors,
        "grad_errors": grad_errors,
        "missing": sorted(set(want) - set(grads)),
        "replicated": replicated,
        "tp_group": comm.ranks,
        "shapes": shapes,
        "heads": (model.model.language_model.layers[0].self_attn.num_heads, prefix.keys[0].shape[1]),
    }


def _check(results: list[dict], tp: int) -> None:
    for rank, out in enumerate(results):
        assert not out["missing"], (rank, out["missing"])
        for what, err in out["errors"].items():
            assert err <= LOGPROB_TOL, (rank, what, err)
        worst = max(out["grad_errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= GRAD_TOL, (rank, worst)
        assert out["heads"] == (8 // tp, 4 // tp)
        assert out["shapes"]["model.language_model.layers.0.self_attn.o_proj.weight"] == (64, 64 // tp)
        # replicated parameters (norms, vision tower, merger): the same gradient bits on every TP rank
        for other in out["tp_group"]:
            assert torch.equal(out["replicated"], results[other]["replicated"]), (rank, other)


@pytest.mark.parametrize(("world", "tp", "dp"), [(2, 2, 1), (4, 2, 2), (4, 4, 1)])
def test_tensor_parallel_matches_single_process(ranks, world, tp, dp):
    _check(ranks(world, tp_against_single_process, tp, dp), tp)
