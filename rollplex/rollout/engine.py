"""Rollout: sample N responses per prompt from a shared prefix, with a static KV cache.

Legend: G groups, N group size, B = G·N rows, R response budget, Hkv key/value heads, D head dim.

The prompt of a group is prefilled once (models.forward.prefix_forward, the rollout prefix) and its
boundary KV is read by all N samples without being copied; generated tokens go into a static
[B, Hkv, R, D] cache per layer. Sampling happens on the device; the host looks at the tokens only every
``eos_check_every`` steps to stop early once every row has finished.

Log-probs are recorded with exactly the trainer's definition (rollout.sampler.token_logprobs over the
full vocabulary at the sampling temperature, vision ids banned: field cases B05, B08). Response lengths
are recorded when a row samples an EOS id; the response mask comes from these lengths, never from
token values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rollplex.models.attention import DecodePlan
from rollplex.models.forward import decode_logits
from rollplex.rollout.sampler import sample_tokens
from rollplex.types import PrefixState, Prompt, RolloutBatch


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings.

    Fields: temperature (0 = greedy), top_p in (0, 1], top_k (0 = off), max_tokens R (response budget),
    eos_ids (any of them ends a response), pad_id (fills finished rows), banned_ids int64 [k].
    """

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    banned_ids: torch.Tensor
    eos_check_every: int = 16


def _empty_cache(
    prefix: PrefixState, rows: int, length: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (rows, prefix.keys[0].shape[1], length, prefix.keys[0].shape[3])
    keys = [torch.empty(shape, dtype=k.dtype, device=k.device) for k in prefix.keys]
    values = [torch.empty(shape, dtype=v.dtype, device=v.device) for v in prefix.values]
    return keys, values


def _sample(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor]:
    return sample_tokens(
        logits,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        banned_ids=params.banned_ids.to(logits.device),
        generator=generator,
    )


@torch.no_grad()
def generate(
    model,
    prompts: list[Prompt],
    prefix: PrefixState,
    *,
    group_size: int,
    params: SamplingParams,
    tokenizer,
    generator: torch.Generator | None = None,
) -> RolloutBatch:
    """Sample ``group_size`` responses for each prompt, continuing from ``prefix`` (detached).

    Args:
        prefix: rollout prefix of the G prompts; its ``last_logprobs`` were computed at the sampling
            temperature (temperature 1 when greedy).
        tokenizer: decodes responses to text (special tokens skipped).
        generator: device generator for reproducible sampling.

    Returns:
        RolloutBatch with responses int64 [B, R] padded with ``pad_id``, lengths, recorded log-probs.
    """
    rows, budget = prefix.num_groups * group_size, params.max_tokens
    device = prefix.last_logprobs.device
    responses = torch.full((rows, budget), params.pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, budget, dtype=prefix.last_logprobs.dtype, device=device)
    lengths = torch.full((rows,), budget, dtype=torch.long, device=device)
    eos = torch.tensor(params.eos_ids, device=device)
    # The rollout prefix log-probs are already at temperature T: sampling them at T=1 is the same law.
    first_params = params if params.temperature == 0 else replace(params, temperature=1.0)
    token, lp = _sample(prefix.last_logprobs.repeat_interleave(group_size, 0), first_params, generator)
    cache_k, cache_v = _empty_cache(prefix, rows, budget)
    plan = DecodePlan(
        prefix.keys, prefix.values, prefix.prompt_lens, group_size, cache_keys=cache_k, cache_values=cache_v
    )
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    for step in range(budget):
        responses[:, step] = torch.where(done, params.pad_id, token)
        logprobs[:, step] = torch.where(done, 0.0, lp)
        finished_now = ~done & torch.isin(token, eos)
        lengths = torch.where(finished_now, step + 1, lengths)
        done = done | finished_now
        if step + 1 == budget or ((step + 1) % params.eos_check_every == 0 and bool(done.all())):
            break
        plan.step = step
        logits = decode_logits(model, token, plan, prefix.next_position)
        token, lp = _sample(logits, params, generator)
    budget_used = int(lengths.max())
    responses, logprobs = responses[:, :budget_used], logprobs[:, :budget_used]
    texts = [
        tokenizer.decode(responses[b, : int(lengths[b])].tolist(), skip_special_tokens=True)
        for b in range(rows)
    ]
    return RolloutBatch(
        prompts=list(prompts),
        group_size=group_size,
        responses=responses,
        response_lens=lengths,
        logprobs=logprobs,
        texts=texts,
        truncated=~done,
    )
