"""``rollplex bench schedule`` under torchrun: the disaggregated row's layout follows the world size, it
is refused in one process, and on 2 CPU processes the serial and disaggregated rows run side by side."""

from __future__ import annotations

import pytest

from rollplex.bench.parallel import resolve_row
from rollplex.bench.schedule import ScheduleBenchConfig, run_schedule_bench
from rollplex.config import ConfigError, ParallelConfig

TINY = dict(preset="tiny", dtype="float32", groups=2, group_size=2, response_tokens=4, text_tokens=16)


def test_the_disaggregated_row_splits_the_world_in_halves():
    eight = resolve_row("disaggregated", ParallelConfig(dp=1, tp_train=8, tp_rollout=4), 8)
    assert eight == {
        "parallel.rollout_gpus": 4,
        "parallel.dp": 1,
        "parallel.tp_train": 4,
        "parallel.tp_rollout": 4,
    }
    two = resolve_row("disaggregated", ParallelConfig(dp=2), 2)
    assert two == {
        "parallel.rollout_gpus": 1,
        "parallel.dp": 1,
        "parallel.tp_train": 1,
        "parallel.tp_rollout": 1,
    }
    assert resolve_row("serial", ParallelConfig(dp=2), 2) == {}
    with pytest.raises(ConfigError, match="even number"):
        resolve_row("disaggregated", ParallelConfig(dp=3), 3)


def test_the_disaggregated_row_needs_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"\['disaggregated'\] need several processes"):
        run_schedule_bench(ScheduleBenchConfig(**TINY, rows=("serial", "disaggregated")))


def bench_on_rank() -> dict:
    cfg = ScheduleBenchConfig(**TINY, grid=(2, 4, 4), warmup=0, steps=1, rows=("serial", "disaggregated"))
    cfg = ScheduleBenchConfig(**{**cfg.__dict__, "overrides": ("parallel.dp=2",)})
    return run_schedule_bench(cfg).rows


def test_serial_and_disaggregated_rows_side_by_side_on_two_processes(ranks):
    rows = ranks(2, bench_on_rank)[0]
    assert "error" not in rows["serial"] and "error" not in rows["disaggregated"], rows
    assert rows["disaggregated"]["parallel"]["placement"] == "disaggregated"
    assert rows["disaggregated"]["speedup_vs_serial"] > 0 and rows["serial"]["processes"] == 2
