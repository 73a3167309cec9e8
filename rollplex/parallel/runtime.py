"""The parallel layer in a run: what the loop, the phases and the schedules call under torchrun.

A run of one process never builds this (``loop.build_run`` keeps ``run.parallel`` None): no process
group, no copy, no collective. With several processes ``ParallelRuntime.setup`` shards the models in
place and binds the rollout's weights, and the run calls:

    loop        ``replica_share`` (this replica's groups), ``optimizer`` (parallel.optimizer, ZeRO-1),
                ``reduce_stats`` / ``reduce_record`` (rank 0 writes the reduced metrics),
                ``full_state_dict`` (rank 0's Hugging Face checkpoint), ``describe`` (the log's layout
                lines), ``receive_weights`` (disaggregated rollout ranks)
    phases      ``rollout`` (parallel.engines), ``global_counts`` (the loss's token and sequence counts)

Placement of each model (Megatron-style TP, parallel.tensor_parallel; the vision tower replicated):

    colocated       actor at TP_train, its rollout shards at TP_rollout bound over the same bytes
                    (parallel.weight_sharing, Case 1/2; ``parallel.shared_weights: false`` keeps a copy)
                    reference at TP_train (no sharing: it is never decoded)
    disaggregated   training ranks: actor and reference at TP_train; rollout ranks: the actor alone at
                    TP_rollout, refreshed by the training ranks after every update (parallel.disaggregated)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from rollplex.config import Config
from rollplex.parallel.data_parallel import split_range
from rollplex.parallel.disaggregated import receive_weights, send_weights
from rollplex.parallel.dist import Comm, ParallelContext
from rollplex.parallel.engines import RolloutEngines
from rollplex.parallel.layout import Placement, entry
from rollplex.parallel.optimizer import NoOptimizer, ParallelOptimizer
from rollplex.parallel.tensor_parallel import shard_model
from rollplex.parallel.weight_sharing import SharedWeights, case_rows, classify, format_case_rows, model_heads


@dataclass
class ParallelRuntime:
    """One rank's parallel state for a run (module docstring).

    Fields: ``ctx`` (the groups), ``cfg`` (the run config), ``shapes`` (every actor parameter's full
    shape, by name), ``actor`` (this rank's, sharded), ``shared`` (its rollout weights; None on ranks
    that only train), ``engines`` (the rollout, parallel.engines).
    """

    ctx: ParallelContext
    cfg: Config
    shapes: dict[str, tuple[int, ...]]
    actor: nn.Module
    shared: SharedWeights | None
    engines: RolloutEngines

    @classmethod
    def setup(
        cls,
        ctx: ParallelContext,
        cfg: Config,
        actor: nn.Module,
        reference: nn.Module | None,
        device: torch.device,
        shapes: dict[str, tuple[int, ...]] | None = None,
    ) -> ParallelRuntime:
        """Shard ``actor`` and ``reference`` (full weights, equal on every rank, on any device) in place
        for this rank, move them to ``device``, and bind the rollout's weights there. With ``shapes``
        (every parameter's full shape) the models come sharded already, on ``device`` (built shard by
        shard: bench.parallel.sharded_random_model).

        Raises:
            ValueError: a degree the model's sizes do not allow (tensor_parallel.shard_model).
        """
        if shapes is None:
            shapes = {name: tuple(p.shape) for name, p in actor.named_parameters()}
            degree = ctx.train_tp if ctx.trains else ctx.rollout_tp
            for model in (actor, reference):
                if model is not None:
                    if degree.size > 1:
                        shard_model(model, degree)
                    model.to(device)
        shared = None
        if ctx.trains and not ctx.layout.rollout_gpus:
            copied = not cfg.parallel.shared_weights
            shared = SharedWeights(actor, ctx.train_tp, ctx.share, ctx.rollout_tp, copied=copied)
        elif not ctx.trains:
            shared = SharedWeights(actor, ctx.rollout_tp, Comm((ctx.rank,), 0), ctx.rollout_tp)
        head = shared.rollout_head() if shared is not None and ctx.rollout_tp.size > 1 else None
        vocab = actor.config.text_config.vocab_size
        return cls(ctx, cfg, shapes, actor, shared, RolloutEngines(ctx, shared, head, vocab))

    # -- what the phases call ----------------------------------------------------------------------

    def rollout(self, model, prompts, prefix, **kwargs):
        """``RolloutEngines.rollout`` (phases.rollout_phase under torchrun)."""
        return self.engines.rollout(model, prompts, prefix, **kwargs)

    @property
    def decodes_here(self) -> bool:
        """Whether this rank computes a rollout prefix (a disaggregated training rank does not)."""
        return self.ctx.decodes

    def global_counts(self, tokens: int, sequences: int) -> tuple[int, int]:
        """The loss's valid-token and sequence counts summed over the data-parallel replicas."""
        counts = torch.tensor([tokens, sequences], dtype=torch.float64, device=self.ctx.device)
        self.ctx.dp.all_reduce(counts)
        return int(counts[0]), int(counts[1])

    # -- what the loop calls -----------------------------------------------------------------------

    @property
    def trains(self) -> bool:
        return self.ctx.trains

    def replica_share(self, items: list) -> list:
        """This rank's contiguous share of a step's groups (or of evaluation prompts): its replica's
        (``data_parallel.split_range`` over dp), or all of them on a rank that only decodes."""
        if not self.ctx.trains:
            return list(items)
        block = split_range(len(items), self.ctx.dp.size, self.ctx.dp.rank)
        return [items[i] for i in block]

    def optimizer(self, actor: nn.Module, pool=None, transfers=None, host_bytes: int = 0):
        """The actor's optimizer on this rank: ZeRO-1 over the data-parallel group unless
        ``parallel.shard_optimizer`` is false (parallel.optimizer), with its first ``host_bytes`` of state in the residency manager's host
        ``pool`` (memory.runtime), or nothing to update on a rank that only decodes."""
        if not self.ctx.trains:
            return NoOptimizer()
        named = [(n, p) for n, p in actor.named_parameters() if p.requires_grad]
        return ParallelOptimizer(
            named,
            self.cfg.optim,
            chunk_mib=self.cfg.memory.chunk_mib,
            dp=self.ctx.dp,
            tp=self.ctx.train_tp,
            after_update=self.after_update,
            pool=pool,
            transfers=transfers,
            host_bytes=host_bytes,
            owned=self.cfg.parallel.shard_optimizer,
        )

    def after_update(self) -> None:
        """The Phase-3 barrier's hand-over of θ_{k+1}: the rollout shards refreshed (colocated) or sent
        to the rollout GPUs (disaggregated)."""
        if self.ctx.layout.rollout_gpus:
            send_weights(self.actor, self.ctx)
        elif self.shared is not None:
            self.shared.refresh()

    def receive_weights(self) -> None:
        """A disaggregated rollout rank's side of ``after_update``."""
        receive_weights(self.actor, self.ctx)

    def reduce_stats(self, values: Mapping[str, float], maxima: frozenset[str]) -> dict[str, float]:
        """Sums of one mini-batch's actor statistics over the replicas (``maxima``: their maximum)."""
        keys = sorted(values)
        sums = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.ctx.device)
        highs = sums.clone()
        self.ctx.dp.all_reduce(sums)
        self.ctx.dp.all_reduce(highs, op="max")
        return {k: float((highs if k in maxima else sums)[i]) for i, k in enumerate(keys)}

    def mean_over_replicas(self, values: list[torch.Tensor]) -> float:
        """The mean of every replica's ``values`` (float tensors; an all-reduce of sum and count over
        dp); nan where there are none."""
        total = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)
        for v in values:
            total += torch.stack([v.double().sum(), torch.tensor(float(v.numel()), dtype=torch.float64)]).to(
                total
            )
        self.ctx.dp.all_reduce(total)
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")

    def reduce_record(self, record: Mapping) -> dict:
        """One step's metrics for rank 0 (``step_reduction`` per key, over the ranks that train);
        "step" and other values that are not numbers pass unchanged, integers stay integers."""
        numbers = {k: float(v) for k, v in record.items() if k != "step" and _is_number(v)}
        reduced = _reduce(numbers, self.ctx.pool, self.ctx.layout.tp_train)
        whole = {
            k: round(v) for k, v in reduced.items() if isinstance(record.get(k), int) and math.isfinite(v)
        }
        return {**record, **reduced, **whole}

    def describe(self) -> list[str]:
        """The log's lines on the layout this run uses, and the Case 1/2/3 split of its weights."""
        p, ctx = self.cfg.parallel, self.ctx
        lines = [
            f"parallel layout: {ctx.world} processes, dp={p.dp}, tp_train={p.tp_train}, "
            f"tp_rollout={p.tp_rollout}, {p.placement}"
            + (f" ({p.rollout_gpus} rollout GPUs)" if p.rollout_gpus else "")
            + f", {ctx.layout.dp * ctx.layout.q if not p.rollout_gpus else p.rollout_gpus // p.tp_rollout}"
            " rollout engines"
        ]
        if not p.rollout_gpus:
            heads = model_heads(self.actor)
            rows = case_rows(
                classify(self.shapes.items(), p.tp_train, p.tp_rollout, heads=heads), p.tp_rollout
            )
            how = "one physical copy" if p.shared_weights else "rollout keeps its own copy"
            lines.append(f"weight sharing ({how}): " + "; ".join(case_summary(rows)))
            lines += format_case_rows(rows)
        return lines

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Every tensor of ``model``'s state dict as the full (unsharded) tensor, on the CPU, on rank 0;
        None elsewhere. A collective over each training TP group (every training rank calls it)."""
        tp = self.ctx.train_tp
        out, seen = {}, {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:  # a tied weight
                out[name] = seen[id(tensor)]
                continue
            full = tensor.detach()
            placement = entry(name).train if name in self.shapes else Placement.REPLICATED
            if tp.size > 1 and placement is not Placement.REPLICATED:
                pieces = torch.empty((tp.size, *full.shape), dtype=full.dtype, device=full.device)
                tp.all_gather_into(pieces, full.contiguous())
                full = torch.cat(pieces.unbind(0), dim=placement.dim)
            if self.ctx.is_writer:
                out[name] = seen[id(tensor)] = full.to("cpu", copy=True)
        return out if self.ctx.is_writer else None

    def layout_key(self) -> dict:
        """What a sharded checkpoint must match to resume: the world size and the ``parallel:`` section."""
        p = self.cfg.parallel
        return {
            "world": self.ctx.world,
            "dp": p.dp,
            "tp_train": p.tp_train,
            "tp_rollout": p.tp_rollout,
            "placement": p.placement,
            "rollout_gpus": p.rollout_gpus,
        }


def case_summary(rows) -> list[str]:
    """One phrase per case: ``Case 1: 24 tensors, 61.2 % of the LM``."""
    return [f"Case {r.case}: {r.tensors} tensors, {r.lm_percent:.1f} % of the LM" for r in rows]


# metrics whose rank-0 value is the largest over the ranks (beside times: ``time/*``, ``*_s``)
MAX_METRICS = frozenset({"peak_memory_gib", "memory_allocated_gib", "logprob_diff_max"})
# counts over the replicas' own groups: summed over the replicas
COUNT_METRICS = frozenset(
    {"zero_variance_groups", "reward_errors", "temporal/video_groups", "temporal/reward_errors"}
)


def step_reduction(key: str) -> str:
    """How a step metric combines over the ranks for rank 0: "max" for times and memory (the slowest
    rank's figures: ``time/*``, ``*_s``, ``eq1/*`` and ``MAX_METRICS``), "count" for counts over each
    replica's own groups (``COUNT_METRICS``: summed over the replicas), "mean" otherwise: per-replica
    means of equal-sized replicas, and values every rank holds alike (the loss, KL, entropy and clip
    fraction after ``reduce_stats``, the gradient norm, the learning rate, data skips)."""
    if key.startswith(("time/", "eq1/")) or key.endswith("_s") or key in MAX_METRICS:
        return "max"
    if key in COUNT_METRICS:
        return "count"
    return "mean"


def _reduce(numbers: dict[str, float], comm: Comm, per_replica: int) -> dict[str, float]:
    """``step_reduction`` of each key over ``comm``, for keys some ranks lack too (a replica without
    video groups has no T-GRPO accuracies): a mean over the ranks that have the key, the maximum over
    them, and counts summed over the ranks and divided by the ``per_replica`` ranks of a replica, which
    hold the same counts. One exchange of the key names and three all-reduces."""
    if comm.size == 1:
        return dict(numbers)
    import torch.distributed as dist

    names: list = [None] * comm.size
    dist.all_gather_object(names, sorted(numbers), group=comm.group)
    keys = sorted(set().union(*names))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    have = torch.tensor([float(k in numbers) for k in keys], dtype=torch.float64, device=device)
    value = torch.tensor([numbers.get(k, 0.0) for k in keys], dtype=torch.float64, device=device)
    high = torch.where(have.bool(), value, -math.inf)
    total, count = comm.all_reduce(value * have), comm.all_reduce(have.clone())
    high = comm.all_reduce(high, op="max")
    out = {}
    for i, key in enumerate(keys):
        kind = step_reduction(key)
        if kind == "max":
            out[key] = float(high[i])
        elif kind == "count":
            out[key] = float(total[i]) / per_replica
        else:
            out[key] = float(total[i] / count[i])
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
