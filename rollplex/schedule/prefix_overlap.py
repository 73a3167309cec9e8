"""The prefix-overlap schedule (``schedule.kind`` rollplex or auto; the paper's Rollplex schedule, §2.3,
§3.1): prompt-side work inside the decode window, suffixes after.

    Phase 1  rollout decode of N responses per group (critical path, main thread, high-priority
             stream), from its own rollout prefix — or, with prefill fusion (docs/architecture.md), from the
             actor prefix's detached boundary (one prompt pass fewer);
             concurrently (``schedule.overlap``, schedule.concurrency): reference prefix (detached) and actor
             prefix (attached) once per group under θ_k, on a worker thread and its own CUDA stream,
             started once the decode step is captured
             (T-GRPO: then the shuffled-frame rollout, after decode and the prefixes, as in serial)
    Phase 2  rewards → advantages; reference suffix scoring against the kept reference boundary;
             actor suffix + backward through the kept actor boundary into prefix, merger and vision
    Phase 3  optimizer step → θ_{k+1}

Barriers: nothing writes θ_k before Phase 3 (the optimizer is the only writer and runs after every
backward); a suffix can only start once its responses are fixed and its prefix exists: the suffix calls
take the RolloutBatch and the joined worker's PrefixStates as arguments.

The update is the serial schedule's update: same θ_k, responses, prefixes and loss, so on the CPU the
parameters after any number of steps are bitwise equal to ``serial``'s (tests/schedule). The co-running
policy (overlap or not, decode priority, prefix chunks, SM carve-out, SM partitioning) changes timing
only. Steps
run their prefixes after decode, to measure decode and prefixes alone (Eq. 1's T_D and T_P), until a
step that is not the first of its process has done so (``PrefixOverlapSchedule``: a new run's first two
steps); ``auto`` then tries each policy ``schedule.auto_trials`` times (default 2), round robin, and keeps
the first, in trial order, whose median decode/prefix span is within ``AUTO_TOLERANCE`` of the
shortest (``choose_policy``).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from rollplex.config import Config, uses_prefill_fusion
from rollplex.hooks import span, spanned
from rollplex.phases import (
    ActorStats,
    Roles,
    actor_backward,
    actor_prefixes,
    decode_seed,
    end_step,
    enter_window,
    merged_reference,
    reference_phase,
    reference_prefixes,
    reward_phase,
    rollout_phase,
    rollout_prefix,
    uses_reference,
)
from rollplex.schedule import shuffled_rollout
from rollplex.schedule.concurrency import (
    SideResult,
    SideWork,
    cross_stream_backward,
    decode_stream,
    on_stream,
    stream_sync,
)
from rollplex.schedule.critical_path import Standalone, phase1_terms
from rollplex.types import PrefixState, Prompt, RolloutBatch, ScoredBatch

log = logging.getLogger(__name__)

# Steps a new run spends on calibration (``PrefixOverlapSchedule``): its first step, which also compiles, and
# the next, whose standalone figures stand.
CALIBRATION_STEPS = 2

Prefixes = tuple[PrefixState | None, list[PrefixState] | None]


@dataclass(frozen=True)
class CoRunPolicy:
    """How Phase-1 prefix work shares the device with decode (docs/architecture.md)."""

    overlap: bool = True
    decode_priority: bool = True
    chunk_groups: int = 0
    sm_carveout: int = 0
    prefix_sms: int = 0

    @classmethod
    def from_config(cls, cfg: Config) -> CoRunPolicy:
        s = cfg.schedule
        return cls(s.overlap, s.decode_priority, s.prefix_chunk_groups, s.prefix_sm_carveout, s.prefix_sms)

    @property
    def name(self) -> str:
        if not self.overlap:
            return "sequential"
        parts = ["overlap", "priority" if self.decode_priority else "same-priority"]
        parts += [f"chunk{self.chunk_groups}"] if self.chunk_groups else []
        parts += [f"carveout{self.sm_carveout}"] if self.sm_carveout else []
        parts += [f"sms{self.prefix_sms}"] if self.prefix_sms else []
        return "+".join(parts)


def auto_candidates(device: torch.device) -> list[CoRunPolicy]:
    """The policies ``auto`` tries: prefixes after decode, overlap with decode priority, chunked issue
    (one group at a time), and an SM carve-out keeping half the SMs free of prefix GEMMs.

    Not tried: the reference prefix confined to some SMs by a green context (``schedule.prefix_sms``):
    it cut decode's slowdown but stretched the prefix more, for a longer span than overlap with priority
    alone, and it raised the run's peak memory (benchmarks/README.md)."""
    candidates = [CoRunPolicy(overlap=False), CoRunPolicy(), CoRunPolicy(chunk_groups=1)]
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        candidates.append(CoRunPolicy(sm_carveout=sms // 2))
    return candidates


# auto keeps the first candidate (auto_candidates' order: the simplest first) whose median span is
# within this fraction of the shortest: a policy that adds machinery (chunking, the SM carve-out, an
# experimental torch setting) must save more than 1% of the span over the ones before it. A cost cap
# that favours the simpler policy, not a noise bound: the spans move between two processes by more than
# the policies' differences (benchmarks/README.md), so the choice can still differ from run to run.
AUTO_TOLERANCE = 0.01


def choose_policy(medians: dict[CoRunPolicy, float], tolerance: float = AUTO_TOLERANCE) -> CoRunPolicy:
    """The policy auto keeps: the first of ``medians`` (in trial order, ``auto_candidates``: prefixes
    after decode, overlap with priority, chunked, SM carve-out) whose median decode/prefix span
    (seconds) is at most ``(1 + tolerance)`` times the shortest (``AUTO_TOLERANCE``: a cost cap that
    favours the simpler policy). By the trials' medians the kept policy is no slower than any
    candidate before it, and at most ``tolerance`` slower than the fastest. Spans that are not finite
    are left out.

    Raises:
        ValueError: no finite span.
    """
    finite = {p: span for p, span in medians.items() if math.isfinite(span) and span >= 0}
    if not finite:
        raise ValueError(f"auto schedule: no finite trial span to choose from ({list(medians.values())})")
    shortest = min(finite.values())
    return next(p for p, span in finite.items() if span <= shortest * (1 + tolerance))


def _chunks(prompts: list[Prompt], size: int) -> list[tuple[int, list[Prompt]]]:
    """(index of the chunk's first group, its prompts), ``size`` groups at a time (0 = all)."""
    size = size if size > 0 else len(prompts)
    return [(i, prompts[i : i + size]) for i in range(0, len(prompts), size)]


def _prefixes(
    roles: Roles,
    prompts: list[Prompt],
    actor: bool,
    chunk_groups: int,
    barrier: Callable[[], None] | None = None,
) -> Prefixes:
    """Phase-1 prompt work: the merged reference prefix (or None without KL) and, if ``actor``, the
    attached actor prefix of every group; issued ``chunk_groups`` groups at a time (0 = all), calling
    ``barrier`` (default: wait for the current stream) after each chunk."""
    device = roles.banned_ids.device
    reference_states, actor_states = [], []
    for first, chunk in _chunks(prompts, chunk_groups):
        if uses_reference(roles):
            reference_states += reference_prefixes(roles, chunk)
        if actor:
            actor_states += actor_prefixes(roles, chunk, first)
        if chunk_groups:
            barrier() if barrier is not None else stream_sync(device)
    return merged_reference(reference_states), actor_states if actor else None


def _boundary_tensors(result: SideResult) -> list:
    reference, actor = result.value
    states = ([reference] if reference is not None else []) + (actor or [])
    return [t for s in states for t in (*s.keys, *s.values, s.last_logprobs, s.prompt_lens, s.next_position)]


@dataclass
class Phase1:
    """What Phase 1 hands to Phase 2, and how long it took."""

    rollout: RolloutBatch
    reference: PrefixState | None
    actor: list[PrefixState]
    makespan: float
    prefix_span: tuple[float, float]
    overlapped: bool
    prefix_sms: int = 0  # SMs of the green context the reference prefix started on (0: every SM)


def _sequential(roles, prompts, seed, side, timer) -> tuple[RolloutBatch, Prefixes, tuple[float, float], int]:
    n, sampling = roles.config.rollout.group_size, roles.sampling
    with timer.phase("rollout"):
        rollout = rollout_phase(roles, prompts, n, sampling, prefix=seed)
    start = timer.now()
    with timer.phase("prefix"):
        prefixes = side()
    return rollout, prefixes, (start, timer.now()), 0


def _overlapped(
    roles, prompts, seed, side, timer, policy
) -> tuple[RolloutBatch, Prefixes, tuple[float, float], int]:
    """Decode on the main thread while ``side()`` runs on the worker, started once decode is ready; also
    returns the SMs the worker's green context got (0: none)."""
    n, sampling, device = roles.config.rollout.group_size, roles.sampling, roles.banned_ids.device
    stream = decode_stream(device) if policy.decode_priority and device.type == "cuda" else None
    carveout = policy.sm_carveout if sampling.cuda_graphs else 0  # eager decode would be carved out too
    work = spanned("rollplex/phase/prefix")(lambda: side(worker.chunk_barrier))
    worker = SideWork(work, device, sm_carveout=carveout, sms=policy.prefix_sms)
    start = timer.now()
    if seed is None:
        # the rollout prefill on the main stream, not the decode stream: the caching allocator reuses
        # freed memory only on the stream that allocated it, and Phase 2 runs on the main stream
        seed = rollout_prefix(roles, prompts, sampling)
    with on_stream(stream), span("rollplex/phase/rollout"):
        try:
            rollout = rollout_phase(roles, prompts, n, sampling, prefix=seed, before_decode=worker.start)
        except BaseException:
            worker.wait()  # never leave prefix work running against θ_k behind an error
            raise
        stream_sync(device)
    worker.decode_done()  # prefix work left over gets the whole GPU
    result = worker.join(_boundary_tensors)
    timer.record("rollout", start, rollout.timeline.end, "decode")
    timer.record("prefix", result.start, result.end, "prefix")
    return rollout, result.value, (result.start, result.end), worker.green_sms


def phase1(roles: Roles, prompts: list[Prompt], timer, policy: CoRunPolicy) -> Phase1:
    """Rollout plus the reference and actor prefixes under ``policy``."""
    start = timer.now()
    fused, seed = None, None
    if uses_prefill_fusion(roles.config):  # auto: where the parallel layout allows it
        with timer.phase("prefix"):
            fused = actor_prefixes(roles, prompts)
        seed = decode_seed(fused)

    def side(barrier=None):
        return _prefixes(roles, prompts, fused is None, policy.chunk_groups, barrier)

    if policy.overlap:
        rollout, (reference, actor), span, sms = _overlapped(roles, prompts, seed, side, timer, policy)
    else:
        rollout, (reference, actor), span, sms = _sequential(roles, prompts, seed, side, timer)
    actor = fused if fused is not None else actor
    return Phase1(rollout, reference, actor, timer.now() - start, span, policy.overlap, sms)


class PrefixOverlapSchedule:
    """The prefix-overlap step (``schedule.kind`` rollplex or auto) with what it learns across steps: the
    standalone decode and side-work times behind Eq. 1's T_D and T_P, and for ``auto`` the policy
    trials and the choice.

    Calibration: steps run the side work after decode, measuring decode and side work alone, until a
    step that is not the first of its process has done so. The first step of a process also compiles
    the layers and captures the decode step (its side work takes many times as long as in a warmed-up
    process), so its figures stand only until such a step replaces them. A
    new run therefore calibrates on its first ``CALIBRATION_STEPS`` steps; a resumed, calibrated run
    keeps the figures of its checkpoint. auto's trials follow calibration; a resumed run whose trials
    are not done runs its first step after decode without counting it as a trial, so no trial's span
    holds the compilation.
    """

    def __init__(self, cfg: Config, device: torch.device):
        self.policy = CoRunPolicy.from_config(cfg)
        self.name = cfg.schedule.kind  # "rollplex" or "auto" (schedule.make_step)
        self.auto = self.name == "auto"
        self.trials: list[CoRunPolicy] = []
        self.timings: dict[CoRunPolicy, list[float]] = {}
        if self.auto:
            self.trials = auto_candidates(device) * cfg.schedule.auto_trials
            self.policy = self.trials[0]
        self.alone = Standalone()
        self.calibrated = False  # standalone figures from a step that was not its process's first
        self.trials_done = 0
        self.process_steps = 0  # steps run by this process (not saved)

    def _trial_due(self) -> bool:
        """Whether the next step is one of auto's trials."""
        return self.calibrated and self.trials_done < len(self.trials) and self.process_steps > 0

    def _next_policy(self) -> CoRunPolicy:
        """The side work after decode until calibrated, and on a resumed run's first step while trials
        remain; then ``auto`` tries each candidate ``schedule.auto_trials`` times, round robin, and keeps the
        one ``choose_policy`` picks; otherwise the configured policy."""
        if self._trial_due():
            return self.trials[self.trials_done]
        if not self.calibrated or self.trials_done < len(self.trials):
            return replace(self.policy, overlap=False)
        return self.policy

    def _keep_standalone(self, alone: Standalone, overlapped: bool) -> None:
        """Take a step's standalone figures (``critical_path.phase1_terms``) unless they come from the first step
        of this process and figures are already known: that step also compiled."""
        if overlapped:
            return
        if self.process_steps > 0:
            self.alone, self.calibrated = alone, True
        elif self.alone.side_seconds is None:
            self.alone = alone

    def _finish_step(
        self, policy: CoRunPolicy, trial: bool, alone: Standalone, overlapped: bool, span: float
    ) -> None:
        """What a step leaves: its standalone figures (``_keep_standalone``), a trial's span, the process's step count."""
        self._keep_standalone(alone, overlapped)
        if trial:
            self._learn(policy, span)
        self.process_steps += 1

    def _learn(self, policy: CoRunPolicy, span: float) -> None:
        """Record a trial's decode/side-work span; after the last trial keep the policy ``choose_policy``
        picks from the median spans (the span is the only part of the step a policy changes)."""
        self.timings.setdefault(policy, []).append(span)
        self.trials_done += 1
        if self.trials_done == len(self.trials):
            order = dict.fromkeys([*self.trials, *self.timings])  # trial order, whatever was loaded
            medians = {p: statistics.median(self.timings[p]) for p in order if p in self.timings}
            self.policy = choose_policy(medians)
            table = ", ".join(f"{p.name} {t:.3f} s" for p, t in medians.items())
            log.info("auto schedule: decode/prefix span %s; keeping %s", table, self.policy.name)

    def state_dict(self) -> dict:
        """What the schedule has learned (for checkpoints): whether it is calibrated, policy, the trial
        plan, the trials run and their spans, standalone times."""
        return {
            "schedule": self.name,
            "calibrated": self.calibrated,
            "policy": asdict(self.policy),
            "trials": [asdict(p) for p in self.trials],
            "trials_done": self.trials_done,
            "timings": [(asdict(p), list(t)) for p, t in self.timings.items()],
            "alone": asdict(self.alone),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s output: a resumed run neither recalibrates, once calibrated,
        nor repeats trials, and keeps the trial plan it started with even if ``schedule.auto_trials`` changed
        on resume. auto keeps the policy it chose; a rollplex run takes its policy from the config it
        resumes with. A state saved before calibration and trial counts were kept is read as not
        calibrated (its figures came from a step that compiled) and with as many trials done as it
        holds spans.

        Raises:
            ValueError: the state is of the other schedule (auto against rollplex): a run cannot switch
                between the two mid-way.
        """
        saved, current = state.get("schedule"), self.name
        if saved is not None and saved != current:
            raise ValueError(
                f"schedule.kind={current}, but the checkpoint's run used {saved}: resume with "
                f"schedule.kind={saved}, or start a new run"
            )
        self.calibrated = bool(state.get("calibrated", False))
        if self.auto:
            self.policy = CoRunPolicy(**state["policy"])
            if "trials" in state:
                self.trials = [CoRunPolicy(**p) for p in state["trials"]]
            self.timings = {CoRunPolicy(**p): list(t) for p, t in state["timings"]}
            self.trials_done = int(
                state.get("trials_done", min(sum(map(len, self.timings.values())), len(self.trials)))
            )
        self.alone = Standalone(**state["alone"])

    def __call__(
        self, roles: Roles, prompts: list[Prompt], timer
    ) -> tuple[ScoredBatch, list[ActorStats], list[float], dict[str, float]]:
        """One iteration in the Rollplex order. Returns the scored batch, actor statistics, gradient
        norms and the step's schedule metrics (Eq. 1 terms, policy)."""
        cfg = roles.config
        policy, trial = self._next_policy(), self._trial_due()
        enter_window(roles, "rollout")
        first = phase1(roles, prompts, timer, policy)
        shuffled = shuffled_rollout(roles, first.rollout, timer)
        post_start = timer.now()
        enter_window(roles, "scoring")
        with timer.phase("rewards"):
            scored = reward_phase(roles, first.rollout, shuffled)
        with timer.phase("reference"):
            scored = reference_phase(roles, scored, prefix=first.reference)
        enter_window(roles, "backward")
        with timer.phase("actor"), cross_stream_backward():
            stats = [actor_backward(roles, scored, list(range(len(prompts))), None, prefixes=first.actor)]
        enter_window(roles, "update")
        with timer.phase("optimizer"):
            norms = [roles.optimizer.clip_and_step(cfg.optim.max_grad_norm)]
        end_step(roles)
        terms, alone = phase1_terms(first.rollout.timeline, first.prefix_span, first.overlapped, self.alone)
        self._finish_step(policy, trial, alone, first.overlapped, terms["eq1/span"])
        extra = {**terms, "eq1/T_post": timer.now() - post_start, "eq1/phase1": first.makespan}
        extra["schedule/overlap"] = float(policy.overlap)
        extra["schedule/chunk_groups"] = float(policy.chunk_groups)
        extra["schedule/sm_carveout"] = float(policy.sm_carveout)
        extra["schedule/prefix_sms"] = float(first.prefix_sms)
        return scored, stats, norms, extra
