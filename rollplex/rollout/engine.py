"""Rollout: sample N responses per prompt from a shared prefix, with a static KV cache.

Legend: G groups, N group size, B = G·N rows, R response budget, Hkv key/value heads, D head dim.

The prompt of a group is prefilled once (models.forward.prefix_forward, the rollout prefix) and its
boundary KV is read by all N samples without being copied; generated tokens go into a static
[B, Hkv, R, D] cache per layer (rollout.decode.StaticDecoder, replayed as CUDA graphs on CUDA).
Sampling happens on the device; the host looks at the tokens only every ``eos_check_every`` steps to
stop early once every row has finished, and records there how far decode has come (``DecodeTimeline``).

Log-probs are recorded with exactly the trainer's definition (rollout.sampler.token_logprobs over the
full vocabulary at the sampling temperature, vision ids banned: field cases B05, B08). Response lengths
are recorded when a row samples an EOS id; the response mask comes from these lengths, never from
token values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rollplex.rollout.decode import StaticDecoder
from rollplex.rollout.sampler import sample_tokens
from rollplex.types import DecodeTimeline, PrefixState, Prompt, RolloutBatch


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings.

    Fields: temperature (0 = greedy), top_p in (0, 1], top_k (0 = off), max_tokens R (response budget),
    eos_ids (any of them ends a response), pad_id (fills finished rows), banned_ids int64 [k],
    eos_check_every (tokens between host checks for "every row finished"), cuda_graphs (replay the
    decode step as CUDA graphs), compile (torch.compile the step before capture), graph_window (own-key
    window granularity of the captured steps, tokens), attention (decode attention backend, "auto",
    "dense" or "triton"; rollout.decode.StaticDecoder), fused_projections (one q/k/v and one gate/up
    product per layer from concatenated weight copies).
    """

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    banned_ids: torch.Tensor
    eos_check_every: int = 16
    cuda_graphs: bool = True
    compile: bool = False
    graph_window: int = 128
    attention: str = "auto"
    fused_projections: bool = False

    @classmethod
    def from_config(
        cls, rollout, eos_ids: tuple[int, ...], pad_id: int, banned_ids: torch.Tensor
    ) -> SamplingParams:
        """Settings of a ``RolloutConfig`` (config.rollout) with the model's special ids."""
        return cls(
            rollout.temperature,
            rollout.top_p,
            rollout.top_k,
            rollout.max_response_tokens,
            eos_ids,
            pad_id,
            banned_ids,
            cuda_graphs=rollout.cuda_graphs,
            compile=rollout.compile_decode,
            graph_window=rollout.graph_window,
            attention=rollout.decode_attention,
            fused_projections=rollout.fused_projections,
        )


def _sample(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor]:
    return sample_tokens(
        logits,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        banned_ids=params.banned_ids.to(logits.device),
        generator=generator,
    )


def _mark(timeline: DecodeTimeline, steps: int, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    timeline.marks.append((steps, time.perf_counter()))


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
    before_decode: Callable[[], None] | None = None,
) -> RolloutBatch:
    """Sample ``group_size`` responses for each prompt, continuing from ``prefix`` (detached).

    Args:
        prefix: rollout prefix of the G prompts; its ``last_logprobs`` were computed at the sampling
            temperature (temperature 1 when greedy).
        tokenizer: decodes responses to text (special tokens skipped).
        generator: device generator for reproducible sampling.
        before_decode: called once the decode step is ready (graphs captured) and before the first
            decode step; the Rollplex schedule starts its concurrent prefix work here.

    Returns:
        RolloutBatch with responses int64 [B, R] padded with ``pad_id``, lengths, recorded log-probs and
        the decode timeline.
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
    decoder = None
    if budget > 1:
        decoder = StaticDecoder(
            model,
            prefix,
            group_size,
            budget,
            graphs=params.cuda_graphs,
            compile=params.compile,
            window=params.graph_window,
            attention=params.attention,
            fused_projections=params.fused_projections,
        )
        decoder.capture()
    timeline = DecodeTimeline()
    _mark(timeline, 0, device)
    if before_decode is not None:
        before_decode()
    done, decoded = torch.zeros(rows, dtype=torch.bool, device=device), 0
    for step in range(budget):
        responses[:, step] = torch.where(done, params.pad_id, token)
        logprobs[:, step] = torch.where(done, 0.0, lp)
        finished_now = ~done & torch.isin(token, eos)
        lengths = torch.where(finished_now, step + 1, lengths)
        done = done | finished_now
        if step + 1 == budget:
            break
        if (step + 1) % params.eos_check_every == 0:
            all_done = bool(done.all())
            timeline.marks.append((decoded, time.perf_counter()))
            if all_done:
                break
        token, lp = _sample(decoder.step(token, step), params, generator)
        decoded += 1
    _mark(timeline, decoded, device)
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
        timeline=timeline,
    )
