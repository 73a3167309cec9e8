"""The critical-path terms of paper Eq. 1, measured per step (DESIGN.md §2).

    T_rollplex = max(T_D + ΔD, T_P) + T_post        saving over serial  S = min(T_P − ΔD, T_D)

T_D   standalone decode time (what decode takes alone)
T_P   makespan of the Phase-1 prefixes (reference + actor, and the fused rollout prefix)
ΔD    decode slowdown from co-running the prefixes
T_post  rewards + suffixes + backward + optimizer
S     measured saving: T_D + T_P − (Phase-1 makespan, ``eq1/phase1``); bound: min(T_D, T_P)

Decode is timed at the synchronisation points it already has (types.DecodeTimeline). When the prefixes
finish before decode does, the decode rate after they finished is its standalone rate, so
T_D = (seconds per step alone) × steps; otherwise the last standalone rate measured (a sequential step,
or an earlier step) stands in. All times in seconds.
"""

from __future__ import annotations

import math

from rollplex.types import DecodeTimeline

KEYS = ("eq1/T_D", "eq1/T_P", "eq1/delta_D", "eq1/T_post", "eq1/S", "eq1/bound")


def alone_seconds_per_step(timeline: DecodeTimeline, prefix_end: float) -> float | None:
    """Seconds per decode step over the marks at or after ``prefix_end`` (None with fewer than one
    decode step between the first such mark and the last)."""
    after = [(steps, t) for steps, t in timeline.marks if t >= prefix_end]
    if len(after) < 2 or after[-1][0] <= after[0][0]:
        return None
    return (after[-1][1] - after[0][1]) / (after[-1][0] - after[0][0])


def phase1_terms(
    timeline: DecodeTimeline,
    prefix_span: tuple[float, float],
    overlapped: bool,
    seconds_per_step: float | None,
) -> tuple[dict[str, float], float | None]:
    """Eq. 1 terms of one Phase 1, and the standalone decode rate to use next time.

    Args:
        timeline: the rollout's decode timeline.
        prefix_span: (start, end) of the Phase-1 prefix work.
        overlapped: whether the prefixes co-ran with decode.
        seconds_per_step: the last standalone decode rate known (None if none yet).

    Returns:
        ({"eq1/T_D", "eq1/T_P", "eq1/delta_D", "eq1/S", "eq1/bound": seconds}, standalone seconds per
        step measured now, else the one passed in). Unknown terms are NaN.

    Example: decode marks (0, 10.0), (16, 10.8), (32, 11.2) with prefixes from 10.0 to 10.8 overlapped:
        alone 0.025 s/step → T_D 0.8, ΔD 0.4, T_P 0.8, S = 0.8 + 0.8 − 1.2 = 0.4, bound 0.8.
    """
    decode = timeline.end - timeline.start
    t_p = prefix_span[1] - prefix_span[0]
    if overlapped:
        rate = alone_seconds_per_step(timeline, prefix_span[1]) or seconds_per_step
        t_d = rate * timeline.steps if rate is not None else math.nan
        makespan = max(timeline.end, prefix_span[1]) - min(timeline.start, prefix_span[0])
    else:
        rate = decode / timeline.steps if timeline.steps else seconds_per_step
        t_d, makespan = decode, decode + t_p
    terms = {
        "eq1/T_D": t_d,
        "eq1/T_P": t_p,
        "eq1/delta_D": decode - t_d,
        "eq1/S": t_d + t_p - makespan,
        "eq1/bound": min(t_d, t_p),
    }
    return terms, rate
