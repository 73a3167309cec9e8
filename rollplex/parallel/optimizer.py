"""The actor's optimizer step under torchrun: one gradient reduction, ZeRO-1 ownership, one global norm.

    backward (every replica, its own groups; loss over the GLOBAL token count: phases.actor_backward)
      └─ all_reduce_gradients over the data-parallel group    each rank: the whole batch's gradient
         └─ global norm: Σ g² of this rank's OWNED pieces      all-reduced over dp (pieces disjoint),
                                                              TP-sharded parameters' part over the TP
                                                              group; replicated ones counted once
            └─ ChunkedAdamW on the owned ranges only          FP32 state of 1/dp of the parameters
               └─ gather_owned over dp                        every replica holds θ_{k+1}
                  └─ after_update()                           SharedWeights.refresh (colocated) or the
                                                              weights sent to the rollout GPUs
                                                              (disaggregated): the Phase-3 barrier

Method: ZeRO stage 1 (Rajbhandari et al., arXiv:1910.02054 §5, P_os). The norm comes before any chunk
commits (``ChunkedAdamW.grad_norm``), so clipping is global; a norm that is not finite skips the step
on every rank alike (it is the same number everywhere).

The one-process run keeps ``optim.MasterWeightAdamW`` and none of this.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from rollplex.memory.chunked_adamw import ChunkedAdamW, chunk_layout, host_chunks_for
from rollplex.memory.host_pool import PinnedHostPool
from rollplex.memory.transfers import Transfers
from rollplex.parallel.data_parallel import all_reduce_gradients, gather_owned, owned_ranges
from rollplex.parallel.dist import Comm
from rollplex.parallel.layout import Placement, entry


def sharded_flags(names: Sequence[str], tp: int) -> list[bool]:
    """Per parameter: whether its rows are split over the TP group (its gradient's squares are then
    summed over the group); replicated parameters count once."""
    return [tp > 1 and entry(name).train is not Placement.REPLICATED for name in names]


def global_grad_norm(
    pieces: list[tuple[int, torch.Tensor]], sharded: Sequence[bool], dp: Comm, tp: Comm, device: torch.device
) -> torch.Tensor:
    """The L2 norm of the whole model's gradient from this rank's pieces (param index, flat piece):
    Σ g² in float64 of the TP-sharded and of the replicated parameters' pieces, both summed over ``dp``
    (each replica owns other elements), the sharded part also over ``tp``. Equal on every rank;
    float32 scalar (the masters' dtype)."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for index, piece in pieces:
        sums[0 if sharded[index] else 1] += piece.double().pow(2).sum()
    dp.all_reduce(sums)
    tp.all_reduce(sums[:1])
    return sums.sum().sqrt().float()


class ParallelOptimizer:
    """The actor's optimizer on one rank of a parallel run (module docstring); the surface the schedules
    and the loop use of ``optim.MasterWeightAdamW``: ``clip_and_step``, ``set_lr``, ``zero_grad``,
    ``state_dict`` and ``load_state_dict`` (this rank's shard of the state).

    Args:
        named: the actor's trainable (name, parameter) pairs, in order.
        optim: the run's ``OptimConfig``. chunk_mib: ``memory.chunk_mib``.
        dp, tp: this rank's data-parallel and training TP groups.
        after_update: called after every step (skipped ones included, so a disaggregated run's rollout
            GPUs always receive as many updates as they wait for).
        owned: False gives every rank the whole state (no ZeRO-1).
    """

    def __init__(
        self,
        named: list[tuple[str, torch.nn.Parameter]],
        optim,
        *,
        chunk_mib: float,
        dp: Comm,
        tp: Comm,
        after_update: Callable[[], None],
        owned: bool = True,
        pool: PinnedHostPool | None = None,
        transfers: Transfers | None = None,
        host_bytes: int = 0,
    ):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.dp, self.after_update = dp, after_update
        sharded = sharded_flags(self.names, tp.size)
        ranges = None
        if owned and dp.size > 1:
            ranges = [(o.index, o.start, o.stop) for o in owned_ranges(self.params, dp.rank, dp.size)]
        elements = max(1, int(chunk_mib * 2**20) // 4)
        host = host_chunks_for(chunk_layout(self.params, elements, ranges), host_bytes) if host_bytes else ()
        self.inner = ChunkedAdamW(
            self.params,
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            chunk_elements=elements,
            host_chunks=host,
            pool=pool,
            transfers=transfers,
            owned=ranges,
            grad_norm=lambda pieces: global_grad_norm(pieces, sharded, dp, tp, self.params[0].device),
        )
        self.sharded = ranges is not None

    def clip_and_step(self, max_grad_norm: float) -> float:
        """Sum the gradients over the replicas, clip to ``max_grad_norm`` (0 = no clipping) by the global
        norm, update this rank's owned ranges, gather everyone's, then ``after_update``.

        Returns:
            The global L2 gradient norm before clipping (not finite: the step was skipped everywhere).
        """
        all_reduce_gradients(self.params, self.dp)
        norm = self.inner.clip_and_step(max_grad_norm)
        if self.sharded and math.isfinite(norm):
            gather_owned(self.params, self.dp)
        self.after_update()
        return norm

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    @property
    def lr(self) -> float:
        return self.inner.lr

    def state_dict(self) -> dict:
        """This rank's optimizer state (its owned ranges when sharded)."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Raises ValueError for state of another ownership or shape (``ChunkedAdamW.load_state_dict``)."""
        self.inner.load_state_dict(state)

    def resident_bytes(self) -> dict[str, dict[str, int]]:
        """This rank's optimizer state by class and place (``ChunkedAdamW.resident_bytes``)."""
        return self.inner.resident_bytes()


class NoOptimizer:
    """The optimizer of a rank that only decodes (disaggregated rollout GPUs): nothing to update."""

    lr = 0.0

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def zero_grad(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def resident_bytes(self) -> dict[str, dict[str, int]]:
        return {tag: {"device": 0, "host": 0} for tag in ("master", "adam")}

    def clip_and_step(self, max_grad_norm: float) -> float:
        raise AssertionError("a rollout-only rank does not update the weights")
