"""The disaggregated baseline (the paper's "Disagg", §4.2): after every update the training GPUs send the
new weights to the rollout GPUs, shard to shard.

Training replica 0's rank t (TP_train = T) holds training shard t; rollout rank k of every engine (TP_rollout
= Tr, q = T / Tr) needs rollout shard k, whose q consecutive pieces are training shards k·q … k·q + q − 1
(parallel.layout: the same row order at both degrees). So each training rank sends its shard to rollout
rank t // q of every engine, and each rollout rank receives its q pieces straight into its rollout
buffer (parallel.weight_sharing; row-parallel weights there are stored transposed, so the sender sends
its shard transposed: every piece is a contiguous slab of the receiver's storage). Replicated parameters
(norms, the vision tower) go from training rank k·q to rollout rank k of every engine. Point-to-point
sends, one parameter at a time (at most one transposed copy of one shard in flight).

Both sides walk ``named_parameters()`` of the same model class in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from rollplex.parallel.dist import ParallelContext
from rollplex.parallel.layout import Placement, entry
from rollplex.parallel.weight_sharing import storage_view


def _engines(ctx: ParallelContext) -> tuple[int, int, int]:
    """(first rollout rank, TP_rollout, engines)."""
    lay = ctx.layout
    return lay.rollout_ranks[0], lay.tp_rollout, lay.rollout_gpus // lay.tp_rollout


@torch.no_grad()
def send_weights(model: nn.Module, ctx: ParallelContext) -> None:
    """On a training rank: this rank's shards to the rollout ranks that read them (replica 0 sends; the
    other replicas hold the same weights and send nothing)."""
    if ctx.dp.rank != 0 or not ctx.trains:
        return
    first, tr, engines = _engines(ctx)
    t, q = ctx.train_tp.rank, ctx.layout.q
    targets = [first + e * tr + t // q for e in range(engines)]
    for name, param in model.named_parameters():
        e = entry(name)
        if e.train is Placement.REPLICATED:
            if t % q:
                continue
            payload = param.detach().contiguous()
        else:
            payload = (param.detach().t() if e.storage == "transposed" else param.detach()).contiguous()
        works = [dist.isend(payload, dst) for dst in targets]
        for work in works:
            work.wait()


@torch.no_grad()
def receive_weights(model: nn.Module, ctx: ParallelContext) -> None:
    """On a rollout rank: its rollout shard of every parameter from the training ranks, in place."""
    first, tr, _ = _engines(ctx)
    k, q = (ctx.rank - first) % tr, ctx.layout.q
    for name, param in model.named_parameters():
        if entry(name).train is Placement.REPLICATED:
            dist.recv(param.data, k * q)
            continue
        pieces = storage_view(param.data).chunk(q)
        works = [dist.irecv(piece, k * q + j) for j, piece in enumerate(pieces)]
        for work in works:
            work.wait()
