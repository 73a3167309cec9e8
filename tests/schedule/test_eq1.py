"""Eq. 1 accounting (paper §3.1) from decode timelines, hand-computed, and the auto policy choice."""

from __future__ import annotations

import math

import pytest
import torch

from rollplex.loop import train
from rollplex.schedule.eq1 import KEYS, alone_seconds_per_step, phase1_terms
from rollplex.schedule.rollplex import CoRunPolicy, RollplexSchedule, auto_candidates
from rollplex.types import DecodeTimeline
from tests.test_loop import _config, _metrics, assets  # noqa: F401  (fixture)


def _timeline(*marks):
    return DecodeTimeline(marks=list(marks))


def test_overlapped_terms_by_hand():
    """Prefixes 10.0–10.8 s co-run with a decode that ends at 11.2 s: alone it ran 16 steps in 0.4 s."""
    terms, rate = phase1_terms(_timeline((0, 10.0), (16, 10.8), (32, 11.2)), (10.0, 10.8), True, None)
    assert rate == pytest.approx(0.025)
    expected = {"eq1/T_D": 0.8, "eq1/T_P": 0.8, "eq1/delta_D": 0.4, "eq1/S": 0.4, "eq1/bound": 0.8}
    assert terms == pytest.approx(expected)


def test_prefix_outlasting_decode_uses_the_known_rate():
    """No decode step ran alone: T_D comes from the rate passed in (0.02 s/step × 32 = 0.64 s)."""
    timeline = _timeline((0, 0.0), (16, 0.5), (32, 1.0))
    assert alone_seconds_per_step(timeline, 1.5) is None
    terms, rate = phase1_terms(timeline, (0.0, 1.5), True, 0.02)
    assert rate == 0.02
    assert terms["eq1/T_D"] == pytest.approx(0.64) and terms["eq1/delta_D"] == pytest.approx(0.36)
    assert terms["eq1/S"] == pytest.approx(0.64 + 1.5 - 1.5)
    assert math.isnan(phase1_terms(timeline, (0.0, 1.5), True, None)[0]["eq1/T_D"])


def test_sequential_terms_save_nothing():
    terms, rate = phase1_terms(_timeline((0, 2.0), (10, 3.0)), (3.0, 3.5), False, None)
    assert rate == pytest.approx(0.1)
    assert terms == pytest.approx(
        {"eq1/T_D": 1.0, "eq1/T_P": 0.5, "eq1/delta_D": 0.0, "eq1/S": 0.0, "eq1/bound": 0.5}
    )


def test_auto_tries_each_policy_once_then_keeps_the_fastest(assets, tmp_path):  # noqa: F811
    cfg = _config(assets, tmp_path, 1, **{"run.schedule": "auto"})
    schedule = RollplexSchedule(cfg, torch.device("cpu"))
    candidates = auto_candidates(torch.device("cpu"))
    assert schedule.trials == candidates and candidates[0] == CoRunPolicy(overlap=False)
    seen = []
    fake = {c: 3.0 - i * 0.5 for i, c in enumerate(candidates)}  # the last candidate is fastest
    fake[candidates[1]] = 0.1  # ... except plain overlap
    for _ in range(len(candidates) + 3):
        policy = schedule._next_policy()
        seen.append(policy)
        schedule._learn(policy, fake[policy])
        schedule.step_index += 1
    assert seen[0] == candidates[0]  # warm-up
    assert seen[1 : 1 + len(candidates)] == candidates
    assert seen[1 + len(candidates) :] == [candidates[1]] * 2


def test_metrics_hold_eq1_terms(assets, tmp_path):  # noqa: F811
    """Every rollplex step writes the Eq. 1 terms to metrics.jsonl; T_D is known on overlapped steps
    too (from the calibration step when no decode step ran alone)."""
    run_dir = train(_config(assets, tmp_path, 2, **{"run.schedule": "rollplex", "eval.every": 0}))
    rows = [r for r in _metrics(run_dir) if "loss" in r]
    for row in rows:
        assert set(KEYS) <= set(row)
        assert row["eq1/T_P"] > 0 and row["eq1/T_post"] > 0 and row["eq1/T_D"] > 0
    # the first step calibrates (prefixes after decode, T_D measured alone), then the prefixes overlap
    assert [row["schedule/overlap"] for row in rows] == [0, 1]
