"""Rollout over several processes: which engine decodes which groups, the boundary KV it starts from,
and the responses handed back to the training ranks.

Colocated (D replicas of TP_train GPUs, each decoding as q = TP_train / TP_rollout engines of
TP_rollout GPUs; parallel.dist for the groups):

    replica d's groups ──split in q blocks──▶ engine (d, j) decodes block j     j = share rank
    rollout prefix: the training-TP prefix of ALL the replica's groups (its ranks compute it
        together anyway), its boundary KV [G_d, Hkv/T, P, D] all-gathered along heads inside the share
        group → [G_d, Hkv/Tr, P, D], rollout shard k's heads (the share group's training shards are
        rollout shard k's consecutive pieces), then engine j keeps its block
    after decode: responses, lengths, log-probs all-gathered in the share group (the q engines of the
        replica), padded to the widest response of the whole rollout, so each replica holds its groups

The alternative, a second prefill at TP_rollout with the rollout's own shard of the weights, would
need a second sharded model to run the vision tower and prefill through; the gather costs one
all-gather of the boundary KV per rollout and the same prefill FLOPs per GPU.

Disaggregated (the last ``rollout_gpus`` ranks decode, the others train): the rollout ranks hold the
whole step's groups and split them over their E = rollout_gpus / TP_rollout engines; each engine
computes its own prefix with its own weights at TP_rollout; the results reach every rank in one
all-gather over the world (small: token ids, lengths, log-probs), and each training replica keeps its
groups. Training ranks do not decode: their rollout is that wait.

Sampling: every engine draws the noise of the WHOLE rollout (every row of every engine) from its
generator, seeded alike everywhere, and races on its own rows (rollout.sampler.sample_rows); every
engine stops at the round where all rows of all engines have ended (one all-reduce of a flag per
round over the decoding ranks). So the tokens are those one process decoding the whole batch would
sample, and the generators of all ranks stay in step from rollout to rollout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollplex.models.forward import prefix_forward
from rollplex.parallel.data_parallel import split_range
from rollplex.parallel.dist import Comm, ParallelContext
from rollplex.rollout.decode import EngineShard, SamplingParams
from rollplex.rollout.engine import generate
from rollplex.types import DecodeTimeline, PrefixState, Prompt, RolloutBatch


def gather_heads(prefix: PrefixState, share: Comm) -> PrefixState:
    """The boundary KV of the rollout shard from the training shards of the share group: each layer's
    keys and values [G, Hkv/T, P, D] all-gathered along heads in share-rank order → [G, q·Hkv/T, P, D]
    (parallel.dist: share rank j holds piece j of rollout shard k). The rest is equal on every rank."""
    if share.size == 1:
        return prefix

    def heads(t: torch.Tensor) -> torch.Tensor:
        pieces = torch.empty((share.size, *t.shape), dtype=t.dtype, device=t.device)
        share.all_gather_into(pieces, t.contiguous())
        return torch.cat(pieces.unbind(0), dim=1)

    return PrefixState(
        keys=[heads(k) for k in prefix.keys],
        values=[heads(v) for v in prefix.values],
        prompt_lens=prefix.prompt_lens,
        host_prompt_lens=prefix.host_prompt_lens,
        next_position=prefix.next_position,
        last_logprobs=prefix.last_logprobs,
        content_keys=list(prefix.content_keys),
        attached=False,
    )


def select_groups(prefix: PrefixState, block: range) -> PrefixState:
    """Groups ``block`` (a contiguous range) of ``prefix``: views, no copy."""
    s = slice(block.start, block.stop)
    return PrefixState(
        keys=[k[s] for k in prefix.keys],
        values=[v[s] for v in prefix.values],
        prompt_lens=prefix.prompt_lens[s],
        host_prompt_lens=prefix.host_prompt_lens[s],
        next_position=prefix.next_position[s],
        last_logprobs=prefix.last_logprobs[s],
        content_keys=list(prefix.content_keys[s]),
        attached=False,
    )


def pack(batch: RolloutBatch, rows: int, width: int, pad_id: int, device) -> torch.Tensor:
    """float64 [rows, 2·width + 2] of an engine's results, rows past the batch's zero: responses
    (token ids, exact in float64), log-probs, length, truncated; responses right-padded with ``pad_id``
    and log-probs with 0 to ``width``."""
    out = torch.zeros(rows, 2 * width + 2, dtype=torch.float64, device=device)
    out[:, :width] = pad_id
    n, w = batch.responses.shape
    if n:
        out[:n, :w] = batch.responses.to(device, torch.float64)
        out[:n, width : width + w] = batch.logprobs.to(device, torch.float64)
        out[:n, 2 * width] = batch.response_lens.to(device, torch.float64)
        out[:n, 2 * width + 1] = batch.truncated.to(device, torch.float64)
    return out


@dataclass(frozen=True)
class Unpacked:
    """Rows of packed results: responses int64 [n, W], logprobs [n, W], lengths int64 [n], truncated
    bool [n]."""

    responses: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    truncated: torch.Tensor


def unpack(packed: torch.Tensor, width: int, dtype: torch.dtype) -> Unpacked:
    """The inverse of ``pack`` for rows [n, 2·width + 2]; log-probs in ``dtype``."""
    return Unpacked(
        packed[:, :width].long(),
        packed[:, width : 2 * width].to(dtype),
        packed[:, 2 * width].long(),
        packed[:, 2 * width + 1].bool(),
    )


class RolloutEngines:
    """The rollout of one rank of a parallel run (module docstring).

    Args:
        ctx: this rank's place in the run.
        weights: its rollout weights (parallel.weight_sharing.SharedWeights), None on ranks that only train.
        head: the rollout TP group's hook (TP_rollout > 1), else None.
        vocab: V.
    """

    def __init__(self, ctx: ParallelContext, weights, head, vocab: int):
        self.ctx, self.weights, self.head, self.vocab = ctx, weights, head, vocab
        self.disaggregated = bool(ctx.layout.rollout_gpus)

    def _all_finished(self, done: torch.Tensor) -> torch.Tensor:
        """Every decoding rank's rows ended: one MAX all-reduce of "some row runs on" over the pool."""
        running = (~done).to(torch.int32).reshape(1)
        return self.ctx.pool.all_reduce(running, op="max")[0] == 0

    def _engine_block(self, groups: int) -> tuple[range, int, int]:
        """This engine's groups (a block of the ``groups`` this rank was given), the global index of its
        first group and the rollout's group count over every engine."""
        ctx = self.ctx
        if self.disaggregated:  # rollout ranks hold every group; engines in rank order
            first, tr = ctx.layout.rollout_ranks[0], ctx.layout.tp_rollout
            engines = ctx.layout.rollout_gpus // tr
            block = split_range(groups, engines, (ctx.rank - first) // tr)
            return block, block.start, groups
        block = split_range(groups, ctx.share.size, ctx.share.rank)
        before, total = self._replica_offset(groups)
        return block, before + block.start, total

    def _replica_offset(self, groups: int) -> tuple[int, int]:
        """Groups of the replicas before this one, and of all replicas (an all-gather over dp)."""
        dp = self.ctx.dp
        if dp.size == 1:
            return 0, groups
        counts = torch.zeros(dp.size, dtype=torch.float64, device=self.ctx.device)
        dp.all_gather_into(counts, torch.tensor([float(groups)], dtype=torch.float64, device=self.ctx.device))
        counts = [int(c) for c in counts.tolist()]
        return sum(counts[: dp.rank]), sum(counts)

    def rollout(
        self,
        model,
        prompts: list[Prompt],
        prefix: PrefixState | None,
        *,
        group_size: int,
        params: SamplingParams,
        tokenizer,
        generator: torch.Generator | None,
        before_decode: Callable[[], None] | None = None,
    ) -> RolloutBatch:
        """``group_size`` responses for each of ``prompts`` (this rank's share of the rollout's groups:
        its replica's when it trains, all of them on a disaggregated rollout rank), as
        ``rollout.engine.generate`` returns them in one process.

        Args:
            prefix: the detached training-TP prefix of ``prompts`` (prefill fusion), or None: computed
                here (colocated) or by the rollout ranks themselves (disaggregated).
        """
        ctx, n = self.ctx, group_size
        if not ctx.decodes:
            return self._received(prompts, n, params, tokenizer, before_decode)
        block, first, total = self._engine_block(len(prompts))
        if total == 0:  # no group anywhere (T-GRPO's twins of a batch without video): nothing to decode
            if before_decode is not None:
                before_decode()
            return self._batch(torch.zeros(0, 2, dtype=torch.float64), 0, prompts, n, tokenizer, None)
        mine = None
        if self.disaggregated and block:  # each engine prefills its own groups with its own weights
            mine = _rollout_prefix(model, [prompts[g] for g in block], params)
        elif not self.disaggregated and prompts:  # the replica's ranks prefill all its groups together
            prefix = prefix if prefix is not None else _rollout_prefix(model, prompts, params)
            prefix = gather_heads(prefix, ctx.share)
            mine = select_groups(prefix, block) if block else None
        shard = EngineShard(self.weights, self.head, first * n, total * n, self._all_finished, self.vocab)
        batch = generate(
            model,
            [prompts[g] for g in block],
            mine,
            group_size=n,
            params=params,
            tokenizer=tokenizer,
            generator=generator,
            before_decode=before_decode,
            shard=shard,
            device=ctx.device,
        )
        if self.disaggregated:
            return self._exchanged(batch, prompts, n, params, tokenizer)
        return self._gathered(batch, prompts, n, params, tokenizer)

    def _width(self, local: int) -> int:
        """The widest response of the whole rollout (an all-reduce over the world)."""
        width = torch.tensor([float(local)], device=self.ctx.device)
        return int(self.ctx.world_comm.all_reduce(width, op="max")[0])

    def _gathered(self, batch, prompts, n: int, params: SamplingParams, tokenizer) -> RolloutBatch:
        """Colocated: the q engines' results of this replica, all-gathered in the share group."""
        share = self.ctx.share
        width = self._width(batch.responses.shape[1])
        rows = -(-len(prompts) // share.size) * n  # the largest block
        mine = pack(batch, rows, width, params.pad_id, self.ctx.device)
        everyone = torch.empty((share.size, *mine.shape), dtype=mine.dtype, device=mine.device)
        share.all_gather_into(everyone, mine)
        parts = [everyone[j, : len(split_range(len(prompts), share.size, j)) * n] for j in range(share.size)]
        return self._batch(torch.cat(parts), width, prompts, n, tokenizer, batch)

    def _exchanged(self, batch, prompts, n: int, params: SamplingParams, tokenizer) -> RolloutBatch:
        """Disaggregated, on a rollout rank: every engine's results to every rank (``_everyone``)."""
        engines = self.ctx.layout.rollout_gpus // self.ctx.layout.tp_rollout
        width = self._width(batch.responses.shape[1])
        rows = -(-len(prompts) // engines) * n
        packed = self._everyone(pack(batch, rows, width, params.pad_id, self.ctx.device), len(prompts), n)
        return self._batch(packed, width, prompts, n, tokenizer, batch)

    def _received(self, prompts, n: int, params: SamplingParams, tokenizer, before_decode) -> RolloutBatch:
        """Disaggregated, on a training rank: the rollout ranks' results for this replica's groups."""
        if before_decode is not None:
            before_decode()
        clock = _HostClock()
        before, total = self._replica_offset(len(prompts))
        if total == 0:
            return self._batch(torch.zeros(0, 2, dtype=torch.float64), 0, prompts, n, tokenizer, None)
        engines = self.ctx.layout.rollout_gpus // self.ctx.layout.tp_rollout
        width = self._width(0)
        rows = -(-total // engines) * n
        empty = torch.zeros(rows, 2 * width + 2, dtype=torch.float64, device=self.ctx.device)
        packed = self._everyone(empty, total, n)[before * n : (before + len(prompts)) * n]
        rollout = self._batch(packed, width, prompts, n, tokenizer, None)
        rollout.timeline = clock.timeline()
        return rollout

    def _everyone(self, mine: torch.Tensor, groups: int, n: int) -> torch.Tensor:
        """All engines' packed rows in engine order (an all-gather over the world; each engine's first
        rank's copy), the ``groups`` groups of the rollout."""
        ctx = self.ctx
        everyone = torch.empty((ctx.world, *mine.shape), dtype=mine.dtype, device=mine.device)
        ctx.world_comm.all_gather_into(everyone, mine)
        first, tr = ctx.layout.rollout_ranks[0], ctx.layout.tp_rollout
        engines = ctx.layout.rollout_gpus // tr
        parts = [everyone[first + e * tr, : len(split_range(groups, engines, e)) * n] for e in range(engines)]
        return torch.cat(parts)

    def _batch(
        self, packed, width: int, prompts, n: int, tokenizer, own: RolloutBatch | None
    ) -> RolloutBatch:
        """A RolloutBatch of ``prompts`` from their packed rows (texts decoded here; the timeline and
        setup time are this engine's own)."""
        dtype = own.logprobs.dtype if own is not None and own.logprobs.numel() else torch.float32
        rows = unpack(packed, width, dtype)
        texts = [
            tokenizer.decode(rows.responses[b, : int(rows.lengths[b])].tolist(), skip_special_tokens=True)
            for b in range(rows.responses.shape[0])
        ]
        return RolloutBatch(
            prompts=list(prompts),
            group_size=n,
            responses=rows.responses,
            response_lens=rows.lengths,
            logprobs=rows.logprobs,
            texts=texts,
            truncated=rows.truncated,
            timeline=own.timeline if own is not None else DecodeTimeline(),
            setup_s=own.setup_s if own is not None else 0.0,
        )


def _rollout_prefix(model, prompts: list[Prompt], params: SamplingParams) -> PrefixState:
    """The detached prefix decode starts from (phases.rollout_prefix's definition)."""
    return prefix_forward(
        model, prompts, temperature=params.score_temperature, banned_ids=params.banned_ids, attached=False
    )


class _HostClock:
    """A training rank's wait for the rollout GPUs as a decode timeline: from the start to the end."""

    def __init__(self):
        self.start = time.perf_counter()

    def timeline(self) -> DecodeTimeline:
        return DecodeTimeline([(0, self.start), (0, time.perf_counter())])
