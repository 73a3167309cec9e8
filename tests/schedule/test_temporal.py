"""T-GRPO in the loop (Video-R1; field case B14): each video group's shuffled-frame twin is sampled M times
after the ordered rollout, the bonus follows the per-group rule, every schedule gives the same update,
the barriers hold, and a resumed run is bit-for-bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rollplex.phases as phases
from rollplex.algo import rewards as reward_module
from rollplex.algo.rewards import Score
from rollplex.loop import build_run, temporal_metrics, train
from rollplex.observe.metrics import PhaseTimer
from rollplex.schedule import make_step
from rollplex.schedule.prefix_overlap import CALIBRATION_STEPS
from tests.schedule.test_same_update import (
    SCHEDULES,
    _check_barriers,
    assert_moved,
    assert_overlapped,
    assert_same_optimizer,
    assert_same_update,
    first_overlapped_step_events,
    untimed,
)
from tests.test_loop import _config, _metrics, _weights, assets  # noqa: F401  (fixture)

ALPHA, MU = 0.3, 1.0
TEMPORAL = {
    "reward.temporal_alpha": ALPHA,
    "reward.temporal_mu": MU,
    "rollout.group_size": 4,  # M = N / 2 = 2 shuffled-frame responses per group
    "algo.kl_coef": 0.05,
    "eval.every": 0,
    "run.device": "cpu",
}


def _accuracy(completion: str) -> float:
    """Stand-in accuracy: the tiny model answers at random, so its real accuracy is almost always 0 and no
    bonus would be granted; scoring answers by their characters makes groups differ."""
    return float(sum(map(ord, completion)) % 3 == 0)


def _flagged(completion: str) -> bool:
    """Stand-in for an answer whose scoring reports a problem (counted in the reward errors)."""
    return sum(map(ord, completion)) % 5 == 0


@pytest.fixture
def varied_accuracy(monkeypatch):
    """``answer_accuracy`` scores by ``_accuracy`` and flags ``_flagged`` answers, so both bonus outcomes
    occur and errors are counted."""
    scorer = lambda c, record: Score(_accuracy(c), "stand-in flag" if _flagged(c) else None)  # noqa: E731
    monkeypatch.setitem(reward_module._BUILTIN_SCORERS, "answer_accuracy", scorer)


def _rule(ordered: list[list[float]], shuffled: list[list[float]]) -> list[list[float]]:
    """The bonus written out (docs/video-r1-format.md, "Rewards", with μ explicit): alpha for each ordered
    response above 0.1 in a group whose mean ordered accuracy is >= μ × its mean shuffled accuracy."""
    out = []
    for acc, twin in zip(ordered, shuffled, strict=True):
        granted = sum(acc) / len(acc) >= MU * sum(twin) / len(twin)
        out.append([ALPHA if granted and a > 0.1 else 0.0 for a in acc])
    return out


def _recorded_rollouts(monkeypatch) -> list:
    """(prompts, group size, RolloutBatch) of every rollout, appended as they run."""
    calls = []
    real = phases.generate  # every rollout of every schedule samples through phases.generate

    def recording(model, prompts, prefix, *, group_size, **kwargs):
        batch = real(model, prompts, prefix, group_size=group_size, **kwargs)
        calls.append((prompts, group_size, batch))
        return batch

    monkeypatch.setattr(phases, "generate", recording)
    return calls


def _custom_accuracy(completion: str) -> float:
    """The user's accuracy of the ``beside`` case, unlike ``_accuracy``, so using the wrong one shows."""
    return float(sum(map(ord, completion)) % 2 == 0)


@pytest.mark.parametrize("variant", ["builtin", "custom", "custom-beside-builtin"])
def test_the_bonus_follows_the_rule_on_the_shuffled_rollout(
    assets,  # noqa: F811
    tmp_path,
    monkeypatch,
    varied_accuracy,
    variant,
):
    """Serial steps, the compared accuracy weighted 2: the second rollout samples the twins M = 2 times
    (only group 1's on the steps where group 0 has no twin); the bonus equals the rule applied to both
    rollouts' texts scored here; total = 2 · (accuracy + bonus) + format (+ the built-in accuracy, weight
    1, in the last case); the flagged twin answers are counted; both outcomes occur; the T-GRPO metrics
    report the compared values. ``custom``: the compared accuracy is a user's module named by
    reward.temporal_reward (it flags nothing, and scores as ``_accuracy``); ``custom-beside-builtin``: the
    user's module (``_custom_accuracy``) listed after the built-in accuracy, and still the one compared."""
    calls = _recorded_rollouts(monkeypatch)
    overrides = {**TEMPORAL, "reward.weights": "[2.0, 1.0]"}
    accuracy_name, compared, custom = "answer_accuracy", _accuracy, variant != "builtin"
    if custom:  # a module per variant (imported modules are cached)
        module = f"temporal_accuracy_{variant.replace('-', '_')}"
        rule = "% 2 == 0" if variant == "custom-beside-builtin" else "% 3 == 0"
        body = f"def score(completion, record):\n    return float(sum(map(ord, completion)) {rule})\n"
        (tmp_path / f"{module}.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
        accuracy_name = f"{module}:score"
        overrides["reward.functions"] = f"[{accuracy_name}, answer_format]"
        overrides["reward.temporal_reward"] = accuracy_name
    if variant == "custom-beside-builtin":
        compared = _custom_accuracy
        overrides["reward.functions"] = f"[answer_accuracy, {accuracy_name}, answer_format]"
        overrides["reward.weights"] = "[1.0, 2.0, 1.0]"
    cfg = _config(assets, tmp_path / "run", 4, **overrides)
    run = build_run(cfg)
    step = make_step(cfg, run.device)
    granted, errors = [], 0
    for index in range(4):
        calls.clear()
        prompts = run.train.next_batch()
        if index % 2:
            prompts[0] = dataclasses.replace(prompts[0], shuffled=None)  # like an image group
        with_twin = [1] if index % 2 else [0, 1]
        scored = step(run.roles, prompts, PhaseTimer())[0]
        (ordered_prompts, n, ordered), (twins, m, shuffled) = calls
        assert (n, m) == (4, 2) and ordered_prompts == prompts
        assert twins == [prompts[g].shuffled for g in with_twin] and all(t is not None for t in twins)
        accuracy = [[compared(t) for t in ordered.texts[g * 4 : g * 4 + 4]] for g in range(2)]
        twin_accuracy = [[compared(t) for t in shuffled.texts[i * 2 : i * 2 + 2]] for i in range(len(twins))]
        expected = [[0.0] * 4 for _ in range(2)]
        for g, row in zip(with_twin, _rule([accuracy[g] for g in with_twin], twin_accuracy), strict=True):
            expected[g] = row
        assert scored.shuffled.groups == with_twin and scored.shuffled.reward == accuracy_name
        assert scored.shuffled.errors == (0 if custom else sum(_flagged(t) for t in shuffled.texts))
        bonus = scored.rewards.per_function["temporal"].view(2, 4)
        assert torch.allclose(bonus, torch.tensor(expected))
        fmt = scored.rewards.per_function["answer_format"].view(2, 4)
        rest = fmt + (scored.rewards.accuracy.view(2, 4) if variant == "custom-beside-builtin" else 0.0)
        assert torch.allclose(scored.rewards.total.view(2, 4), 2 * (torch.tensor(accuracy) + bonus) + rest)
        ordered_mean = sum(sum(accuracy[g]) for g in with_twin) / (4 * len(with_twin))
        assert temporal_metrics(scored)["temporal/ordered_accuracy"] == pytest.approx(ordered_mean)
        granted += [any(row) for row in expected]
        errors += scored.shuffled.errors
    assert any(granted) and not all(granted) and (custom or errors)


def test_every_schedule_gives_the_same_update(assets, tmp_path, varied_accuracy):  # noqa: F811
    """4 steps with T-GRPO on: every schedule of the same-update test (rollplex with and without the worker
    thread and prefill fusion, chunked, auto) ends with serial's weights and metrics, bitwise; the T-GRPO
    metrics are recorded."""
    runs = {}
    for name, extra in SCHEDULES.items():
        runs[name] = train(_config(assets, tmp_path / name, CALIBRATION_STEPS + 2, **TEMPORAL, **extra))
    assert_overlapped(runs, "rollplex", "fused", "chunked", "green", "auto")
    metrics = assert_same_update(runs)
    rows = [r for r in metrics["serial"] if "loss" in r]
    assert all(r["temporal/video_groups"] == 2.0 for r in rows)
    assert all(
        {
            "temporal/ordered_accuracy",
            "temporal/shuffled_accuracy",
            "temporal/bonus_group_fraction",
            "temporal/reward_errors",
            "reward/temporal",
        }
        <= r.keys()
        for r in rows
    )
    assert all("time/temporal" in r for r in _metrics(runs["serial"]) if "loss" in r)


def test_barriers_hold_with_the_shuffled_rollout(assets, tmp_path):  # noqa: F811
    """The shuffled rollout reads θ_k after the ordered one and before rewards; nothing writes θ_k before
    the optimizer."""
    for name, order in (
        ("serial", ["rollout", "temporal", "rewards", "reference", "actor", "optimizer"]),
        ("rollplex", ["temporal", "rewards", "reference", "actor", "optimizer"]),  # Phase 1 on two threads
    ):
        events = first_overlapped_step_events(
            _config(assets, tmp_path / name, 2, **TEMPORAL, **SCHEDULES[name])
        )
        _check_barriers(events, order)
        temporal_forwards = [e for e in events if e[0] == "forward" and e[1] == "temporal"]
        assert temporal_forwards, name  # the twins really ran through the actor


def test_resume_is_bit_for_bit(assets, tmp_path, varied_accuracy):  # noqa: F811
    """2 steps == 1 step + resume + 1 step with T-GRPO on (the twins' frame order is fixed by content and
    seed, the sampler's state is in the checkpoint)."""
    extra = {**TEMPORAL, "run.save_every": 1, "eval.every": 1}
    straight = train(_config(assets, tmp_path / "straight", 2, **extra))
    split = train(_config(assets, tmp_path / "split", 1, **extra))
    train(_config(assets, split, 2, **extra), resume=True)
    a, b = _weights(straight), _weights(split)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [untimed(r) for r in _metrics(straight)] == [untimed(r) for r in _metrics(split)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_gives_identical_parameters_on_gpu(assets, tmp_path, varied_accuracy):  # noqa: F811
    """On CUDA (bf16, captured decode steps) the shuffled-frame rollout is a second rollout of the step with
    its own group size: the overlapped rollplex schedule still ends with serial's weights, AdamW moments
    and FP32 masters, bitwise."""
    runs = {}
    for name in ("serial", "rollplex"):
        extra = {**TEMPORAL, "run.device": "cuda", **SCHEDULES[name]}
        runs[name] = train(_config(assets, tmp_path / name, 3, **extra))
    serial, rollplex = assert_moved(runs["serial"], assets[0]), _weights(runs["rollplex"])
    assert all(torch.equal(serial[k], rollplex[k]) for k in serial)  # peak memory differs, so no metrics
    assert_same_optimizer(runs["serial"], runs["rollplex"], "rollplex")  # the FP32 masters too
