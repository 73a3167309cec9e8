"""The step of a rollout GPU in the disaggregated baseline (``parallel.placement: disaggregated``; the
paper's "Disagg", §4.2). The training GPUs run the configured schedule, whose rollout is a wait for
these GPUs' responses (parallel.engines); these GPUs run:

    rollout   decode the step's groups with the other rollout engines; the responses go to every rank
    temporal  (T-GRPO only) the same for the shuffled-frame twins
    weights   receive θ_{k+1} from the training GPUs, once per optimizer step (parallel.disaggregated)

and are idle while the training GPUs score and update: the cost the paper's comparison shows.
"""

from __future__ import annotations

from rollplex.phases import ActorStats, Roles, rollout_phase
from rollplex.schedule import shuffled_rollout
from rollplex.types import Prompt, ScoredBatch


def rollout_only_step(
    roles: Roles, prompts: list[Prompt], timer
) -> tuple[ScoredBatch | None, list[ActorStats], list[float], dict[str, float]]:
    """One iteration of a rollout-only rank: (None, [], [], the decode time as ``eq1/T_D``)."""
    cfg = roles.config
    with timer.phase("rollout"):
        rollout = rollout_phase(roles, prompts, cfg.rollout.group_size, roles.sampling)
    shuffled_rollout(roles, rollout, timer)
    with timer.phase("weights"):
        for _ in range(cfg.algo.mini_batches):  # one update per mini-batch (rollplex: one)
            roles.parallel.receive_weights()
    timeline = rollout.timeline
    return None, [], [], {"eq1/T_D": timeline.end - timeline.start}
