"""``rollplex bench schedule`` on the tiny preset (CPU smoke): every row reaches serial's parameters."""

from __future__ import annotations

import os

import pytest
import torch

from rollplex.bench.schedule import (
    BASELINES,
    ROW_ENV,
    ROWS,
    ScheduleBenchConfig,
    _Workload,
    run_schedule_bench,
)
from rollplex.models.compiled import compiled_scope


def _tiny(**changes) -> ScheduleBenchConfig:
    """A CPU-sized workload: the tiny preset, float32, one timed step and no warm-up."""
    base = dict(preset="tiny", groups=2, group_size=2, response_tokens=4, text_tokens=20, grid=(2, 4, 4))
    return ScheduleBenchConfig(**{**base, "warmup": 0, "steps": 1, "dtype": "float32", **changes})


def test_rows_reach_the_same_parameters(tmp_path):
    """Every row ends at its baseline's parameters (serial's, or serial-whole-batch's for the rows that
    accumulate their gradient over the whole mini-batch at once), and its speedup is against that row."""
    rows = tuple(name for name in ROWS if name not in ROW_ENV)  # flex_attention has no CPU backward
    cfg = _tiny(gradient_checkpointing=False, rows=rows, auto_trials=1)
    result = run_schedule_bench(cfg, tmp_path / "schedule.json")
    assert set(result.rows) == set(rows)
    for name, row in result.rows.items():
        assert row.get("max_abs_param_diff_vs_serial", 0.0) == 0.0
        assert row.get("optimizer_tensors_differing", 0) == 0
        assert row["grad_norm"] > 0, name  # a real update: the rows' agreement is not the trivial one
        assert (name == "auto") != ("optimizer_tensors_differing" in row)
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


def test_the_flex_rows_select_flex_attention_while_they_run(monkeypatch):
    """serial-flex and both-flex run with ROLLPLEX_SUFFIX_ATTENTION=flex (so models.forward picks the
    flex suffix path), and the variable is as it was before them once they end."""
    import rollplex.bench.schedule as schedule
    from rollplex.models.forward import suffix_backend

    seen = {}

    def timed(work, name, cfg):
        seen[name] = suffix_backend(torch.device("cuda"))
        return {"steps_taken": 1}, {}

    monkeypatch.setattr(schedule, "_timed_row", timed)
    monkeypatch.setenv("ROLLPLEX_SUFFIX_ATTENTION", "dense")
    for name in ("serial", "serial-flex", "both-flex", "both"):
        schedule._run_row(None, name, None)
    assert seen == {"serial": "dense", "serial-flex": "flex", "both-flex": "flex", "both": "dense"}
    monkeypatch.delenv("ROLLPLEX_SUFFIX_ATTENTION")
    schedule._run_row(None, "both-flex", None)
    assert "ROLLPLEX_SUFFIX_ATTENTION" not in os.environ and seen["both-flex"] == "flex"
    assert ROWS["serial-flex"] == ROWS["serial"] and ROWS["both-flex"] == ROWS["both"]


def test_a_fingerprint_tells_tensors_apart_by_any_bit():
    """Equal tensors give equal fingerprints; one flipped low bit, two elements swapped (the plain sum
    alone would miss it) or a difference past the first chunk give different ones."""
    import rollplex.bench.schedule as schedule

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert schedule.fingerprint(x) == schedule.fingerprint(x.clone())
    flipped = x.clone()
    flipped.view(torch.int32)[7] ^= 1
    swapped = x.clone()
    swapped[[3, 4]] = x[[4, 3]]
    for other in (flipped, swapped):
        assert schedule.fingerprint(other) != schedule.fingerprint(x)
    assert schedule.fingerprint(swapped)[0] == schedule.fingerprint(x)[0]
    with pytest.raises(TypeError, match="float32"):
        schedule.fingerprint(x.double())


def test_the_optimizer_fingerprints_see_an_update_the_bf16_weights_do_not(monkeypatch):
    """At a learning rate far under one bf16 step, two different gradients leave the same bf16 weights
    but different masters and moments, and the fingerprints count the difference."""
    import rollplex.bench.schedule as schedule
    from rollplex.optim import MasterWeightAdamW

    monkeypatch.setattr(schedule, "_FINGERPRINT_CHUNK", 64)  # several chunks per tensor
    states = []
    for scale in (1.0, 2.0):
        weight = torch.nn.Parameter(torch.full((300,), 1.0, dtype=torch.bfloat16))
        optimizer = MasterWeightAdamW([weight], lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        weight.grad = torch.full_like(weight, scale)
        optimizer.clip_and_step(0.0)
        states.append((weight.detach().clone(), schedule.optimizer_fingerprints(optimizer)))
    (w1, f1), (w2, f2) = states
    assert torch.equal(w1, w2) and len(f1) == 3
    assert [a != b for a, b in zip(f1, f2)] == [False, True, True]  # same sign-step masters, other moments


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
