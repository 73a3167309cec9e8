"""The critical-path terms of paper Eq. 1 (paper §3.1), measured per step.

    T_rollplex = max(T_D + ΔD, T_P) + T_post        saving over serial  S = min(T_P − ΔD, T_D)

T_D     standalone decode time: the decode rate of the latest step whose prefixes ran after decode
        and that was not the first of its process (until there is one, the run's first step;
        schedule.prefix_overlap.PrefixOverlapSchedule: a new run's second step) × this step's decode steps
T_P     standalone time of the Phase-1 side work (reference prefix, and the actor prefixes unless
        prefill fusion computed them before decode), from that same step
T_P_corun  the side work's span while co-running with decode
ΔD      decode slowdown from co-running: decode as run − T_D
span    the decode/side-work makespan (from the first start to the last end of the two)
S       measured saving: T_D + T_P − span; bound: min(T_D, T_P)
T_post  rewards + suffixes + backward + optimizer (filled in by the schedule)

Without a standalone measurement yet, the decode rate after the side work ended stands in for T_D (it
overestimates slightly: late decode steps attend over more keys), and T_P is NaN. The standalone
figures come from another batch than the step they are applied to; with prompts of varying length they
are estimates. All times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollplex.types import DecodeTimeline

KEYS = ("eq1/T_D", "eq1/T_P", "eq1/delta_D", "eq1/T_post", "eq1/S", "eq1/bound")


@dataclass(frozen=True)
class Standalone:
    """Decode and side work measured alone (a step that ran the side work after decode)."""

    seconds_per_decode_step: float | None = None
    side_seconds: float | None = None


def alone_seconds_per_step(timeline: DecodeTimeline, side_end: float) -> float | None:
    """Seconds per decode step over the marks at or after ``side_end`` (None with fewer than one decode
    step between the first such mark and the last)."""
    after = [(steps, t) for steps, t in timeline.marks if t >= side_end]
    if len(after) < 2 or after[-1][0] <= after[0][0]:
        return None
    return (after[-1][1] - after[0][1]) / (after[-1][0] - after[0][0])


def phase1_terms(
    timeline: DecodeTimeline, side_span: tuple[float, float], overlapped: bool, alone: Standalone
) -> tuple[dict[str, float], Standalone]:
    """Eq. 1 terms of one Phase 1, and the standalone figures to use from now on.

    Args:
        timeline: the rollout's decode timeline.
        side_span: (start, end) of the Phase-1 side work (``time.perf_counter`` seconds).
        overlapped: whether the side work co-ran with decode.
        alone: the latest standalone figures.

    Returns:
        ({"eq1/T_D", "eq1/T_P", "eq1/T_P_corun", "eq1/delta_D", "eq1/S", "eq1/bound", "eq1/span",
        "eq1/decode_steps": value}, updated standalone figures). Unknown terms are NaN.

    Example: standalone 0.02 s per decode step and 0.7 s of side work; now 32 decode steps from 10.0
    to 11.2 s with side work from 10.0 to 10.8 s: T_D 0.64, ΔD 0.56, T_P 0.7, span 1.2,
    S = 0.64 + 0.7 − 1.2 = 0.14, bound 0.64.
    """
    decode, steps = timeline.end - timeline.start, timeline.steps
    corun = side_span[1] - side_span[0]
    if not overlapped:
        alone = Standalone(decode / steps if steps else alone.seconds_per_decode_step, corun)
        t_d, t_p, span = decode, corun, decode + corun
    else:
        rate = alone.seconds_per_decode_step or alone_seconds_per_step(timeline, side_span[1])
        t_d = rate * steps if rate is not None else math.nan
        t_p = alone.side_seconds if alone.side_seconds is not None else math.nan
        span = max(timeline.end, side_span[1]) - min(timeline.start, side_span[0])
    terms = {
        "eq1/T_D": t_d,
        "eq1/T_P": t_p,
        "eq1/T_P_corun": corun,
        "eq1/delta_D": decode - t_d,
        "eq1/S": t_d + t_p - span,
        "eq1/bound": math.nan if math.isnan(t_d) or math.isnan(t_p) else min(t_d, t_p),
        "eq1/span": span,
        "eq1/decode_steps": float(steps),
    }
    return terms, alone
