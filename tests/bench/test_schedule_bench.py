"""``rollplex bench schedule`` on the tiny preset (CPU smoke): every row reaches serial's parameters."""

from __future__ import annotations

import pytest
import torch

from rollplex.bench.schedule import BASELINES, ROWS, ScheduleBenchConfig, _Workload, run_schedule_bench
from rollplex.models.compiled import compiled_scope


def _tiny(**changes) -> ScheduleBenchConfig:
    """A CPU-sized workload: the tiny preset, float32, one timed step and no warm-up."""
    base = dict(preset="tiny", groups=2, group_size=2, response_tokens=4, text_tokens=20, grid=(2, 4, 4))
    return ScheduleBenchConfig(**{**base, "warmup": 0, "steps": 1, "dtype": "float32", **changes})


def test_rows_reach_the_same_parameters(tmp_path):
    """Every row ends at its baseline's parameters (serial's, or serial-whole-batch's for the rows that
    accumulate their gradient over the whole mini-batch at once), and its speedup is against that row."""
    cfg = _tiny(gradient_checkpointing=False, rows=tuple(ROWS), auto_trials=1)
    result = run_schedule_bench(cfg, tmp_path / "schedule.json")
    assert set(result.rows) == set(ROWS)
    for name, row in result.rows.items():
        assert row.get("max_abs_param_diff_vs_serial", 0.0) == 0.0
        assert row["step_s_median"] > 0 and row["eq1/T_D"] > 0
        assert (name == "auto") != ("max_abs_param_diff_vs_serial" in row)
        base = result.rows[BASELINES[name]]["step_s_median"]
        assert row["speedup_vs_serial"] == base / row["step_s_median"], name
    assert BASELINES["both-whole-batch"] == "serial-whole-batch" and BASELINES["both"] == "serial"
    assert result.rows["auto"]["auto_policy"]
    assert result.rows["auto"]["steps_taken"] == 1 + len(result.rows["auto"]["auto_trials_span_s"])
    assert (tmp_path / "schedule.json").exists()


def test_a_row_whose_layers_ran_uncompiled_says_so(monkeypatch, capsys):
    import rollplex.bench.schedule as schedule

    cfg = _tiny(groups=1, response_tokens=2, text_tokens=8, rows=("serial",))
    assert "compile_fallback" not in run_schedule_bench(cfg).rows["serial"]
    monkeypatch.setattr(schedule, "compile_fallback", lambda: "InductorError: no Triton")
    assert run_schedule_bench(cfg).rows["serial"]["compile_fallback"] == "InductorError: no Triton"
    assert "serial: layers ran uncompiled: InductorError: no Triton" in capsys.readouterr().out


def test_unknown_row_is_named():
    with pytest.raises(ValueError, match="unknown schedule rows"):
        run_schedule_bench(ScheduleBenchConfig(preset="tiny", rows=("serial", "magic")))


def test_eager_rows_run_the_layers_uncompiled(monkeypatch):
    """serial-eager and both-eager turn ``model.compile_layers`` off for both models, serial-parts and
    both-parts compile their layers' parts apart; the other rows leave both to the workload (the
    CUDA-only gate passed through here, so the CPU shows the wiring without compiling)."""
    calls = []
    monkeypatch.setattr(
        "rollplex.bench.schedule.compiles_layers", lambda flag, device: calls.append((flag, device)) or flag
    )
    cfg = ScheduleBenchConfig(
        preset="tiny", groups=1, group_size=2, text_tokens=8, grid=(2, 4, 4), dtype="float32"
    )
    work = _Workload(cfg, torch.device("cpu"))
    rows = {
        "serial": "layer",
        "serial-eager": None,
        "both": "layer",
        "both-eager": None,
        "serial-parts": "parts",
        "both-parts": "parts",
    }
    for row, scope in rows.items():
        calls.clear()
        work.roles(ROWS[row], cfg)
        assert calls == [(scope is not None, torch.device("cpu"))], row
        assert compiled_scope(work.actor) == scope and compiled_scope(work.reference) == scope, row
    for row in ROWS:  # one group per micro-batch but in the whole-batch rows, where every group is one
        micro = work.roles(ROWS[row], cfg).config.algo.micro_batch_groups
        assert micro == (0 if row.endswith("-whole-batch") else 1), row
