"""Eq. 1 accounting (paper §3.1) from decode timelines, hand-computed, and the auto policy choice."""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import pytest
import torch

from rollplex.loop import train
from rollplex.schedule.critical_path import KEYS, Standalone, alone_seconds_per_step, phase1_terms
from rollplex.schedule.prefix_overlap import (
    CALIBRATION_STEPS,
    CoRunPolicy,
    PrefixOverlapSchedule,
    auto_candidates,
)
from rollplex.types import DecodeTimeline
from tests.test_loop import _config, _metrics, _weights, assets  # noqa: F401  (fixture)


def _timeline(*marks):
    return DecodeTimeline(marks=list(marks))


def test_overlapped_terms_by_hand():
    """Standalone 0.02 s per decode step and 0.7 s of side work; now 32 decode steps from 10.0 to
    11.2 s with side work from 10.0 to 10.8 s."""
    timeline = _timeline((0, 10.0), (16, 10.8), (32, 11.2))
    terms, alone = phase1_terms(timeline, (10.0, 10.8), True, Standalone(0.02, 0.7))
    assert alone == Standalone(0.02, 0.7)
    expected = {
        "eq1/T_D": 0.64,
        "eq1/T_P": 0.7,
        "eq1/T_P_corun": 0.8,
        "eq1/delta_D": 0.56,
        "eq1/span": 1.2,
        "eq1/S": 0.14,
        "eq1/bound": 0.64,
        "eq1/decode_steps": 32,
    }
    assert terms == pytest.approx(expected)


def test_without_a_standalone_step_the_rate_after_the_side_work_stands_in():
    """Decode alone from 10.8 s on: 16 steps in 0.4 s → T_D = 0.025 × 32 = 0.8; T_P unknown."""
    timeline = _timeline((0, 10.0), (16, 10.8), (32, 11.2))
    assert alone_seconds_per_step(timeline, 10.8) == pytest.approx(0.025)
    terms, _ = phase1_terms(timeline, (10.0, 10.8), True, Standalone())
    assert terms["eq1/T_D"] == pytest.approx(0.8) and terms["eq1/delta_D"] == pytest.approx(0.4)
    assert math.isnan(terms["eq1/T_P"]) and math.isnan(terms["eq1/bound"]) and math.isnan(terms["eq1/S"])
    assert alone_seconds_per_step(timeline, 11.5) is None  # side work outlasted decode
    assert math.isnan(phase1_terms(timeline, (10.0, 11.5), True, Standalone())[0]["eq1/T_D"])


def test_sequential_step_measures_the_standalone_figures():
    terms, alone = phase1_terms(_timeline((0, 2.0), (10, 3.0)), (3.0, 3.5), False, Standalone())
    assert alone == Standalone(pytest.approx(0.1), pytest.approx(0.5))
    assert terms == pytest.approx(
        {
            "eq1/T_D": 1.0,
            "eq1/T_P": 0.5,
            "eq1/T_P_corun": 0.5,
            "eq1/delta_D": 0.0,
            "eq1/span": 1.5,
            "eq1/S": 0.0,
            "eq1/bound": 0.5,
            "eq1/decode_steps": 10,
        }
    )


def test_auto_tries_each_policy_twice_then_keeps_the_fastest_median(assets, tmp_path):  # noqa: F811
    cfg = _config(assets, tmp_path, 1, **{"schedule.kind": "auto"})
    schedule = PrefixOverlapSchedule(cfg, torch.device("cpu"))
    candidates = auto_candidates(torch.device("cpu"))
    assert candidates[0] == CoRunPolicy(overlap=False) and schedule.trials == candidates * 2
    spans = {c: [3.0 - i * 0.5, 3.0 - i * 0.5] for i, c in enumerate(candidates)}  # the last is fastest...
    spans[candidates[1]] = [0.1, 9.0]  # ... a single lucky trial does not win: median 4.55
    spans[candidates[0]] = [0.2, 0.3]  # ... two fast trials do
    seen = []
    calibration = CALIBRATION_STEPS
    for _ in range(calibration + 2 * len(candidates) + 2):
        policy, trial = schedule._next_policy(), schedule._trial_due()
        seen.append(policy)
        span = spans[policy].pop(0) if trial else 0.0
        schedule._finish_step(policy, trial, Standalone(0.01, 0.5), policy.overlap, span)
    assert seen[:calibration] == [replace(candidates[0], overlap=False)] * calibration
    assert seen[calibration : calibration + 2 * len(candidates)] == candidates * 2  # round robin
    assert seen[calibration + 2 * len(candidates) :] == [candidates[0]] * 2


def test_auto_keeps_the_simplest_policy_within_the_tolerance_of_the_shortest_span():
    """The first candidate in trial order within ``AUTO_TOLERANCE`` of the shortest median span: the
    spans of two example runs (call 4 keeps overlap with priority, 0.1% behind chunked; call 3 the
    carve-out, 2% ahead of the next); a sequential span within the tolerance keeps the prefixes after
    decode."""
    from rollplex.schedule.prefix_overlap import AUTO_TOLERANCE, choose_policy

    sequential, priority, chunked, carveout = (
        CoRunPolicy(overlap=False),
        CoRunPolicy(),
        CoRunPolicy(chunk_groups=1),
        CoRunPolicy(sm_carveout=66),
    )
    order = (sequential, priority, chunked, carveout)
    assert choose_policy(dict(zip(order, (2.369, 2.302, 2.300, 2.311)))) == priority
    assert choose_policy(dict(zip(order, (2.434, 2.339, 2.334, 2.290)))) == carveout
    assert choose_policy(dict(zip(order, (2.0 * (1 + 0.99 * AUTO_TOLERANCE), 2.0, 2.1, 2.2)))) == sequential
    assert choose_policy(dict(zip(order, (2.0 * (1 + 2 * AUTO_TOLERANCE), 2.0, 2.1, 2.2)))) == priority
    assert choose_policy(dict(zip(order, (2.4, 2.3, 2.2, 2.1))), tolerance=0.0) == carveout
    nan = float("nan")
    assert choose_policy(dict(zip(order, (nan, 2.3, 2.2, nan)))) == chunked  # spans not finite are left out
    with pytest.raises(ValueError, match="no finite trial span"):
        choose_policy({})
    with pytest.raises(ValueError, match="no finite trial span"):
        choose_policy({sequential: nan})


def test_auto_keeps_the_policy_choose_policy_picks_after_its_last_trial(assets, tmp_path):  # noqa: F811
    """The trials' medians go through ``choose_policy``: the chunked candidate 0.1% ahead of overlap
    with priority does not displace it."""
    schedule = PrefixOverlapSchedule(
        _config(assets, tmp_path, 1, **{"schedule.kind": "auto"}), torch.device("cpu")
    )
    spans = dict(zip(auto_candidates(torch.device("cpu")), (2.369, 2.302, 2.300)))
    for policy in schedule.trials:
        schedule._learn(policy, spans[policy])
    assert schedule.policy == CoRunPolicy()


def test_a_resumed_auto_run_chooses_in_trial_order_whatever_order_its_spans_were_saved_in(
    assets,  # noqa: F811
    tmp_path,
):
    """Half the trials, a checkpoint round trip (``torch.save``/``torch.load``) with the spans listed in
    reverse, the other half: overlap with priority 0.1% behind chunked is kept, as in a run that was
    never interrupted (the choice follows the trial plan's order, not the saved spans')."""
    import io

    cfg = _config(assets, tmp_path, 1, **{"schedule.kind": "auto"})
    first = PrefixOverlapSchedule(cfg, torch.device("cpu"))
    spans = dict(zip(auto_candidates(torch.device("cpu")), (2.369, 2.302, 2.300)))
    half = len(first.trials) // 2
    for policy in first.trials[:half]:
        first._learn(policy, spans[policy])
    state = first.state_dict()
    state["timings"] = state["timings"][::-1]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    resumed = PrefixOverlapSchedule(cfg, torch.device("cpu"))
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    for policy in resumed.trials[half:]:
        resumed._learn(policy, spans[policy])
    assert resumed.trials_done == len(resumed.trials) and resumed.policy == CoRunPolicy()


def test_a_resumed_rollplex_run_takes_its_policy_from_its_config_and_auto_its_choice(assets, tmp_path):  # noqa: F811
    """A rollplex run resumed with another co-running setting uses it (it is the user's to change);
    auto resumes with the policy it chose, not a configured one."""
    saved = PrefixOverlapSchedule(
        _config(assets, tmp_path, 1, **{"schedule.kind": "rollplex", "schedule.prefix_chunk_groups": 1}),
        torch.device("cpu"),
    ).state_dict()
    resumed = PrefixOverlapSchedule(
        _config(assets, tmp_path, 1, **{"schedule.kind": "rollplex"}), torch.device("cpu")
    )
    resumed.load_state_dict(saved)
    assert resumed.policy == CoRunPolicy() and saved["policy"]["chunk_groups"] == 1
    auto = PrefixOverlapSchedule(
        _config(assets, tmp_path, 1, **{"schedule.kind": "auto"}), torch.device("cpu")
    )
    chosen = auto.state_dict() | {"policy": asdict(CoRunPolicy(chunk_groups=1))}
    auto.load_state_dict(chosen)
    assert auto.policy == CoRunPolicy(chunk_groups=1)


def test_a_run_cannot_switch_between_auto_and_rollplex_on_resume(assets, tmp_path):  # noqa: F811
    """A run cannot switch between auto and rollplex mid-way: a checkpoint of one schedule is refused by
    the other, naming both, before anything of the state is taken."""

    def make(name):
        return PrefixOverlapSchedule(
            _config(assets, tmp_path, 1, **{"schedule.kind": name}), torch.device("cpu")
        )

    for saved, resumed in (("auto", "rollplex"), ("rollplex", "auto")):
        state, schedule = make(saved).state_dict() | {"calibrated": True, "trials_done": 3}, make(resumed)
        with pytest.raises(
            ValueError, match=f"schedule.kind={resumed}, but the checkpoint's run used {saved}"
        ):
            schedule.load_state_dict(state)
        assert not schedule.calibrated and schedule.trials_done == 0


def test_a_checkpoint_of_the_run_schedule_setting_resumes(assets, tmp_path):  # noqa: F811
    """Checkpoints saved while the setting was ``run.schedule`` hold the same schedule state, its kind
    under "schedule": they resume under ``schedule.kind`` of that kind, and the other kind is refused
    naming the field as it is now."""
    cpu = torch.device("cpu")
    saved = {  # a calibrated rollplex run's schedule state, as trainer_state.pt held it then
        "schedule": "rollplex",
        "calibrated": True,
        "policy": asdict(CoRunPolicy()),
        "trials": [],
        "trials_done": 0,
        "timings": [],
        "alone": asdict(Standalone(0.25, 0.5)),
    }
    resumed = PrefixOverlapSchedule(_config(assets, tmp_path, 1, **{"schedule.kind": "rollplex"}), cpu)
    resumed.load_state_dict(saved)
    assert resumed.calibrated and resumed.alone == Standalone(0.25, 0.5)
    auto = PrefixOverlapSchedule(_config(assets, tmp_path, 1, **{"schedule.kind": "auto"}), cpu)
    with pytest.raises(ValueError, match="schedule.kind=auto, but the checkpoint's run used rollplex"):
        auto.load_state_dict(saved)


def test_auto_trials_sets_the_trials_per_policy(assets, tmp_path):  # noqa: F811
    cfg = _config(assets, tmp_path, 1, **{"schedule.kind": "auto", "schedule.auto_trials": 1})
    schedule = PrefixOverlapSchedule(cfg, torch.device("cpu"))
    assert schedule.trials == auto_candidates(torch.device("cpu"))


def test_metrics_hold_eq1_terms(assets, tmp_path):  # noqa: F811
    """Every rollplex step writes the Eq. 1 terms to metrics.jsonl; T_D is known on overlapped steps
    too (from the calibration steps when no decode step ran alone)."""
    run_dir = train(_config(assets, tmp_path, 3, **{"schedule.kind": "rollplex", "eval.every": 0}))
    rows = [r for r in _metrics(run_dir) if "loss" in r]
    for row in rows:
        assert set(KEYS) <= set(row)
        assert row["eq1/T_P"] > 0 and row["eq1/T_post"] > 0 and row["eq1/T_D"] > 0
    # the first two steps calibrate (prefixes after decode, measured alone), then the prefixes overlap
    # with the second's standalone side work as T_P (the first's held the compilation on a GPU)
    assert [row["schedule/overlap"] for row in rows] == [0, 0, 1]
    assert rows[2]["eq1/T_P"] == rows[1]["eq1/T_P_corun"] != rows[0]["eq1/T_P_corun"]


def test_resumed_auto_run_neither_recalibrates_nor_repeats_trials(assets, tmp_path):  # noqa: F811
    """6 auto steps == 2 + resume + 4 in the policy each step ran (calibration, then the round-robin
    trials; the resumed process's first step runs its prefixes after decode and is no trial, so the
    trials follow it in order), and in weights: the schedule's state is in the checkpoint."""
    extra = {"schedule.kind": "auto", "eval.every": 0, "run.device": "cpu"}
    straight = train(_config(assets, tmp_path / "straight", 6, **extra))
    split = train(_config(assets, tmp_path / "split", 2, **extra))
    train(_config(assets, split, 6, **extra), resume=True)
    policy = lambda run: [  # noqa: E731
        {k: v for k, v in row.items() if k.startswith("schedule/")} for row in _metrics(run) if "loss" in row
    ]
    sequential = policy(straight)[0]
    assert policy(split) == [*policy(straight)[:2], sequential, *policy(straight)[2:5]]
    assert [row["schedule/overlap"] for row in policy(straight)] == [0, 0, 0, 1, 1, 0]
    assert [row["schedule/chunk_groups"] for row in policy(straight)] == [0, 0, 0, 0, 1, 0]
    a, b = _weights(straight), _weights(split)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_resumed_before_it_calibrated_calibrates_in_a_warmed_up_step(assets, tmp_path):  # noqa: F811
    """Standalone figures stand only from a step that was not its process's first (which also
    compiles): a run saved after one step runs two more steps after decode on resume, and its
    overlapped steps take the second of them as T_P; a calibrated run does not calibrate again."""
    extra = {"schedule.kind": "rollplex", "eval.every": 0, "run.device": "cpu", "run.save_every": 1}
    run = train(_config(assets, tmp_path / "run", 1, **extra))
    train(_config(assets, run, 4, **extra), resume=True)
    rows = [r for r in _metrics(run) if "loss" in r]
    assert [r["schedule/overlap"] for r in rows] == [0, 0, 0, 1]
    assert rows[3]["eq1/T_P"] == rows[2]["eq1/T_P_corun"]
    train(_config(assets, run, 5, **extra), resume=True)
    last = [r for r in _metrics(run) if "loss" in r][-1]
    assert last["schedule/overlap"] == 1 and last["eq1/T_P"] == rows[2]["eq1/T_P_corun"]


def test_a_resumed_auto_run_counts_no_trial_in_its_first_step(assets, tmp_path):  # noqa: F811
    """A resumed auto run whose trials remain runs its process's first step after decode and does not
    count it as a trial (it also compiles); a state saved before trial counts were kept continues as
    the trials its spans hold, and calibrates again (its figures came from the step that compiled)."""
    cfg = _config(assets, tmp_path, 1, **{"schedule.kind": "auto", "schedule.auto_trials": 1})
    saved = PrefixOverlapSchedule(cfg, torch.device("cpu"))
    candidates = auto_candidates(torch.device("cpu"))
    for _ in range(CALIBRATION_STEPS + 1):  # calibration, then the first trial
        policy, trial = saved._next_policy(), saved._trial_due()
        saved._finish_step(policy, trial, Standalone(0.01, 0.5), policy.overlap, 1.0)
    resumed = PrefixOverlapSchedule(cfg, torch.device("cpu"))
    resumed.load_state_dict(saved.state_dict())
    assert resumed.calibrated and resumed.trials_done == 1
    first = resumed._next_policy()
    assert not resumed._trial_due() and not first.overlap
    resumed._finish_step(first, False, Standalone(9.0, 9.0), False, 9.0)
    assert resumed.alone == Standalone(0.01, 0.5)  # the compiling step's figures are not taken
    assert resumed._trial_due() and resumed._next_policy() == candidates[1]
    # states of the earlier formats after 3 steps: calibration at step 0 and trials 0 and 1 at steps 1
    # and 2, or calibration at steps 0 and 1 and trial 0 at step 2; the trials done are the spans held
    legacy = PrefixOverlapSchedule(cfg, torch.device("cpu"))
    trials = legacy.trials
    old = {
        "schedule": "auto",
        "step_index": 3,
        "policy": asdict(trials[0]),
        "trials": [asdict(p) for p in trials],
        "timings": [(asdict(trials[0]), [2.0])],
        "alone": asdict(Standalone(9.0, 9.0)),
    }
    legacy.load_state_dict(old)
    assert not legacy.calibrated and legacy.trials_done == 1
    legacy.load_state_dict(old | {"timings": [(asdict(trials[0]), [2.0]), (asdict(trials[1]), [1.0])]})
    assert not legacy.calibrated and legacy.trials_done == 2
    ran = []
    for figures in (Standalone(8.0, 8.0), Standalone(0.01, 0.5), Standalone(0.02, 0.6)):
        policy, trial = legacy._next_policy(), legacy._trial_due()
        ran.append((policy, trial))
        legacy._finish_step(policy, trial, figures, policy.overlap, 1.0)
    sequential = replace(trials[0], overlap=False)
    assert ran == [(sequential, False), (sequential, False), (trials[2], True)]
    assert legacy.calibrated and legacy.alone == Standalone(0.01, 0.5) and legacy.trials_done == 3


@pytest.mark.parametrize("resumed_trials", [1, 3])
def test_resume_keeps_the_trial_plan_it_started_with(assets, tmp_path, resumed_trials):  # noqa: F811
    """A run resumed mid-trials with another ``schedule.auto_trials`` finishes the plan it started: the same
    calibration and round robin as a straight run (after the resumed process's first step, no trial),
    then one kept policy (the choice itself depends on measured spans, so only its being one policy is
    compared)."""
    extra = {"schedule.kind": "auto", "eval.every": 0, "run.device": "cpu", "schedule.auto_trials": 2}
    plan = CALIBRATION_STEPS + 2 * len(auto_candidates(torch.device("cpu")))  # calibration + trials
    straight = train(_config(assets, tmp_path / "straight", plan, **extra))
    split = train(_config(assets, tmp_path / "split", 5, **extra))
    train(_config(assets, split, plan + 3, **{**extra, "schedule.auto_trials": resumed_trials}), resume=True)
    policy = lambda run: [  # noqa: E731
        {k: v for k, v in row.items() if k.startswith("schedule/")} for row in _metrics(run) if "loss" in row
    ]
    ran = policy(split)
    assert ran[:5] == policy(straight)[:5] and ran[5]["schedule/overlap"] == 0
    assert ran[6 : plan + 1] == policy(straight)[5:]
    assert ran[plan + 1] == ran[plan + 2]
