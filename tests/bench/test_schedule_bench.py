"""``rollplex bench schedule`` on the tiny preset (CPU smoke): every row reaches serial's parameters."""

from __future__ import annotations

import os

import pytest
import torch

from rollplex.bench.schedule import (
    BASELINES,
    ROWS,
    TORCHRUN_ROWS,
    ScheduleBenchConfig,
    _Workload,
    run_schedule_bench,
)
from rollplex.config import ConfigError
from rollplex.models import recompute
from rollplex.models.attention import SuffixAttention
from rollplex.models.compiled import compiled_scope
from rollplex.schedule.prefix_overlap import CALIBRATION_STEPS


def _tiny(**changes) -> ScheduleBenchConfig:
    """A CPU-sized workload: the tiny preset, float32, one timed step and no warm-up."""
    base = dict(preset="tiny", groups=2, group_size=2, response_tokens=4, text_tokens=20, grid=(2, 4, 4))
    return ScheduleBenchConfig(**{**base, "warmup": 0, "steps": 1, "dtype": "float32", **changes})


def test_rows_reach_the_same_parameters(tmp_path):
    """Every row ends at its baseline's parameters (serial's; serial-whole-batch's for the rows that
    accumulate their gradient over the whole mini-batch at once; serial-torch-checkpoint's for the rows
    under torch's checkpoint), and its speedup is against that row."""
    # flex_attention has no CPU backward; the disaggregated row runs under torchrun (tests/parallel)
    rows = tuple(
        name for name in ROWS if "model.suffix_attention" not in ROWS[name] and name not in TORCHRUN_ROWS
    )
    cfg = _tiny(gradient_checkpointing=False, rows=rows, auto_trials=1)
    result = run_schedule_bench(cfg, tmp_path / "schedule.json")
    assert set(result.rows) == set(rows)
    baselines = {name for name in rows if BASELINES[name] == name}  # compared with nothing but themselves
    assert baselines == {"serial", "serial-whole-batch", "serial-torch-checkpoint"}
    for name, row in result.rows.items():
        assert row.get("max_abs_param_diff_vs_serial", 0.0) == 0.0
        assert row.get("optimizer_tensors_differing", 0) == 0
        assert (name in {"auto", *baselines}) != ("optimizer_tensors_differing" in row), name
        assert (name in {"auto", *baselines}) != ("max_abs_param_diff_vs_serial" in row), name
        assert (name in baselines) != (row.get("baseline") == BASELINES[name]), name
        assert row["grad_norm"] > 0, name  # a real update: the rows' agreement is not the trivial one
        assert set(row.get("first_step_differing", {}).values()) <= {None}, name
        if "first_step_differing" in row:  # the training's values are compared too
            assert {"actor_statistics", "gradient_norms"} <= set(row["first_step_differing"]), name
        assert row.get("update_rel_diff_vs_serial", 0.0) == 0.0, name
        assert ("update_rel_diff_vs_serial" in row) == ("optimizer_tensors_differing" in row), name
        assert row["step_s_median"] > 0 and row["eq1/T_D"] > 0
        assert len(row["gc_s_by_step"]) == row["steps_taken"], name
        assert {"gc_s", "gc_passes", "gc_full_passes"} <= set(row), name
        assert row["decode/setup_s"] > 0, name  # the decode step was built (no graphs on the CPU)
    assert result.rows["both-whole-batch"]["baseline"] == "serial-whole-batch"
    assert result.rows["both"]["baseline"] == "serial"
    assert result.rows["both-torch-checkpoint"]["baseline"] == "serial-torch-checkpoint"
    # one timed step after no warm-up: auto ran its calibration and as many trials as fit, and kept none
    assert "auto_policy" not in result.rows["auto"] and result.rows["auto"]["auto_trials_left"] == 1
    # with no warm-up, the calibration steps and the trials that fit before the timed step
    assert result.rows["auto"]["steps_taken"] == CALIBRATION_STEPS + len(
        result.rows["auto"]["auto_trials_span_s"]
    )
    assert (tmp_path / "schedule.json").exists()


def test_each_row_checkpoints_as_its_config_says(monkeypatch):
    """With checkpointing on, the workload enables it once and every row again as its config says: the
    torch-checkpoint rows with torch's checkpoint in every layer, the others with layer recompute."""
    import rollplex.bench.schedule as schedule

    calls, enable = [], schedule.enable_checkpointing

    def spy(model, **kwargs):
        enable(model, **kwargs)
        layers = model.model.language_model.layers
        calls.append({layer._gradient_checkpointing_func.func is recompute.checkpoint for layer in layers})

    monkeypatch.setattr(schedule, "enable_checkpointing", spy)
    rows = ("serial", "serial-torch-checkpoint", "both")
    result = run_schedule_bench(_tiny(gradient_checkpointing=True, rows=rows))
    assert calls == [{True}, {True}, {False}, {True}]  # every layer, as each row enabled it
    assert all(result.rows[name]["step_s_median"] > 0 for name in rows)


def test_a_row_whose_layers_ran_uncompiled_says_so(monkeypatch, capsys):
    import rollplex.bench.schedule as schedule

    cfg = _tiny(groups=1, response_tokens=2, text_tokens=8, rows=("serial",))
    assert "compile_fallback" not in run_schedule_bench(cfg).rows["serial"]
    monkeypatch.setattr(schedule, "compile_fallback", lambda: "InductorError: no Triton")
    assert "compile_fallback" not in run_schedule_bench(cfg).rows["serial"]  # its layers were not compiled
    monkeypatch.setattr(schedule, "compiled_scope", lambda model: "layer")
    assert run_schedule_bench(cfg).rows["serial"]["compile_fallback"] == "InductorError: no Triton"
    assert "serial: layers ran uncompiled: InductorError: no Triton" in capsys.readouterr().out


def test_the_suffix_attention_rows_select_their_backend_in_their_config():
    """serial-X and both-X are serial and both with model.suffix_attention X, for X in causal, cascade,
    sdpa and flex: their roles score with that backend, the other rows with the device's default."""
    work = _Workload(_tiny(groups=1), torch.device("cpu"))
    for x in ("causal", "cascade", "sdpa", "flex"):
        for row in ("serial", "both"):
            settings = dict(ROWS[f"{row}-{x}"])
            assert settings.pop("model.suffix_attention") == x and settings == ROWS[row]
            roles = work.roles(ROWS[f"{row}-{x}"], _tiny(groups=1))
            assert roles.suffix_attention == SuffixAttention(x)
    assert work.roles(ROWS["both"], _tiny(groups=1)).suffix_attention == SuffixAttention("auto")


def test_overrides_reach_every_row_and_a_rows_own_settings_win(capsys):
    """``overrides`` (key=value, as rollplex train takes them) go into every row's config after the
    workload's settings; where a row sets the same field, the row's value stands and a line says so."""
    cfg = _tiny(
        groups=1, overrides=("algo.kl_coef=0.5", "model.suffix_attention=sdpa", "schedule.overlap=false")
    )
    work = _Workload(cfg, torch.device("cpu"))
    serial, both = work.roles(ROWS["serial"], cfg).config, work.roles(ROWS["both"], cfg).config
    assert serial.algo.kl_coef == both.algo.kl_coef == 0.5
    assert serial.model.suffix_attention == both.model.suffix_attention == "sdpa"
    assert work.roles(ROWS["serial-causal"], cfg).config.model.suffix_attention == "causal"
    assert (serial.schedule.overlap, both.schedule.overlap) == (False, True)  # both sets its own
    run_schedule_bench(_tiny(groups=1, rows=("serial", "both"), overrides=("schedule.overlap=false",)))
    assert "both: the row's own schedule.overlap replaces the override" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("algo.kl_coef=-1", ["algo.kl_coef=-1", ">= 0"]),
        ("schedule.kind=fast", ["schedule.kind", "serial"]),
        ("rollout.group_size=4", ["rollout.group_size takes no effect", "--group-size"]),
        ("data.train_path=x.json", ["data.train_path takes no effect"]),
        ("run.steps=3", ["run.steps takes no effect"]),
        ("model.path=/models/3b", ["model.path takes no effect"]),
    ],
)
def test_bad_overrides_are_refused_before_the_workload_is_built(monkeypatch, override, needles):
    import rollplex.bench.schedule as schedule

    monkeypatch.setattr(schedule, "_Workload", lambda *a: pytest.fail("the workload was built"))
    with pytest.raises(ConfigError) as info:
        run_schedule_bench(_tiny(overrides=(override,)))
    for needle in needles:
        assert needle in str(info.value)


def test_updates_are_compared_with_the_baselines_as_a_relative_l2_difference():
    """u = master − initial per parameter; ‖u − u_serial‖ / ‖u_serial‖ over all of them, by hand:
    serial's update (3, 4 | 0) has norm 5, both's (3, 4 | 1) differs by 1: 0.2. A row whose baseline
    has not run, or ran another number of steps, gets no value; only baselines are kept."""
    from types import SimpleNamespace

    from rollplex.bench.schedule import Updates

    initial = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([2.0])}
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    names = {id(params[0]): "a", id(params[1]): "b"}

    def optimizer(a, b):  # what Updates reads of a ChunkedAdamW
        masters = [torch.tensor(a), torch.tensor(b)]
        states = [(i, "master", m) for i, m in enumerate(masters)]
        return SimpleNamespace(params=params, device=torch.device("cpu"), state_tensors=lambda: iter(states))

    updates = Updates(initial, names, ("both", "serial", "serial-again", "fusion"))
    early = {"steps_taken": 3}
    updates.record("both", optimizer([4.0, 5.0], [3.0]), early)  # before serial ran
    serial = {"steps_taken": 3}
    updates.record("serial", optimizer([4.0, 5.0], [2.0]), serial)
    again, fusion = {"steps_taken": 3}, {"steps_taken": 4}
    updates.record("serial-again", optimizer([4.0, 5.0], [3.0]), again)
    updates.record("fusion", optimizer([4.0, 5.0], [2.0]), fusion)
    assert again["update_rel_diff_vs_serial"] == pytest.approx(0.2, rel=1e-12)
    assert "update_rel_diff_vs_serial" not in early | serial | fusion
    assert set(updates.kept) == {"serial"}


def _fail_row(monkeypatch, failing: str, message: str) -> None:
    """Make row ``failing`` raise RuntimeError(``message``) as it starts, as a kernel that does not
    compile would; the other rows run as they do."""
    import rollplex.bench.schedule as schedule

    real = schedule._timed_row

    def timed(work, name, cfg):
        if name == failing:
            raise RuntimeError(message)
        return real(work, name, cfg)

    monkeypatch.setattr(schedule, "_timed_row", timed)


def test_a_failing_row_is_recorded_and_the_others_run(monkeypatch):
    """A row that raises (here the flex row, as a kernel that does not compile would) is recorded with
    its error, and the next row runs and is compared."""
    _fail_row(monkeypatch, "serial-flex", "NoValidChoicesError")
    result = run_schedule_bench(_tiny(groups=1, rows=("serial", "serial-flex", "serial-again")))
    assert result.rows["serial-flex"] == {"error": "RuntimeError: NoValidChoicesError"}
    assert result.rows["serial-again"]["optimizer_tensors_differing"] == 0


def test_a_row_is_compared_only_with_a_baseline_that_ran_before_it_with_as_many_steps():
    from rollplex.bench.schedule import compared_with

    assert compared_with("both", 3, {"serial": 3}) == "serial"
    assert compared_with("both", 3, {"serial": 4}) is None  # auto's trials add steps
    assert compared_with("both", 3, {"fusion": 3}) is None  # serial has not run (or failed)
    assert compared_with("serial", 3, {"serial": 3}) is None  # never with itself
    assert (
        compared_with("both-whole-batch", 3, {"serial": 3, "serial-whole-batch": 3}) == "serial-whole-batch"
    )


def test_a_row_run_before_its_baseline_or_after_a_failed_one_is_not_compared_and_says_why(
    monkeypatch, capsys
):
    """Rows ``both, serial``: both's baseline is serial, which ran after it, so neither its update nor its
    fingerprints are compared, and its verdict says so; likewise when serial fails. A row named twice is
    refused before anything runs."""
    result = run_schedule_bench(_tiny(groups=1, rows=("both", "serial")))
    both = result.rows["both"]
    assert both["baseline"] == "serial" and both["not_compared"] == "serial ran after it"
    assert not {"optimizer_tensors_differing", "update_rel_diff_vs_serial", "first_step_differing"} & set(
        both
    )
    assert "both: not compared with serial: serial ran after it" in capsys.readouterr().out
    _fail_row(monkeypatch, "serial", "no kernel")
    result = run_schedule_bench(_tiny(groups=1, rows=("serial", "both")))
    assert result.rows["both"]["not_compared"] == "serial failed"
    with pytest.raises(ValueError, match=r"more than once: \['serial'\]"):
        run_schedule_bench(_tiny(rows=("serial", "both", "serial")))


def test_the_verdict_says_same_bitwise_where_it_differs_or_why_not_compared():
    from rollplex.bench.schedule import verdict

    same = {"baseline": "serial", "steps_taken": 3, "optimizer_tensors_differing": 0, "optimizer_tensors": 6}
    same["first_step_differing"] = {"responses": None, "advantages": None}
    assert verdict(same) == (
        "the same update as serial, bitwise: 6 FP32 tensors, and every step's responses, advantages"
    )
    parted = {
        **same,
        "optimizer_tensors_differing": 6,
        "first_step_differing": {"responses": 2, "advantages": None},
    }
    assert (
        verdict(parted)
        == "differs from serial in 6 of 6 FP32 optimizer tensors; first in responses at step 2"
    )
    later_first = {**parted, "first_step_differing": {"responses": 3, "advantages": 2}}
    assert verdict(later_first).endswith("; first in advantages at step 2, responses at step 3")
    only_optimizer = {**same, "optimizer_tensors_differing": 1}
    assert verdict(only_optimizer) == "differs from serial in 1 of 6 FP32 optimizer tensors"
    only_steps = {**same, "first_step_differing": {"responses": None, "advantages": 3}}
    assert verdict(only_steps).endswith("in 0 of 6 FP32 optimizer tensors; first in advantages at step 3")
    skipped = {"baseline": "serial", "not_compared": "7 steps against serial's 3"}
    assert verdict(skipped) == "not compared with serial: 7 steps against serial's 3"


def test_a_deterministic_run_turns_on_torchs_deterministic_algorithms_first(monkeypatch, capsys):
    """--deterministic: torch's deterministic algorithms are on before the workload is built (cuBLAS's
    workspace setting with them), the rows record run.deterministic, and serial-again repeats serial."""
    import rollplex.bench.schedule as schedule

    # set first, so that an absent variable is recorded too and the teardown removes the run's value
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    seen = []
    real = schedule._Workload.__init__

    def init(self, cfg, device):
        seen.append(torch.are_deterministic_algorithms_enabled())
        real(self, cfg, device)

    monkeypatch.setattr(schedule._Workload, "__init__", init)
    try:
        result = run_schedule_bench(_tiny(groups=1, rows=("serial", "serial-again"), deterministic=True))
        assert seen == [True] and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
    assert result.rows["serial-again"]["optimizer_tensors_differing"] == 0
    assert result.rows["serial-again"]["grad_norm"] == result.rows["serial"]["grad_norm"] > 0
    assert "serial-again: the same update as serial, bitwise: " in capsys.readouterr().out
    work = schedule._Workload(_tiny(groups=1), torch.device("cpu"))
    assert work.roles(ROWS["serial"], _tiny(deterministic=True)).config.run.deterministic


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


def test_every_row_is_explained_in_the_help(capsys):
    """``rollplex bench schedule --help`` ends with ``ROWS_HELP``: a line per row, starting with its name
    and saying what it runs."""
    from rollplex.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "schedule", "--help"])
    lines = capsys.readouterr().out.splitlines()
    for row in ROWS:
        line = next((x for x in lines if x.startswith(f"{row} ")), "")
        assert len(line.split()) > 2, row


def test_rows_plan_with_the_host_memory_there_was_before_the_shared_pool_was_pinned(monkeypatch):
    """The rows' pool is pinned before their plans are made again: were the host budget measured then, the
    pool would count against itself and a row whose state fits the host would find the host full and
    keep its optimizer state on the device. Every row plans with what was available before."""
    import rollplex.bench.schedule as bench

    def measured_again():
        raise AssertionError("a row's plan measured the host again, after the pool was pinned")

    monkeypatch.setattr("rollplex.memory.plan_command.available_host_gib", measured_again)
    monkeypatch.setattr(bench, "available_host_gib", lambda: 64.0)
    cfg = _tiny(groups=1, rows=("serial", "both"), overrides=("memory.optimizer_offload=on",))
    work = _Workload(cfg, torch.device("cpu"))
    plans = [work.plan(bench.row_config(ROWS[name], cfg, work.sms)) for name in cfg.rows]
    margin = bench._checked_overrides(cfg.overrides).memory.host_margin_gib
    assert all(p.fits and p.host_budget_gib == 64.0 - margin for p in plans)
    result = run_schedule_bench(cfg)
    assert all("error" not in row for row in result.rows.values())
