"""Vocabulary-parallel log-probs, entropy and sampling, without gathering the [.., V] logits.

Each rank of a TP group holds logit columns [start, start + V/tp) (``tensor_parallel.ParallelLMHead``).
The definition is rollplex's one (rollout.sampler.token_logprobs, field case B08), float32 math
(float64 for float64 logits):

    s_v = masked(logits)_v / T          (banned vision specials: -inf)
    lse = log Σ_v exp(s_v)              max: all-reduce MAX of the shards' maxima; Σ: all-reduce SUM
    logprob(target) = s_target − lse    s_target: taken on the rank owning it, zeros elsewhere, SUM
    entropy = −Σ_v p_v·(s_v − lse)      the shards' partial sums, all-reduce SUM; banned entries add 0

Three small all-reduces of [..] per call instead of an all-gather of [.., V] (Megatron-LM's
vocabulary-parallel cross entropy, arXiv:1909.08053 §3, applied to a tempered, masked softmax).
Gradients are exact and need no collective: with p = softmax(s), d logprob/d s_v = 1[v = target] − p_v
and d entropy/d s_v = −p_v·(log p_v + entropy), both local to the shard given the all-reduced lse and
entropy (the custom autograd Functions below); d/d logits = d/d s / T, and 0 at banned ids.

Sampling (``race``): the exponential race of rollout.sampler.sample_tokens, token = argmax_v
(log p_T(v) − log E_v), E_v ~ Exp(1). log p_T(v) = s_v − lse differs from s_v by a constant, so each
rank races on its shard's s_v − log E_v with E_v its columns of the FULL-vocabulary noise (every rank of
the group draws the same [B, V] noise from identically seeded generators, as the single process
draws it), then one all-gather of per-rank (shard max, shard Σexp, best key, best s, best index) picks
the winner (ties to the lower index, as argmax does) and its log-prob s − lse. The tokens are the
single process's tokens for the same noise, except where two candidates' keys differ by less than
float32 rounding of the dropped constant. Greedy (T = 0): argmax of the masked logits, log-prob at T = 1,
as race_tokens. Top-p / top-k need the sorted full distribution: there the step's logits [B, V] are
gathered (small at decode: B rows) and rollout.sampler.race_tokens runs on them on every rank.

Hook (``TensorParallelHead``, attached by tensor_parallel.shard_model as ``model.rollplex_tp``; the
rollout's own, at TP_rollout, by weight_sharing.SharedWeights.rollout_head): models.forward and
rollout.decode, which must not import this package, test ``getattr(model, "rollplex_tp", None)`` and:

    models.forward._gathered_logprobs      -> tp.logprobs(hidden, targets, T, banned)
    models.forward._entropy_chunked        -> tp.entropy(hidden, T, banned) per row chunk
    models.forward.prefix_states           -> tp.last_logprobs(hidden[:, -1], T, banned)  [G, V] full
    models.forward._row_chunks             uses model.lm_head.out_features (V/tp: the local width)
    rollout.decode.step_inputs             -> tp.embed(token, embedding_shard)
    rollout.decode.layer_post              -> tp.all_reduce(F.linear(attention, wo)) and the same
                                              after down_proj (row-parallel partial sums)
    rollout.decode.StaticDecoder._sample   -> tp.race(logits_shard, noise rows of the full [B, V])
                                              (rollout.sampler.sample_rows draws the noise)
    rollout.decode.DecodeShape             heads / kv_heads from tp.heads / tp.kv_heads
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollplex.models.logprobs import NEG_INF, token_logprobs
from rollplex.parallel.dist import Comm
from rollplex.parallel.tensor_parallel import gather_from_tp
from rollplex.rollout.sampler import race_tokens


@dataclass(frozen=True)
class VocabShard:
    """Columns [start, start + width) of a vocabulary of ``full`` ids, held by ``comm.rank``."""

    comm: Comm
    start: int
    full: int

    @property
    def width(self) -> int:
        return self.full // self.comm.size


def banned_mask(banned_ids: torch.Tensor, shard: VocabShard, device) -> torch.Tensor:
    """bool [V/tp]: which of this shard's columns are banned. Device ops only (no host sync), so it can
    be captured in a CUDA graph.

    Raises:
        ValueError: ``banned_ids`` is not a 1-D int64 tensor.
    """
    if banned_ids.dtype != torch.int64 or banned_ids.dim() != 1:
        raise ValueError(
            f"banned_ids must be a 1-D int64 tensor, got {banned_ids.dtype} {tuple(banned_ids.shape)}"
        )
    local = banned_ids.to(device) - shard.start
    inside = (local >= 0) & (local < shard.width)
    counts = torch.zeros(shard.width, dtype=torch.int64, device=device)
    counts.index_add_(0, local.clamp(0, shard.width - 1), inside.long())
    return counts > 0


def _scaled(logits: torch.Tensor, banned: torch.Tensor, temperature: float) -> torch.Tensor:
    """s = masked(logits) / T in float32 (float64 for float64 logits), banned columns -inf."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return logits.to(dtype).masked_fill(banned, NEG_INF) / temperature


def _lse(scaled: torch.Tensor, comm: Comm) -> torch.Tensor:
    """log Σ_v exp(s_v) over the whole vocabulary [..]: all-reduced max, then all-reduced Σ exp(s − max)."""
    top = comm.all_reduce(scaled.amax(dim=-1), op="max")
    total = comm.all_reduce(torch.exp(scaled - top[..., None]).sum(dim=-1))
    return top + total.log()


class _TargetLogprobs(torch.autograd.Function):
    """logprob(target) [..] from this shard's logits [.., V/tp] (module docstring); exact backward."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, banned, shard: VocabShard):
        scaled = _scaled(logits, banned, temperature)
        lse = _lse(scaled, shard.comm)
        local = targets - shard.start
        inside = (local >= 0) & (local < shard.width)
        index = local.clamp(0, shard.width - 1)[..., None]
        picked = scaled.gather(-1, index).squeeze(-1).masked_fill(~inside, 0.0)
        picked = shard.comm.all_reduce(picked)
        ctx.save_for_backward(logits, index, inside, lse, banned)
        ctx.temperature = temperature
        return picked - lse

    @staticmethod
    def backward(ctx, grad):
        logits, index, inside, lse, banned = ctx.saved_tensors
        probs = torch.exp(_scaled(logits, banned, ctx.temperature) - lse[..., None])
        d_scaled = -grad[..., None] * probs
        d_scaled.scatter_add_(-1, index, (grad * inside)[..., None].to(d_scaled.dtype))
        d_logits = d_scaled.masked_fill(banned, 0.0) / ctx.temperature
        return d_logits.to(logits.dtype), None, None, None, None


class _Entropy(torch.autograd.Function):
    """Entropy [..] of the tempered, masked distribution from this shard's logits; exact backward."""

    @staticmethod
    def forward(ctx, logits, temperature, banned, shard: VocabShard):
        scaled = _scaled(logits, banned, temperature)
        lse = _lse(scaled, shard.comm)
        logp = (scaled - lse[..., None]).masked_fill(banned, 0.0)
        entropy = shard.comm.all_reduce(-(logp.exp().masked_fill(banned, 0.0) * logp).sum(dim=-1))
        ctx.save_for_backward(logits, lse, entropy, banned)
        ctx.temperature = temperature
        return entropy

    @staticmethod
    def backward(ctx, grad):
        logits, lse, entropy, banned = ctx.saved_tensors
        logp = _scaled(logits, banned, ctx.temperature) - lse[..., None]
        d_scaled = -grad[..., None] * logp.exp() * (logp + entropy[..., None])
        d_logits = d_scaled.masked_fill(banned, 0.0) / ctx.temperature
        return d_logits.to(logits.dtype), None, None, None


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    banned_ids: torch.Tensor,
    shard: VocabShard,
) -> torch.Tensor:
    """log p_T(target) of every row, from this rank's logit columns.

    Args:
        logits: float [..., V/tp], this rank's columns (any float dtype). targets: int64 [...], global ids.
        temperature: T > 0. banned_ids: int64 [K] global ids that get -inf. shard: the columns held.

    Returns:
        float32 [...] (float64 for float64 logits), nats; equal on every rank of ``shard.comm``;
        differentiable (gradient into this rank's logits only, exact).

    Raises:
        ValueError: ``temperature`` not > 0, or malformed ``banned_ids``.
    """
    _check_temperature(temperature)
    banned = banned_mask(banned_ids, shard, logits.device)
    return _TargetLogprobs.apply(logits, targets, temperature, banned, shard)


def vocab_parallel_entropy(
    logits: torch.Tensor, temperature: float, banned_ids: torch.Tensor, shard: VocabShard
) -> torch.Tensor:
    """Entropy (nats) of log_softmax(masked(logits)/T) of every row from this rank's columns [..., V/tp]:
    float32 [...] (float64 for float64 logits), equal on every rank, differentiable (exact).

    Raises:
        ValueError: ``temperature`` not > 0, or malformed ``banned_ids``.
    """
    _check_temperature(temperature)
    banned = banned_mask(banned_ids, shard, logits.device)
    return _Entropy.apply(logits, temperature, banned, shard)


def _pack_race(logits, noise, temperature, banned, shard: VocabShard) -> torch.Tensor:
    """float64 [B, 5] per-shard summary of the race: shard max of s, Σ exp(s − shard max), best key,
    s at the best key, global index of the best key."""
    scaled = _scaled(logits, banned, temperature if temperature > 0 else 1.0)
    key = scaled if noise is None else scaled - noise.log()
    best_key, best = key.max(dim=-1)
    top = scaled.amax(dim=-1)
    top = torch.where(torch.isfinite(top), top, 0.0)  # a shard of banned ids only: Σexp = 0, not NaN
    total = torch.exp(scaled - top[:, None]).sum(dim=-1)
    best_s = scaled.gather(-1, best[:, None]).squeeze(-1)
    index = (best + shard.start).to(torch.float64)
    return torch.stack([top.double(), total.double(), best_key.double(), best_s.double(), index], dim=-1)


def _pick_winner(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], logprobs float32 [B]) from the gathered summaries [tp, B, 5]."""
    top, total, key, best_s, index = packed.unbind(-1)
    peak = top.amax(dim=0)
    lse = peak + (total * torch.exp(top - peak)).sum(dim=0).log()
    winner = key.argmax(dim=0, keepdim=True)  # first maximum: the lower rank holds the lower ids
    token = index.gather(0, winner).squeeze(0).long()
    return token, (best_s.gather(0, winner).squeeze(0) - lse).float()


def vocab_parallel_race(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    *,
    temperature: float,
    banned_ids: torch.Tensor,
    shard: VocabShard,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampled token per row across the vocabulary shards (module docstring), rollout.sampler's
    race_tokens contract with this rank's logit columns.

    Args:
        logits: float [B, V/tp], this rank's columns. noise: E ~ Exp(1) of the FULL vocabulary, float32
            [B, V] (float64 for float64 logits), equal on every rank; None when greedy (T = 0).
        temperature, banned_ids, top_p, top_k: as rollout.sampler.sample_tokens.

    Returns:
        (tokens int64 [B] global ids, logprobs float32 [B] nats), equal on every rank of the group.
        Device ops and collectives only (capturable where the backend's collectives are).
    """
    if (top_p < 1.0 or top_k > 0) and noise is not None:
        full = gather_from_tp(logits, shard.comm)
        return race_tokens(
            full, noise, temperature=temperature, banned_ids=banned_ids, top_p=top_p, top_k=top_k
        )
    banned = banned_mask(banned_ids, shard, logits.device)
    mine = None if noise is None else noise[:, shard.start : shard.start + shard.width]
    packed = _pack_race(logits, mine, temperature, banned, shard)
    gathered = torch.empty((shard.comm.size, *packed.shape), dtype=packed.dtype, device=packed.device)
    shard.comm.all_gather_into(gathered, packed)
    return _pick_winner(gathered)


@dataclass(frozen=True, eq=False)
class TensorParallelHead:
    """What model-side code calls under tensor parallelism (``model.rollplex_tp``; module docstring).

    Fields: ``comm`` (the TP group), ``vocab_start`` and ``full_vocab`` (this rank's logit columns
    start at vocab_start; V = full_vocab), ``heads`` / ``kv_heads`` (per rank), ``lm_head`` (the
    ParallelLMHead; None for a rollout head, whose decode step computes its logits itself).
    """

    comm: Comm
    vocab_start: int
    full_vocab: int
    heads: int
    kv_heads: int
    lm_head: torch.nn.Module | None = None

    @property
    def shard(self) -> VocabShard:
        return VocabShard(self.comm, self.vocab_start, self.full_vocab)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's logit columns [..., V/tp] of hidden states [..., Hd] (the LM head)."""
        assert self.lm_head is not None, "a rollout head computes its logits in the decode step"
        return self.lm_head(hidden)

    def logprobs(
        self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, banned_ids
    ) -> torch.Tensor:
        """log p_T(targets) float32 [...] of hidden [..., Hd] and targets int64 [...]
        (``vocab_parallel_logprobs``); what ``models.forward._gathered_logprobs`` computes."""
        return vocab_parallel_logprobs(self.logits(hidden), targets, temperature, banned_ids, self.shard)

    def entropy(self, hidden: torch.Tensor, temperature: float, banned_ids) -> torch.Tensor:
        """Entropy float32 [...] of the next-token distributions of hidden [..., Hd]."""
        return vocab_parallel_entropy(self.logits(hidden), temperature, banned_ids, self.shard)

    def last_logprobs(self, hidden: torch.Tensor, temperature: float, banned_ids) -> torch.Tensor:
        """Full-vocabulary log-probs float32 [G, V] of a few rows hidden [G, Hd] (the prefixes' last
        positions, kept in PrefixState.last_logprobs): their logits gathered ([G, V], small), then
        rollout.sampler.token_logprobs; differentiable."""
        full = gather_from_tp(self.logits(hidden), self.comm)
        return token_logprobs(full, temperature, banned_ids.to(full.device))

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Embeddings [..., Hd] of global ids from this rank's vocabulary rows ``weight`` [V/tp, Hd]
        (the decode step's rollout shard): masked lookup, then the sum over the group."""
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[..., None], 0.0)
        return self.all_reduce(out)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum over the group of a row-parallel product's partial sums (decode's o_proj and down_proj):
        in place in eager mode (returns it); inside torch.compile a functional all-reduce
        (torch.distributed._functional_collectives), which the compiler can trace and a CUDA graph can
        capture. No autograd (the decode step runs without it)."""
        if self.comm.size == 1:
            return partial
        if torch.compiler.is_compiling():
            from torch.distributed import _functional_collectives as funcol

            return funcol.all_reduce(partial, "sum", self.comm.group)
        return self.comm.all_reduce(partial)

    def race(
        self, logits: torch.Tensor, noise: torch.Tensor | None, **options
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``vocab_parallel_race`` of this rank's columns [B, V/tp] with the full noise [B, V]."""
        return vocab_parallel_race(logits, noise, shard=self.shard, **options)

    def sample(
        self, logits: torch.Tensor, generator: torch.Generator | None = None, **options
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rollout.sampler.sample_tokens for this rank's columns [B, V/tp]: draws the full [B, V] noise
        from ``generator`` (seeded equally on every rank of the group) and races (``race``).

        Raises:
            ValueError: negative temperature.
        """
        temperature = options["temperature"]
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        noise = None
        if temperature > 0:
            dtype = torch.promote_types(logits.dtype, torch.float32)
            shape = (logits.shape[0], self.full_vocab)
            noise = torch.empty(shape, dtype=dtype, device=logits.device).exponential_(generator=generator)
        return self.race(logits, noise, **options)
