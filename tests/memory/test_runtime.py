"""A run's memory (memory.runtime) end to end on the CPU: training with the optimizer state in the host
pool, the reference paged and the actor prefixes' saved tensors offloaded is bitwise the all-resident
run; a run whose plan does not fit stops before it writes anything; the trace carries the memory
counters."""

from __future__ import annotations

import json

import pytest
import torch

from rollplex.loop import train
from rollplex.observe.metrics import TRACE_FILE
from rollplex.schedule.prefix_overlap import CALIBRATION_STEPS
from tests.schedule.test_same_update import SCHEDULES, assert_moved, assert_same_optimizer, step_rows
from tests.test_loop import _config, _metrics, _weights, assets  # noqa: F401  (fixture)

# every mechanism on: all optimizer chunks in the host pool (1 MiB chunks: several of them), the
# reference paged out of its windows, the actor prefixes' saved tensors in the pool
MANAGED = {
    "memory.optimizer_offload": "on",
    "memory.chunk_mib": "1",
    "memory.reference_paging": "paged",
    "memory.offload_activations": "on",
}
COMMON = {
    "algo.kl_coef": 0.05,
    "eval.every": 0,
    "run.device": "cpu",
    "run.dtype": "bfloat16",  # FP32 masters: the optimizer state that moves
    "reward.functions": "[rollplex.bench.common:distinct_reward]",  # a nonzero update
    "model.gradient_checkpointing": "true",  # layer inputs saved by the actor prefix: what is offloaded
}


def _untimed(rows: list[dict]) -> list[dict]:
    drop = ("time/", "eq1/", "schedule/", "gc_", "decode/setup_s", "memory/")
    return [{k: v for k, v in row.items() if not k.startswith(drop)} for row in rows]


@pytest.mark.parametrize("schedule", ["serial", "fused", "rollplex"])
def test_memory_managed_training_is_the_all_resident_update(assets, tmp_path, schedule, monkeypatch):  # noqa: F811
    """Weights, FP32 masters, AdamW moments and every metric but timings and memory are bitwise the same
    with every mechanism on as with everything resident, and the mechanisms really ran: bytes moved
    every step, the prefixes' tensors offloaded under the rollplex schedule (every saved tensor: the
    tiny model's are all under the size offloaded by default)."""
    monkeypatch.setattr("rollplex.memory.saved_offload.MIN_OFFLOAD_BYTES", 0)
    steps = CALIBRATION_STEPS + 1
    runs = {}
    for name, memory in (("resident", {}), ("managed", MANAGED)):
        overrides = {**COMMON, **SCHEDULES[schedule], **memory}
        runs[name] = train(_config(assets, tmp_path / name, steps, **overrides))
    assert_moved(runs["resident"], assets[0])
    weights = {name: _weights(run) for name, run in runs.items()}
    assert all(torch.equal(weights["resident"][k], weights["managed"][k]) for k in weights["resident"])
    assert_same_optimizer(runs["resident"], runs["managed"], "managed")
    rows = {name: _metrics(run) for name, run in runs.items()}
    assert _untimed(rows["resident"]) == _untimed(rows["managed"])
    managed = [row for row in rows["managed"] if "memory/moved_gib" in row]
    assert len(managed) == steps and all(row["memory/moved_gib"] > 0 for row in managed)
    assert all(row["memory/moved_gib"] == 0 for row in rows["resident"] if "memory/moved_gib" in row)
    if schedule != "serial":
        assert step_rows(runs["managed"])[-1]["schedule/overlap"] == 1.0
        assert all(row["memory/offloaded_gib"] > 0 for row in managed)
        assert all(row["memory/offload_overflow_gib"] == 0 for row in managed)


def test_a_run_that_does_not_fit_stops_before_it_writes(assets, tmp_path):  # noqa: F811
    """A budget the plan cannot meet is refused before step 1, naming the shortfall and what to change,
    and the run folder is left untouched."""
    cfg = _config(assets, tmp_path / "run", 1, **COMMON, **{"memory.device_budget_gib": 0.001})
    with pytest.raises(ValueError, match=r"does not fit.*GiB short.*memory\.device_budget_gib"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_the_trace_has_the_memory_counters(assets, tmp_path):  # noqa: F811
    """trace.json holds counter tracks of device and host-pool GiB per state class, sampled as each
    window starts, on the spans' time axis."""
    run = train(_config(assets, tmp_path / "run", 1, **COMMON, **SCHEDULES["fused"], **MANAGED))
    events = json.loads((run / TRACE_FILE).read_text())["traceEvents"]
    counters = [e for e in events if e.get("ph") == "C"]
    device = [e for e in counters if e["name"] == "device GiB"]
    assert len(device) == 4  # one step: rollout, scoring, backward, update
    assert {"snapshot", "master", "adam", "reference", "grads"} <= device[0]["args"].keys()
    host = [e for e in counters if e["name"] == "host pool GiB"]
    assert host and host[0]["args"]["master"] > 0  # the optimizer state lives in the pool
    spans = [e for e in events if e.get("ph") == "X"]
    first, last = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    assert all(first - 1e6 <= e["ts"] <= last + 1e6 for e in counters)


def test_the_report_draws_the_memory_of_the_last_step(assets, tmp_path):  # noqa: F811
    """report/memory.png: the last step's device GiB stacked by state class, from the trace's counters."""
    from rollplex.observe.report import make_report, memory_figure

    run = train(_config(assets, tmp_path / "run", 2, **COMMON, **MANAGED))
    trace = json.loads((run / TRACE_FILE).read_text())
    fig = memory_figure(trace, _metrics(run))
    ax = fig.axes[0]
    labels = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"snapshot", "reference", "grads"} <= labels and "GiB" in ax.get_ylabel()
    assert (run / "report" / "memory.png") in make_report(run)
