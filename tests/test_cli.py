"""Command line: parsing and dispatch to (monkeypatched) targets, error lines, ``--help``, lazy imports."""

from __future__ import annotations

import contextlib
import importlib.metadata
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from rollplex.cli import main, split_train_args
from rollplex.config import Config

REPO = Path(__file__).resolve().parents[1]


def _fake_module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.fixture
def paths(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    train = tmp_path / "train.jsonl"
    train.write_text("")
    return model, train


@pytest.fixture
def trained(monkeypatch):
    calls = []
    _fake_module(
        monkeypatch,
        "rollplex.loop",
        train=lambda cfg, resume=False, overwrite=False: calls.append((cfg, resume)),
    )
    return calls


def test_split_train_args():
    assert split_train_args([]) == (None, [])
    assert split_train_args(["a.yaml"]) == ("a.yaml", [])
    assert split_train_args(["a.yaml", "run.steps=3"]) == ("a.yaml", ["run.steps=3"])
    assert split_train_args(["run.steps=3", "run.seed=1"]) == (None, ["run.steps=3", "run.seed=1"])
    with pytest.raises(ValueError, match="'b.yaml'"):
        split_train_args(["a.yaml", "b.yaml"])
    with pytest.raises(ValueError, match=r"got '5' \(run.steps=5 without spaces\?\)$"):
        split_train_args(["run.steps", "5"])  # a forgotten "=": the key was taken for the config file
    with pytest.raises(ValueError, match=r"got '5'$"):  # no hint where the item before is an override
        split_train_args(["a.yaml", "run.seed=1", "5"])


def test_train_with_config_file_and_overrides(tmp_path, paths, trained, monkeypatch):
    model, train = paths
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {model}\ndata:\n  train_path: {train}\nrollout:\n  group_size: 4\n")
    _fake_module(monkeypatch, "rollplex.default_job", default_run_config=lambda: pytest.fail("default used"))
    assert main(["train", str(config), "rollout.top_k=3", "--resume"]) == 0
    ((cfg, resume),) = trained
    assert isinstance(cfg, Config) and resume is True
    assert (cfg.rollout.group_size, cfg.rollout.top_k, cfg.model.path) == (4, 3, str(model))


def test_train_without_config_uses_the_embedded_default(paths, trained, monkeypatch):
    model, train = paths
    base = {"model": {"path": str(model)}, "data": {"train_path": str(train)}, "run": {"steps": 7}}
    prepared = []

    def default_run_config(root=None, prepare=True):
        prepared.append(prepare)
        return base

    _fake_module(monkeypatch, "rollplex.default_job", default_run_config=default_run_config)
    assert main(["train", "run.seed=4"]) == 0
    ((cfg, resume),) = trained
    assert (cfg.run.steps, cfg.run.seed, resume) == (7, 4, False)
    assert prepared == [False, True]  # the overrides checked first, then the cache prepared


def test_a_bad_override_of_the_default_job_fails_before_its_cache_is_prepared(trained, monkeypatch, capsys):
    """The overrides are checked against the default job's settings before its cache is prepared (which
    imports torch, transformers and PyAV, and may build the cache): one line, exit 2, nothing built."""
    prepared = []

    def default_run_config(root=None, prepare=True):
        prepared.append(prepare)
        return {"model": {"path": "cache/model"}, "data": {"train_path": "cache/data/train.json"}}

    _fake_module(monkeypatch, "rollplex.default_job", default_run_config=default_run_config)
    assert main(["train", "rollout.graph_window=-1"]) == 2
    assert capsys.readouterr().err == "rollplex: error: rollout.graph_window=-1 must be >= 0\n"
    assert prepared == [False] and trained == []


def test_config_errors_print_one_line_and_exit_2(tmp_path, paths, trained, capsys):
    model, train = paths
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {model}\ndata:\n  train_path: {train}\n")
    assert main(["train", str(config), "rollout.group_size=1"]) == 2
    err = capsys.readouterr().err
    assert err == "rollplex: error: rollout.group_size=1 must be >= 2\n"
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [1,\n  2\n")
    assert main(["train", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollplex: error: invalid YAML") and err.count("\n") == 1
    assert main(["train", str(tmp_path / "empty.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert trained == []


def test_missing_required_field_is_reported(tmp_path, capsys):
    """The run's own check (``loop.train``) reports it, before the run folder is made."""
    config = tmp_path / "run.yaml"
    config.write_text(f"run:\n  steps: 3\n  out_dir: {tmp_path / 'run'}\n")
    assert main(["train", str(config)]) == 2
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().err == (
        "rollplex: error: model.path is required (got ''; a config file starts from the field defaults, "
        "not from the embedded default job: see rollplex train --help-config)\n"
    )


def test_help_config_lists_fields_and_the_default_job(capsys, tmp_path, monkeypatch):
    """Every field, and the embedded default job's value where it differs; nothing is built for it."""
    monkeypatch.setenv("ROLLPLEX_CACHE", str(tmp_path))
    assert main(["train", "--help-config"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "rollout.group_size" in lines and "optim.max_grad_norm" in lines
    assert lines["rollout.max_response_tokens"].endswith("(default job: 1)")
    assert "default job" not in lines["rollout.group_size"]  # 8 in both
    assert not any(tmp_path.iterdir())


def test_data_synth_dispatch(tmp_path, monkeypatch, capsys):
    calls = []

    def generate_dataset(out, num, seed, **kwargs):
        calls.append((out, num, seed, kwargs))
        return types.SimpleNamespace(
            train_json=out / "train.json",
            val_json=out / "val.json",
            train_counts={"a": 3, "b": 4},
            val_counts={"a": 1},
        )

    _fake_module(monkeypatch, "rollplex.data.synth", generate_dataset=generate_dataset)
    out = tmp_path / "synth"
    argv = ["data", "synth", "--out", str(out), "--num", "8", "--seed", "3", "--frames", "6", "--fps", "2.5"]
    assert main([*argv, "--val-fraction", "0.25", "--families", "color, count"]) == 0
    assert calls == [
        (
            out,
            8,
            3,
            {
                "num_frames": 6,
                "fps": 2.5,
                "val_fraction": 0.25,
                "families": ("color", "count"),
                "progress": True,
            },
        )
    ]
    assert capsys.readouterr().out.splitlines() == [
        f"train: {out / 'train.json'} (7 records)",
        f"val: {out / 'val.json'} (1 records)",
    ]
    calls.clear()
    assert main(["data", "synth", "--out", str(out), "--num", "2"]) == 0
    assert calls == [(out, 2, 0, {"progress": True})]  # unset options keep the generator's defaults


def test_model_init_dispatch(tmp_path, monkeypatch):
    calls = []
    _fake_module(monkeypatch, "rollplex.models.presets", init_checkpoint=lambda *a, **k: calls.append((a, k)))
    assert (
        main(
            [
                "model",
                "init",
                "--preset",
                "tiny",
                "--out",
                str(tmp_path),
                "--seed",
                "5",
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    assert calls == [(("tiny", tmp_path), {"seed": 5, "dtype": torch.bfloat16})]
    calls.clear()
    assert main(["model", "init", "--preset", "qwen2.5-vl-7b", "--out", str(tmp_path)]) == 0
    assert calls == [(("qwen2.5-vl-7b", tmp_path), {"seed": 0})]  # the preset's default dtype
    with pytest.raises(SystemExit) as info:
        main(["model", "init", "--preset", "huge", "--out", str(tmp_path)])
    assert info.value.code == 2


def test_report_dispatch_and_missing_component(tmp_path, monkeypatch, capsys):
    pngs = [tmp_path / "report" / "rewards.png", tmp_path / "report" / "accuracy.png"]
    _fake_module(
        monkeypatch,
        "rollplex.observe.report",
        make_report=lambda run_dir: pngs if run_dir == tmp_path else [],
        bench_report=lambda path: path.with_suffix(".png"),
    )
    assert main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(p) for p in pngs]
    bench = tmp_path / "schedule.json"
    bench.write_text("{}")
    assert main(["report", str(bench)]) == 0  # a file is a bench schedule result
    assert capsys.readouterr().out.splitlines() == [str(tmp_path / "schedule.png")]
    monkeypatch.setitem(sys.modules, "rollplex.models.presets", None)  # a component that cannot be imported
    with pytest.raises(ImportError):
        main(["model", "init", "--preset", "tiny", "--out", str(tmp_path)])
    assert main(["report", str(tmp_path)]) == 0


def test_report_error_names_the_metrics_file(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollplex: error: ") and "metrics.jsonl" in err and err.count("\n") == 1


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_help_is_lazy_and_module_entry_point_works(tmp_path):
    probe = "import sys, rollplex.cli; print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))"
    assert _run("-c", probe).stdout.strip() == "[]"
    result = _run("-m", "rollplex", "--help")
    assert result.returncode == 0
    for command in ("train", "data", "model", "report"):
        assert command in result.stdout
    config = tmp_path / "run.yaml"
    config.write_text("rollout:\n  top_p: 2\n")
    result = _run("-m", "rollplex", "train", str(config))
    assert result.returncode == 2
    assert result.stderr == "rollplex: error: rollout.top_p=2.0 must be <= 1\n"


def test_version_and_the_train_help_name_the_default_job(capsys):
    """``--version`` prints the package's version; ``train --help`` says what runs without a config
    file and where its model and data go."""
    from rollplex import __version__
    from rollplex.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"rollplex {__version__}\n"
    assert importlib.metadata.version("rollplex") == __version__  # pyproject.toml's, as installed
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "embedded default job" in text and "$ROLLPLEX_CACHE" in text and "runs/default" in text


def test_overrides_may_follow_resume(monkeypatch, tmp_path):
    """`rollplex train CONFIG --resume key=value` keeps the override (options may come first)."""
    calls = []
    _fake_module(
        monkeypatch,
        "rollplex.loop",
        train=lambda cfg, resume=False, overwrite=False: calls.append((cfg, resume, overwrite)),
    )
    model, data = tmp_path / "m", tmp_path / "d.json"
    model.mkdir()
    data.write_text("[]")
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {model}\ndata:\n  train_path: {data}\n")
    assert main(["train", str(config), "--resume", "run.steps=8"]) == 0
    assert main(["train", str(config), "run.steps=9", "--overwrite"]) == 0
    (cfg, resume, overwrite), (cfg2, resume2, overwrite2) = calls
    assert cfg.run.steps == 8 and resume and not overwrite
    assert cfg2.run.steps == 9 and overwrite2 and not resume2


def test_resume_and_overwrite_together_are_refused(capsys):
    """Continuing a run and starting it over exclude each other: refused before anything runs."""
    with pytest.raises(SystemExit) as stop:
        main(["train", "--resume", "--overwrite"])
    assert stop.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        ([], "{train,data,model,report,bench,plan}"),
        (["bench"], "{prefix,schedule,decode,profile}"),
        (["model"], "{init}"),
    ],
)
def test_a_missing_command_is_named_by_its_choices(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: the following arguments are required: {named}" in err
    assert "_command" not in err


def test_bench_schedule_options_reach_the_config(monkeypatch):
    """``--no-compile-decode`` / ``--no-fused-projections`` switch the defaults off, absent flags keep
    them, and the other schedule options pass through."""
    from rollplex.bench.schedule import ScheduleBenchConfig

    seen = []
    _fake_module(
        monkeypatch,
        "rollplex.bench.schedule",
        ScheduleBenchConfig=ScheduleBenchConfig,
        run_schedule_bench=lambda cfg, out: seen.append(cfg) or types.SimpleNamespace(rows={}),
    )
    main(["bench", "schedule", "--rows", "serial,both", "--auto-trials", "1", "--decode-attention", "triton"])
    main(
        [
            "bench",
            "schedule",
            "--no-compile-decode",
            "--no-fused-projections",
            "--no-fused-sampling",
            "--no-fused-gate",
            "--vision-attention",
            "per_chunk",
            "--no-vision-mlp-padding",
            "--compile-mode",
            "max-autotune",
            "--compile-scope",
            "parts",
            "--deterministic",
        ]
    )
    assert (seen[0].deterministic, seen[1].deterministic) == (False, True)
    assert (seen[0].compile_decode, seen[0].fused_projections, seen[0].fused_sampling) == (True, True, True)
    assert (seen[0].fused_gate, seen[1].fused_gate) == (True, False)
    assert (seen[0].rows, seen[0].auto_trials, seen[0].decode_attention) == (("serial", "both"), 1, "triton")
    assert (seen[1].compile_decode, seen[1].fused_projections, seen[1].fused_sampling) == (
        False,
        False,
        False,
    )
    assert (seen[0].vision_attention, seen[1].vision_attention) == ("batched", "per_chunk")
    assert (seen[0].vision_mlp_padding, seen[1].vision_mlp_padding) == (True, False)
    assert (seen[0].compile_mode, seen[1].compile_mode) == ("default", "max-autotune")
    assert (seen[0].compile_scope, seen[1].compile_scope) == ("layer", "parts")


def _bench_configs(monkeypatch, command: str) -> list:
    """Run ``rollplex bench <command>`` against a fake runner: the bench configs it is handed."""
    module = importlib.import_module(f"rollplex.bench.{command}")
    config_class = {
        "schedule": "ScheduleBenchConfig",
        "prefix": "PrefixBenchConfig",
        "decode": "DecodeBenchConfig",
    }
    seen = []
    runner = lambda cfg, out: seen.append(cfg) or types.SimpleNamespace(rows={})  # noqa: E731
    fake = {config_class[command]: getattr(module, config_class[command]), f"run_{command}_bench": runner}
    _fake_module(monkeypatch, f"rollplex.bench.{command}", **fake)
    return seen


def test_bench_takes_config_overrides_as_train_does(monkeypatch):
    """``rollplex bench`` takes ``section.field=value`` overrides, before or after its options: schedule
    hands them to every row's config; prefix and decode set the settings those fields map to (after the
    options, so an override beats a flag)."""
    seen = _bench_configs(monkeypatch, "schedule")
    assert (
        main(["bench", "schedule", "algo.kl_coef=0.1", "--rows", "serial", "model.suffix_attention=sdpa"])
        == 0
    )
    assert seen[0].overrides == ("algo.kl_coef=0.1", "model.suffix_attention=sdpa") and seen[0].rows == (
        "serial",
    )
    seen = _bench_configs(monkeypatch, "prefix")
    argv = ["bench", "prefix", "--vision-attention", "per_chunk", "model.cascade_kernels=flash,flash"]
    assert main([*argv, "model.suffix_attention=cascade", "model.vision_attention=batched"]) == 0
    assert (seen[0].suffix_attention, seen[0].cascade_kernels) == ("cascade", "flash,flash")
    assert seen[0].vision_attention == "batched"
    seen = _bench_configs(monkeypatch, "decode")
    assert main(["bench", "decode", "rollout.top_k=20", "rollout.temperature=0.7", "--preset", "tiny"]) == 0
    assert (seen[0].top_k, seen[0].temperature, seen[0].top_p, seen[0].preset) == (20, 0.7, 1.0, "tiny")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "prefix", "rollout.top_k=3"], "rollplex bench prefix: rollout.top_k sets nothing here"),
        (["bench", "decode", "model.suffix_attention=sdpa"], "model.suffix_attention sets nothing here"),
        (["bench", "decode", "rollout.top_k=-1"], "rollout.top_k=-1 must be >= 0"),
        (["bench", "prefix", "model.suffix_attention=flash"], "model.suffix_attention='flash' is not one of"),
        (
            ["bench", "decode", "rollout.top_k"],
            "override 'rollout.top_k' is not of the form section.field=value",
        ),
    ],
)
def test_bench_overrides_that_set_nothing_are_refused(monkeypatch, capsys, argv, message):
    _bench_configs(monkeypatch, argv[1])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollplex: error: ") and message in err


def test_a_bad_compile_scope_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "schedule", "--compile-scope", "whole"])
    assert stop.value.code == 2 and "invalid choice: 'whole'" in capsys.readouterr().err


def test_the_default_jobs_preparation_is_announced_once(tmp_path, capsys):
    """The first ``rollplex train`` without a config builds the cache: one line says what and where;
    a prepared cache is used silently."""
    from rollplex.default_job import _build_once

    target = tmp_path / "data"
    _build_once(target, lambda out: out.mkdir())
    assert (
        capsys.readouterr().out == f"rollplex: preparing the embedded default job's data in {target} (once)\n"
    )
    _build_once(target, lambda out: out.mkdir())
    assert capsys.readouterr().out == "" and target.is_dir()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "schedule", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["bench", "schedule", "--warmup", "-1"], "argument --warmup: must be at least 0, got -1"),
        (["bench", "decode", "--groups", "0"], "argument --groups: must be at least 1, got 0"),
        (["bench", "prefix", "--repeats", "x"], "argument --repeats: invalid integer value: 'x'"),
        (["bench", "schedule", "--group-size", "1"], "argument --group-size: must be at least 2, got 1"),
        (
            ["bench", "decode", "--response-tokens", "1"],
            "argument --response-tokens: must be at least 2, got 1",
        ),
        (["bench", "prefix", "--text-tokens", "2"], "argument --text-tokens: must be at least 3, got 2"),
        (["bench", "prefix", "--suffix-group-sizes", "4,0"], "each value must be at least 1, got '4,0'"),
        (["bench", "schedule", "--grid", "2,3,4"], "h and w even, got '2,3,4'"),
        (["bench", "schedule", "--grid=0,4,4"], "each at least 1, h and w even, got '0,4,4'"),
        (
            ["bench", "decode", "--grid", "2,x,4"],
            "expected t,h,w integers (patch grid of the video), got '2,x,4'",
        ),
    ],
)
def test_counts_out_of_range_are_usage_errors_before_anything_runs(argv, message, capsys):
    """A count the command cannot run with (no timed steps, no groups, one response per GRPO group, no
    decode step, a patch grid the vision tower cannot merge) is refused while the arguments are parsed,
    naming the option, instead of failing later or writing an empty result."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_decode_profile_without_cuda_is_refused_before_anything_runs(monkeypatch, capsys):
    import rollplex.bench.decode as decode

    monkeypatch.setattr(decode.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(decode, "decode_workload", lambda cfg: pytest.fail("the workload was built"))
    assert main(["bench", "decode", "--preset", "tiny", "--profile-steps", "4"]) == 2
    assert "profiles CUDA kernels: it needs a CUDA device" in capsys.readouterr().err


def test_a_benchmark_with_failed_rows_exits_1_naming_them(monkeypatch, capsys):
    """Rows that failed (their errors printed as they ran) make the command exit 1 with one line naming
    them; a skipped row, which names its reason, does not."""
    from rollplex.bench.decode import DecodeBenchConfig

    rows = {"eager": {"ms_per_step": 1.0}, "graphs+triton": {"skipped": "needs CUDA"}}
    _fake_module(
        monkeypatch,
        "rollplex.bench.decode",
        DecodeBenchConfig=DecodeBenchConfig,
        run_decode_bench=lambda cfg, out: types.SimpleNamespace(rows=rows),
    )
    assert main(["bench", "decode", "--preset", "tiny"]) == 0
    rows["graphs"] = {"error": "RuntimeError: no kernel"}
    assert main(["bench", "decode", "--preset", "tiny"]) == 1
    assert capsys.readouterr().err == "rollplex: error: 1 of 3 rows failed: graphs\n"


def _closed_pipe_stdout(monkeypatch):
    """Make standard output (``sys.stdout`` and ``sys.__stdout__``) a pipe whose reader has gone away,
    inside the test body (pytest's capture replaces ``sys.stdout`` after fixtures run)."""
    import os

    read, write = os.pipe()
    os.close(read)
    stream = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "__stdout__", stream)
    return stream


@pytest.mark.parametrize("size", ["a line", "more than a buffer"])
def test_output_into_a_reader_that_went_away_ends_without_a_traceback(monkeypatch, size):
    """`rollplex train --help-config | head`: once the reader has closed the pipe, the command stops
    with status 1 and writes nothing more, the interpreter's last flush included, instead of a
    BrokenPipeError traceback; output shorter than the stream's buffer breaks only at the flush."""
    text = "x" if size == "a line" else "x" * 100_000
    monkeypatch.setattr("rollplex.cli._train", lambda args: print(text))
    stream = _closed_pipe_stdout(monkeypatch)
    try:
        assert main(["train"]) == 1
        stream.write("y" * 100_000)
        stream.flush()  # now the null device: raises nothing
    finally:
        with contextlib.suppress(BrokenPipeError):
            stream.close()


def test_another_broken_pipe_is_an_error(monkeypatch):
    """A BrokenPipeError that standard output did not cause (a worker's pipe) is raised, not taken for
    a reader that went away."""

    def broken(args):
        raise BrokenPipeError("a worker's pipe")

    monkeypatch.setattr("rollplex.cli._train", broken)
    with pytest.raises(BrokenPipeError, match="worker"):
        main(["train"])


def test_bench_help_never_breaks_a_row_or_variant_name(monkeypatch, capsys):
    """``--rows`` points at the row list below it and ``--variants`` lists its names one word each, so
    an 80-column help never splits a name at a hyphen (a line ending in "-") or inside it (the longest
    variant, 51 characters, is split below about 78 columns)."""
    from rollplex.bench.variants import DECODE_VARIANTS, ROWS

    monkeypatch.setenv("COLUMNS", "80")
    for command, names in (("schedule", ROWS), ("decode", DECODE_VARIANTS)):
        with pytest.raises(SystemExit):
            main(["bench", command, "--help"])
        shown = capsys.readouterr().out
        assert not [line for line in shown.splitlines() if line.endswith("-")], command
        words = {w.strip(",()") for w in shown.split()}
        assert not [name for name in names if name not in words], command


def test_under_torchrun_only_train_and_bench_schedule_split_their_work(monkeypatch, capsys):
    """Started by torchrun with several processes, a one-process command is refused with the rank named
    (each process would otherwise run it whole and write the same files)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["bench", "decode", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "rollplex: error: rank 1: rollplex bench decode runs in one process" in err
    assert main(["plan", "configs/paper-32b.yaml"]) == 2
    assert "rank 1: rollplex plan runs in one process" in capsys.readouterr().err
