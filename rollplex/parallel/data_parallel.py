"""Data parallelism: whole prompt groups per replica, one gradient reduction per step, ZeRO-1 ownership.

Each data-parallel replica (a training TP group) takes whole GRPO prompt groups (``local_groups``), so
a group's shared prefix stays on one replica. The loss of every replica is normalised by the GLOBAL
count of valid tokens (``global_count``: an all-reduce of the replicas' counts before the loss), so
the SUM of the replicas' gradients (``all_reduce_gradients``, once per optimizer step) is the gradient
of the whole batch; one process on the whole batch gives the same gradient.

Optimizer state is split ZeRO-1 style (Rajbhandari et al., arXiv:1910.02054 §5, P_os): rank k of the
data-parallel group owns one contiguous, byte-balanced range of the flattened parameter list
(``owned_ranges``) and the chunked optimizer updates only what it owns; ``gather_owned`` then
all-gathers the updated BF16 values so every replica holds the new snapshot. The flattened order of a
parameter is its storage order (``weight_sharing.storage_view``: a Case 2 weight is flattened
transposed), which elementwise AdamW does not mind.

Metrics (``reduce_metrics``): rank 0 prints the slowest rank's times (MAX), the sums of counts, and
the mean of everything else.

Where the run uses them: the loop gives each replica its block of the step's groups
(``parallel.runtime.ParallelRuntime.replica_share``, ``split_range``); phases.actor_backward divides the
loss by the global token and sequence counts (``ParallelRuntime.global_counts``); the optimizer step
(parallel.optimizer) runs ``all_reduce_gradients``, the chunked optimizer over ``owned_ranges`` and
``gather_owned``, then ``SharedWeights.refresh``; rank 0's metrics are reduced by
``parallel.runtime.step_reduction``.
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from rollplex.parallel.dist import Comm
from rollplex.parallel.weight_sharing import storage_view

GRADIENT_BUCKET_BYTES = 256 * 2**20  # gradients flattened and all-reduced this much at a time


def local_groups(groups: int, dp: Comm) -> range:
    """The prompt groups (indices into the step's ``groups`` groups) of this data-parallel replica: a
    contiguous block of groups // dp.size.

    Raises:
        ValueError: ``groups`` is not a multiple of the replica count (parallel.dist.check_groups
            reports it at start-up with the config fields).
    """
    if groups % dp.size:
        raise ValueError(f"{groups} prompt groups do not split evenly over {dp.size} data-parallel replicas")
    n = groups // dp.size
    return range(dp.rank * n, dp.rank * n + n)


def split_range(count: int, parts: int, index: int) -> range:
    """Part ``index`` of ``parts`` contiguous, nearly equal blocks of ``range(count)``: the first
    ``count % parts`` blocks hold one item more; a block may be empty. Equal to ``local_groups`` where
    ``parts`` divides ``count``.

    Example: count 5, parts 2 -> range(0, 3), range(3, 5).
    """
    size, extra = divmod(count, parts)
    start = index * size + min(index, extra)
    return range(start, start + size + (index < extra))


def global_count(count: torch.Tensor, dp: Comm) -> torch.Tensor:
    """The sum over the data-parallel group of a count (valid tokens, sequences): float64 scalar
    tensor on ``count``'s device, equal on every rank; what the loss divides by."""
    total = torch.as_tensor(count, dtype=torch.float64, device=count.device).reshape(1).clone()
    return dp.all_reduce(total)[0]


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if out[-1] and (size + nbytes > limit or t.dtype != out[-1][0].dtype):
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return [b for b in out if b]


@torch.no_grad()
def all_reduce_gradients(
    params: Sequence[torch.nn.Parameter], dp: Comm, bucket_bytes: int = GRADIENT_BUCKET_BYTES
) -> None:
    """Sum every parameter's gradient over the data-parallel group, in place, in flattened buckets of
    at most ``bucket_bytes`` (one collective each). Parameters that require grad but got none (a frozen
    path on this replica's data) take zeros, so every rank reduces the same buckets."""
    if dp.size == 1:
        return
    grads = []
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    for bucket in _buckets(grads, bucket_bytes):
        flat = dp.all_reduce(torch.cat([g.reshape(-1) for g in bucket]))
        for g, piece in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
            g.copy_(piece.view(g.shape))


@dataclass(frozen=True)
class OwnedRange:
    """Elements [start, stop) of parameter ``index`` (of the list given to ``owned_ranges``), in the
    parameter's storage order (``weight_sharing.storage_view``)."""

    index: int
    start: int
    stop: int


def _cuts(sizes: list[int], element: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut points (parameter index, element offset) splitting the flattened bytes into ``parts``
    nearly equal runs, each cut moved down to an element boundary of the parameter it falls in."""
    starts = [0]
    for n, e in zip(sizes, element, strict=True):
        starts.append(starts[-1] + n * e)
    cuts = []
    for k in range(parts + 1):
        at = k * starts[-1] // parts
        i = min(bisect.bisect_right(starts, at) - 1, len(sizes) - 1)
        cuts.append((i, (at - starts[i]) // element[i]))
    return cuts


def owned_ranges(params: Sequence[torch.Tensor], dp_rank: int, dp_size: int) -> list[OwnedRange]:
    """The contiguous, byte-balanced part of the flattened parameter list that rank ``dp_rank`` of
    ``dp_size`` owns (ZeRO-1): ranges over consecutive parameters; every element of every parameter is
    owned by exactly one rank; each rank's byte count is within one element of total / dp_size.

    Example: two parameters of 6 and 2 float32 elements, dp_size 2 -> rank 0 owns (0, 0, 4), rank 1
    owns (0, 4, 6) and (1, 0, 2).

    Raises:
        ValueError: no parameters, or ``dp_rank`` outside [0, dp_size).
    """
    if not params:
        raise ValueError("owned_ranges needs at least one parameter")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} outside a group of {dp_size}")
    sizes = [p.numel() for p in params]
    cuts = _cuts(sizes, [p.element_size() for p in params], dp_size)
    (i0, e0), (i1, e1) = cuts[dp_rank], cuts[dp_rank + 1]
    out = []
    for i in range(i0, i1 + 1):
        start = e0 if i == i0 else 0
        stop = e1 if i == i1 else sizes[i]
        if stop > start:
            out.append(OwnedRange(i, start, stop))
    return out


def _flat(param: torch.Tensor) -> torch.Tensor:
    return storage_view(param).view(-1)


@torch.no_grad()
def gather_owned(params: Sequence[torch.Tensor], dp: Comm) -> None:
    """After each rank updated its ``owned_ranges``: every rank receives the others' updated values
    (one all-gather of the ranks' owned elements, padded to the longest), so all replicas hold the
    same snapshot.

    Raises:
        ValueError: the parameters have more than one dtype.
    """
    if dp.size == 1:
        return
    if len({p.dtype for p in params}) != 1:
        raise ValueError(
            f"gather_owned needs parameters of one dtype, got {sorted({str(p.dtype) for p in params})}"
        )
    owned = [owned_ranges(params, r, dp.size) for r in range(dp.size)]
    lengths = [sum(o.stop - o.start for o in ranges) for ranges in owned]
    width = max(lengths)
    mine = torch.zeros(width, dtype=params[0].dtype, device=params[0].device)
    if lengths[dp.rank]:
        mine[: lengths[dp.rank]] = torch.cat(
            [_flat(params[o.index])[o.start : o.stop] for o in owned[dp.rank]]
        )
    everyone = torch.empty(dp.size * width, dtype=mine.dtype, device=mine.device)
    dp.all_gather_into(everyone, mine)
    for rank, ranges in enumerate(owned):
        if rank == dp.rank:
            continue
        offset = rank * width
        for o in ranges:
            n = o.stop - o.start
            _flat(params[o.index])[o.start : o.stop].copy_(everyone[offset : offset + n])
            offset += n


COUNT_KEYS = frozenset({"tokens", "samples", "skipped_samples", "groups", "sequences"})


def metric_reduction(key: str) -> str:
    """How ``reduce_metrics`` combines ``key`` over the ranks: "max" for times (``time/*``, ``*_s``),
    "sum" for counts (``COUNT_KEYS``, ``*_count``, ``*/count``), "mean" otherwise (per-rank means of
    equal-sized replicas)."""
    if key.startswith("time/") or key.endswith("_s"):
        return "max"
    if key in COUNT_KEYS or key.endswith("_count") or key.endswith("/count"):
        return "sum"
    return "mean"


def reduce_metrics(
    metrics: Mapping[str, float], comm: Comm, how: Callable[[str], str] = metric_reduction
) -> dict[str, float]:
    """One step's metrics of this rank combined over ``comm`` (``how`` per key: max, sum or mean), for
    rank 0 to write: one all-reduce checks that every rank passed the same keys, then one MAX and one
    SUM all-reduce of the values.

    Raises:
        ValueError: the ranks passed different key sets (on every rank), or ``how`` returned another word.
    """
    keys = sorted(metrics)
    kinds = [how(k) for k in keys]
    if set(kinds) - {"max", "sum", "mean"}:
        raise ValueError(f"metric reductions must be max, sum or mean, got {sorted(set(kinds))}")
    if comm.size == 1:
        return {k: float(metrics[k]) for k in keys}
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    sign = float(zlib.crc32("\n".join(keys).encode()))
    agree = comm.all_reduce(torch.tensor([sign, -sign], dtype=torch.float64, device=device), op="max")
    if agree[0] != -agree[1]:
        raise ValueError(f"reduce_metrics: the ranks passed different metric keys (this rank: {keys})")
    highest = [float(metrics[k]) for k, w in zip(keys, kinds, strict=True) if w == "max"]
    total = [float(metrics[k]) for k, w in zip(keys, kinds, strict=True) if w != "max"]
    maxima = iter(
        comm.all_reduce(torch.tensor(highest, dtype=torch.float64, device=device), op="max").tolist()
    )
    sums = iter(comm.all_reduce(torch.tensor(total, dtype=torch.float64, device=device)).tolist())
    out = {}
    for key, kind in zip(keys, kinds, strict=True):
        out[key] = next(maxima) if kind == "max" else next(sums) / (comm.size if kind == "mean" else 1)
    return out
