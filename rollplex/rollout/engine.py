"""Rollout: sample N responses per prompt from a shared prefix, with a static KV cache.

Legend: G groups, N group size, B = G·N rows, R response budget, Hkv key/value heads, D head dim.

The prompt of a group is prefilled once (models.forward.prefix_forward, the rollout prefix) and its
boundary KV is read by all N samples without being copied; generated tokens go into a static
[B, Hkv, R, D] cache per layer. Forward, sampling and recording of ``eos_check_every`` steps run on the
device (rollout.decode.StaticDecoder, replays of the step's CUDA graph on CUDA); after each such round
the host reads a round's "every row finished" flag to stop early (on CUDA the previous round's, so the
device never waits), and CUDA events at the round boundaries record how far decode had come when
(``DecodeTimeline``).

Log-probs are recorded with the trainer's definition (models.logprobs.token_logprobs over the full
vocabulary at the sampling temperature, vision ids banned: field cases B05, B08); the fused sampling
race (rollout.sample_kernel, CUDA default) computes the same formula with float32 rounding of its own.
Response lengths are recorded when a row samples an EOS id; the response mask comes from these
lengths, never from token values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from rollplex.rollout.decode import (
    DecodeRecord,
    EngineShard,
    SamplingParams,
    StaticDecoder,
    decode_steps,
)
from rollplex.rollout.sampler import race_tokens, sample_rows
from rollplex.types import DecodeTimeline, PrefixState, Prompt, RolloutBatch


class _DecodeClock:
    """The decode timeline's marks without a host synchronisation per mark: CUDA events on the decode
    stream, converted to host seconds once decode has ended (on the CPU, the host clock at the mark).

    ``lag``: rounds between queuing a round and reading its "every row finished" flag — 1 on CUDA, so
    the device always has the next round queued; 0 on the CPU, where every step is synchronous."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.lag = 1 if self.cuda else 0
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.events: list[tuple[int, torch.cuda.Event]] = []
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record(self.stream)
            self.start.synchronize()
        self.marks = [(0, time.perf_counter())]

    def mark(self, steps: int) -> None:
        if not self.cuda:
            self.marks.append((steps, time.perf_counter()))
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        self.events.append((steps, event))

    def wait(self, index: int) -> None:
        """Block until mark ``index`` (0 = first after the start) has been reached on the device."""
        if self.events:
            self.events[index][1].synchronize()

    def timeline(self) -> DecodeTimeline:
        start = self.marks[0][1]
        marks = list(self.marks)
        for steps, event in self.events:
            event.synchronize()
            marks.append((steps, start + self.start.elapsed_time(event) / 1e3))
        return DecodeTimeline(marks)


def _decode(decoder: StaticDecoder | IdleDecoder, clock: _DecodeClock, flags: torch.Tensor) -> None:
    """Run rounds until every row has finished or the budget is spent. The "all finished" flag of round
    r (``decoder.finished()``: with an ``EngineShard``, every engine's rows) goes to ``flags[r]`` (bool
    [rounds], pinned host memory on CUDA) and is read ``clock.lag`` rounds later, so on CUDA the device
    never waits for the host."""
    lag = clock.lag
    while decoder.rounds < decoder.rounds_total:
        index = decoder.rounds
        steps = decoder.advance()
        flags[index].copy_(decoder.finished(), non_blocking=True)
        clock.mark(steps)
        if index >= lag:
            clock.wait(index - lag)
            if bool(flags[index - lag]):
                break


class IdleDecoder:
    """The decode loop of an engine with no rows in a rollout that other engines decode (an
    ``EngineShard`` whose groups are all elsewhere): each step draws the whole rollout's noise, as the
    other engines' steps do, and each round joins their "every row finished" collective, so the
    generators stay in step and every engine stops at the same round. Nothing is decoded."""

    def __init__(self, params: SamplingParams, shard: EngineShard, generator, device: torch.device):
        self.params, self.shard, self.generator, self.device = params, shard, generator, device
        self.steps_per_round = params.steps_per_round
        self.rounds_total, self.steps_total = decode_steps(params)
        self.rounds = self.steps_done = 0

    def draw(self) -> None:
        """The noise one sampling step of the rollout draws (nothing when greedy)."""
        if self.params.temperature > 0:
            shape = (self.shard.total_rows, self.shard.vocab)
            torch.empty(shape, device=self.device).exponential_(generator=self.generator)

    def advance(self) -> int:
        steps = min(self.steps_per_round, self.steps_total - self.steps_done)
        for _ in range(steps):
            self.draw()
        self.rounds += 1
        self.steps_done += steps
        return self.steps_done

    def finished(self) -> torch.Tensor:
        return self.shard.all_finished(torch.ones((), dtype=torch.bool, device=self.device))


def _first_tokens(prefix: PrefixState, group_size: int, params: SamplingParams, generator, shard):
    """Tokens int64 [B] and log-probs [B] at response position 0, from the prefix's last log-probs."""
    # The rollout prefix log-probs are already at temperature T: sampling them at T=1 is the same law.
    first_params = params if params.temperature == 0 else replace(params, temperature=1.0)
    logprobs = prefix.last_logprobs.repeat_interleave(group_size, 0)
    if shard is None:
        return first_params.sample(logprobs, generator)
    rows = (shard.first_row, shard.total_rows)
    options = first_params.race_options()
    return sample_rows(
        logprobs, rows=rows, vocab=shard.vocab, generator=generator, race=race_tokens, **options
    )


def _idle_rollout(prompts, params, generator, shard: EngineShard, device) -> RolloutBatch:
    """``generate`` for an engine without rows (``IdleDecoder``): an empty batch."""
    idle = IdleDecoder(params, shard, generator, device)
    idle.draw()  # the first token's noise
    clock = _DecodeClock(device)
    if idle.rounds_total:
        _decode(idle, clock, torch.zeros(idle.rounds_total, dtype=torch.bool, pin_memory=clock.cuda))
    empty = torch.zeros(0, 0, dtype=torch.long, device=device)
    return RolloutBatch(
        prompts=list(prompts),
        group_size=0,
        responses=empty,
        response_lens=torch.zeros(0, dtype=torch.long, device=device),
        logprobs=torch.zeros(0, 0, device=device),
        texts=[],
        truncated=torch.zeros(0, dtype=torch.bool, device=device),
        timeline=clock.timeline(),
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
    before_decode: Callable[[], None] | None = None,
    shard: EngineShard | None = None,
    device: torch.device | None = None,
) -> RolloutBatch:
    """Sample ``group_size`` responses for each prompt, continuing from ``prefix`` (detached).

    Args:
        prefix: rollout prefix of the G prompts; its ``last_logprobs`` were computed at the sampling
            temperature (temperature 1 when greedy).
        tokenizer: decodes responses to text (special tokens skipped).
        generator: device generator for reproducible sampling.
        before_decode: called once the decode step is ready (graphs captured) and before the first
            decode step; the Rollplex schedule starts its concurrent prefix work here.
        shard: this process's part of a rollout that several processes decode (``EngineShard``; None in
            one process). ``prefix`` may then hold no group (None), with ``device`` given: the engine
            keeps step with the others (``IdleDecoder``) and returns an empty batch (group_size 0).

    Returns:
        RolloutBatch with responses int64 [B, R] padded with ``pad_id``, lengths, recorded log-probs and
        the decode timeline.
    """
    if prefix is None:
        if before_decode is not None:
            before_decode()
        return _idle_rollout(prompts, params, generator, shard, device)
    rows, budget = prefix.num_groups * group_size, params.max_tokens
    device = prefix.last_logprobs.device
    params = replace(params, banned_ids=params.banned_ids.to(device))
    token, lp = _first_tokens(prefix, group_size, params, generator, shard)
    record = DecodeRecord.empty(rows, params, device, prefix.last_logprobs.dtype)
    record.write(token, lp, torch.zeros(1, dtype=torch.long, device=device))
    decoder, setup_start = None, time.perf_counter()
    if budget > 1:
        decoder = StaticDecoder(model, prefix, group_size, params, record, token, generator, shard)
        decoder.capture()
    setup_s = time.perf_counter() - setup_start if decoder is not None else 0.0
    clock = _DecodeClock(device)
    rounds = decoder.rounds_total if decoder is not None else 0
    flags = torch.zeros(rounds, dtype=torch.bool, pin_memory=clock.cuda)
    if before_decode is not None:
        before_decode()
    if decoder is not None:
        _decode(decoder, clock, flags)
    timeline = clock.timeline()
    lengths, done = record.lengths, record.done
    budget_used = int(lengths.max())
    responses, logprobs = record.responses[:, :budget_used], record.logprobs[:, :budget_used]
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
        setup_s=setup_s,
    )
