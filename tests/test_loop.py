"""End-to-end ``train`` on the tiny checkpoint: resume is bit-for-bit, bad samples are skipped and
counted, an unusable dataset stops with a clear error, and the run's artefacts are complete."""

from __future__ import annotations

import functools
import gc
import itertools
import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rollplex.config import load_config
from rollplex.data.records import DatasetError
from rollplex.data.synth import generate_dataset
from rollplex.loop import build_run, duration_text, step_memory, train
from rollplex.models.attention import SuffixAttention
from rollplex.models.compiled import compiled_scope, layers_compiled
from rollplex.models.folder import check_model_folder
from rollplex.models.presets import init_checkpoint


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    model = init_checkpoint("tiny", root / "model", seed=0)
    data = root / "data"
    generate_dataset(
        data, 16, 0, width=56, height=56, num_frames=8, fps=4.0, val_fraction=0.25, families=("color",)
    )
    return model, data


def _config(assets, out: Path, steps: int, **extra):
    model, data = assets
    overrides = {
        "run.out_dir": str(out),
        "run.steps": steps,
        "run.save_every": 2,
        "run.progress": False,
        "model.path": str(model),
        "data.train_path": str(data / "train.json"),
        "data.val_path": str(data / "val.json"),
        "data.template": "answer_only",
        "data.video_min_pixels": 3136,
        "data.video_max_pixels": 3136,
        "rollout.group_size": 2,
        "rollout.prompts_per_step": 2,
        "rollout.max_response_tokens": 4,
        "reward.functions": "[answer_accuracy, answer_format]",
        "optim.lr": 1e-3,
        "eval.every": 2,
        "eval.num_prompts": 2,
    }
    overrides.update(extra)
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(run_dir / "checkpoints" / latest / "hf" / "model.safetensors")


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_is_bit_for_bit(assets, tmp_path):
    """4 steps == 2 steps + resume + 2 steps (CPU, float32): same weights, same metrics."""
    straight = train(_config(assets, tmp_path / "straight", 4))
    split = train(_config(assets, tmp_path / "split", 2))
    train(_config(assets, split, 4), resume=True)
    a, b = _weights(straight), _weights(split)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    from tests.schedule.test_same_update import untimed

    assert [untimed(r) for r in _metrics(straight)] == [untimed(r) for r in _metrics(split)]


def test_batched_vision_attention_trains_the_same(assets, tmp_path, monkeypatch):
    """Two steps on video prompts with the batched vision attention reach the per-window run's weights
    (float32 on the CPU; the same per-window arithmetic, batched), and the batched path ran."""
    from tests.models.test_vision_attention import spy_batching

    per_window = train(_config(assets, tmp_path / "per_chunk", 2, **{"model.vision_attention": "per_chunk"}))
    counts = spy_batching(monkeypatch)
    batched = train(_config(assets, tmp_path / "batched", 2, **{"model.vision_attention": "batched"}))
    # boundaries read (on the host) once per video grid, kept for every later pass over it: more batched
    # SDPA calls than buckets
    assert counts["reads"] > 0 and counts["sdpa"] > counts["buckets"]
    a, b = _weights(per_window), _weights(batched)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def test_padded_vision_mlp_trains_the_same(assets, tmp_path, monkeypatch):
    """Two steps with ``model.vision_mlp_padding`` reach the unpadded run's weights (float32 on the CPU,
    the alignment forced to 160 bytes: the tiny widths need no padding at 16), the setting reaches both
    the actor and the reference, and the padded products ran."""
    from rollplex.models import forward, vision_mlp

    switches, padded_calls = [], []
    set_padding, padded_mlp = vision_mlp.set_vision_mlp_padding, vision_mlp.padded_mlp

    def spy_switch(model, on):
        switches.append(on)
        return set_padding(model, on)

    def spy_mlp(mlp, x, align_bytes=vision_mlp.ALIGN_BYTES):
        padded_calls.append(vision_mlp.padded_width(mlp.gate_proj.out_features, x.dtype, align_bytes))
        return padded_mlp(mlp, x, align_bytes)

    monkeypatch.setattr(forward, "set_vision_mlp_padding", spy_switch)
    monkeypatch.setattr(vision_mlp, "padded_mlp", spy_mlp)
    monkeypatch.setattr(vision_mlp, "ALIGN_BYTES", 160)
    plain = train(_config(assets, tmp_path / "plain", 2, **{"model.vision_mlp_padding": False}))
    assert switches == [False, False] and not padded_calls  # actor and reference, unpadded
    padded = train(_config(assets, tmp_path / "padded", 2, **{"model.vision_mlp_padding": True}))
    assert switches == [False, False, True, True]
    assert padded_calls and all(width > 64 for width in padded_calls)  # 64 → 80 wide
    a, b = _weights(plain), _weights(padded)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


def test_run_artefacts(assets, tmp_path):
    run = train(_config(assets, tmp_path / "run", 2))
    rows = _metrics(run)
    assert rows[0]["step"] == 0 and "val_accuracy" in rows[0]
    step = rows[-1]
    assert step["decode/setup_s"] > 0
    for key in (
        "reward_mean",
        "accuracy",
        "format_rate",
        "kl",
        "loss",
        "clip_fraction",
        "entropy",
        "response_length",
        "grad_norm",
        "skipped_samples",
        "time/rollout",
        "time/reference",
        "time/actor",
        "time/optimizer",
        "time/step",
        "val_accuracy",
        "logprob_diff_max",
    ):
        assert key in step, key
    assert (run / "config.yaml").exists()
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() / "hf"
    Qwen2_5_VLForConditionalGeneration.from_pretrained(latest)
    AutoProcessor.from_pretrained(latest)
    check_model_folder(latest)  # a checkpoint can start another run


def test_tensorboard_gets_every_row_of_metrics_jsonl(assets, tmp_path):
    """logging.tensorboard: the run's TensorBoard scalars are its metrics.jsonl rows, key by key
    (values as float32, a null row value as NaN)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(_config(assets, tmp_path / "run", 2, **{"logging.tensorboard": "true"}))
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    written = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    rows = _metrics(run)
    expected: dict[str, list] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step":
                value = float(np.float32(value)) if value is not None else math.nan
                expected.setdefault(key, []).append((row["step"], value))
    assert written.keys() == expected.keys() and len(rows) == 3  # step 0's evaluation, steps 1 and 2
    for key, pairs in expected.items():
        assert [step for step, _ in written[key]] == [step for step, _ in pairs], key
        np.testing.assert_array_equal([v for _, v in written[key]], [v for _, v in pairs], err_msg=key)


def test_step_memory_gives_the_peak_and_what_stays_allocated_in_gib(monkeypatch):
    assert step_memory(torch.device("cpu")) == {}
    asked = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: asked.append(d) or 7 * 2**29)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: asked.append(d) or 2**30 + 2**28)
    device = torch.device("cuda", 1)
    assert step_memory(device) == {"peak_memory_gib": 3.5, "memory_allocated_gib": 1.25}
    assert asked == [device, device]


def _write_records(path: Path, rows: list[dict]) -> None:
    path.write_text(json.dumps(rows))


def test_bad_samples_are_skipped_and_counted(assets, tmp_path, caplog):
    _, data = assets
    rows = json.loads((data / "train.json").read_text())
    broken = dict(rows[0], problem_id=9001, path="./CLEVRER/synth/missing.mp4")
    corrupt_file = data / "CLEVRER" / "synth" / "corrupt.mp4"
    corrupt_file.write_bytes(b"not a video at all")
    corrupt = dict(rows[1], problem_id=9002, path="./CLEVRER/synth/corrupt.mp4")
    too_long = dict(rows[2], problem_id=9003, problem="why " * 400)
    malformed = {"problem_id": 9004, "problem": "no other fields"}
    mixed = tmp_path / "train.json"
    _write_records(mixed, [broken, corrupt, too_long, malformed, *rows[3:]])
    val_rows = json.loads((data / "val.json").read_text())
    val = tmp_path / "val.json"
    _write_records(
        val,
        [
            dict(val_rows[0], problem_id=9005, path="./CLEVRER/synth/corrupt.mp4"),
            {"problem_id": 9006},  # malformed: skipped at load
            *val_rows[1:],
        ],
    )
    cfg = _config(
        assets,
        tmp_path / "run",
        2,
        **{
            "data.train_path": str(mixed),
            "data.val_path": str(val),
            "data.data_root": str(data),
            "data.max_prompt_tokens": 400,
            "data.shuffle": False,  # the three bad records are the first drawn
        },
    )
    with caplog.at_level(logging.INFO):
        run = train(cfg)
    assert _metrics(run)[-1]["skipped_samples"] == 4  # three when drawn, the malformed one at load
    assert [r["val_skipped_samples"] for r in _metrics(run) if "val_accuracy" in r] == [2, 2]
    lines = caplog.text.splitlines()
    for problem_id in (9001, 9002, 9003, 9005):
        named = [x for x in lines if f"problem_id {problem_id}" in x]
        assert len(named) == 1 and "skipping" in named[0], named  # one line each, remembered after
    assert (
        sum("9004" in x for x in lines) == 1 and sum("9006" in x for x in lines) == 1
    )  # malformed: named once
    done = [x for x in lines if "done: " in x]
    assert len(done) == 1 and "samples skipped: 4 training, 2 held-out" in done[0], done


def test_nothing_usable_stops_with_a_clear_error(assets, tmp_path):
    _, data = assets
    rows = json.loads((data / "train.json").read_text())[:2]
    bad = [dict(r, path="./CLEVRER/synth/none.mp4") for r in rows]
    path = tmp_path / "train.json"
    _write_records(path, bad)
    cfg = _config(
        assets,
        tmp_path / "run",
        1,
        **{"data.train_path": str(path), "data.data_root": str(data), "eval.every": 0, "data.val_path": ""},
    )
    with pytest.raises(DatasetError, match="no usable sample"):
        train(cfg)


def test_unreadable_dataset_stops_with_a_clear_error(assets, tmp_path):
    path = tmp_path / "train.json"
    path.write_text("{ not json")
    cfg = _config(
        assets, tmp_path / "run", 1, **{"data.train_path": str(path), "eval.every": 0, "data.val_path": ""}
    )
    with pytest.raises(DatasetError, match=str(path.name)):
        train(cfg)
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


def test_existing_run_folder_is_never_overwritten_by_accident(assets, tmp_path):
    cfg = _config(assets, tmp_path / "run", 1, **{"eval.every": 0, "data.val_path": ""})
    run = train(cfg)
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="--resume.*--overwrite"):
        train(cfg)
    assert (run / "metrics.jsonl").read_text() == before
    train(cfg, overwrite=True)
    assert [row["step"] for row in _metrics(run)] == [1]


def test_a_model_folder_of_another_architecture_stops_the_run_before_it_loads(assets, tmp_path, monkeypatch):
    model, data = assets
    llama = shutil.copytree(model, tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    loaded = []
    monkeypatch.setattr("transformers.AutoProcessor.from_pretrained", lambda *a, **k: loaded.append(a))
    cfg = _config((llama, data), tmp_path / "run", 1)
    with pytest.raises(ValueError, match=r"model_type 'llama'.*Qwen2\.5-VL models \(model_type qwen2_5_vl\)"):
        train(cfg)
    assert not loaded and not (tmp_path / "run").exists()


def test_a_suffix_attention_that_cannot_run_stops_the_run_before_it_writes(assets, tmp_path):
    """model.suffix_attention is checked as the run starts, before its folder holds anything, and before
    --overwrite clears an earlier run there; a rerun with it fixed needs no --overwrite. On the CPU
    (flex needs CUDA)."""
    extra = {"eval.every": 0, "data.val_path": "", "run.device": "cpu"}
    flex = _config(assets, tmp_path / "run", 1, **extra, **{"model.suffix_attention": "flex"})
    with pytest.raises(ValueError, match="model.suffix_attention=flex needs CUDA"):
        train(flex)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    run = train(_config(assets, tmp_path / "run", 1, **extra))
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="model.suffix_attention=flex needs CUDA"):
        train(flex, overwrite=True)
    assert (run / "metrics.jsonl").read_text() == before  # the earlier run is still there


def test_the_suffix_attention_settings_reach_the_suffix_passes(assets, tmp_path, monkeypatch, caplog):
    """The run's model.suffix_attention and model.cascade_kernels are what every suffix pass (reference
    scoring and the actor's loss) is given, and the log names the backend."""
    import rollplex.phases as phases

    seen = set()
    real = phases.suffix_logprobs
    monkeypatch.setattr(phases, "suffix_logprobs", lambda *a, **k: seen.add(k["attention"]) or real(*a, **k))
    settings = {"model.suffix_attention": "cascade", "model.cascade_kernels": "math,math"}
    cfg = _config(assets, tmp_path / "run", 1, **{"eval.every": 0, "data.val_path": "", **settings})
    with caplog.at_level(logging.INFO, logger="rollplex"):
        train(cfg)
    assert seen == {SuffixAttention("cascade", "math,math")}
    assert (
        "suffix attention (how responses attend to their prompt's keys): cascade, model.suffix_attention"
        in caplog.text
    )


def test_resume_without_a_checkpoint_writes_nothing(assets, tmp_path, caplog):
    """``--resume`` on a folder without a checkpoint fails naming it, before any log line, and leaves no
    folder behind."""
    cfg = _config(assets, tmp_path / "none", 1, **{"eval.every": 0, "data.val_path": ""})
    with (
        caplog.at_level(logging.INFO, logger="rollplex"),
        pytest.raises(ValueError, match="no checkpoint in"),
    ):
        train(cfg, resume=True)
    assert not (tmp_path / "none").exists()
    assert caplog.records == []


def test_the_summary_says_when_the_layers_ran_uncompiled(assets, tmp_path, monkeypatch, caplog):
    import rollplex.loop as loop

    monkeypatch.setattr(loop, "compile_fallback", lambda: "RuntimeError: no working C compiler found")
    with caplog.at_level("INFO"):
        train(_config(assets, tmp_path / "run", 1, **{"eval.every": 0, "data.val_path": ""}))
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done:")]
    assert len(done) == 1 and done[0].endswith(
        "layers ran uncompiled (RuntimeError: no working C compiler found)"
    )


def test_resume_with_no_step_left_says_so(assets, tmp_path, caplog):
    """Resuming a run already at ``run.steps`` trains nothing, says why and how to go on, and leaves
    every file of the run folder as it was (its trace, config and metrics included)."""
    cfg = _config(assets, tmp_path / "run", 2, **{"eval.every": 0, "data.val_path": ""})
    run = train(cfg)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with caplog.at_level("INFO"):
        train(cfg, resume=True)
    assert "at step 2 of run.steps=2: nothing left to train (raise run.steps to go on)" in caplog.text
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_the_trace_outlives_a_killed_run_and_a_resume_continues_it(assets, tmp_path, monkeypatch):
    """The trace is written at each checkpoint (every 2 steps here): a run killed in its fourth step
    keeps the first two steps' phases, not the third's; a resumed run killed again after its own
    checkpoint keeps the earlier trace and its own steps up to that checkpoint, after a "resumed" mark;
    the last resume completes it."""
    import rollplex.loop as loop

    real = loop._train_step
    monkeypatch.setattr("rollplex.observe.metrics.FREEZE_MIN_STEPS_LEFT", 0)  # these short runs freeze too

    def killed_at(index):
        def step(run, i, *rest):
            if i == index:
                assert gc.get_freeze_count() > 0  # so that the run's end has something to unfreeze
                raise KeyboardInterrupt
            return real(run, i, *rest)

        return step

    def rollouts(trace: dict) -> list[float]:
        return [e["ts"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "rollout"]

    def marks(trace: dict) -> list[float]:
        return [e["ts"] for e in trace["traceEvents"] if e["ph"] == "i" and e["name"] == "resumed"]

    cfg = _config(assets, tmp_path / "run", 6, **{"eval.every": 0, "data.val_path": ""})
    path = tmp_path / "run" / "trace.json"
    monkeypatch.setattr(loop, "_train_step", killed_at(3))
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    first = json.loads(path.read_text())
    assert len(rollouts(first)) == 2 and marks(first) == []
    assert gc.get_freeze_count() == 0  # what the first step froze is unfrozen by the interruption too
    monkeypatch.setattr(loop, "_train_step", killed_at(5))  # resumes at step 2, saves at 4, dies in 6
    with pytest.raises(KeyboardInterrupt):
        train(cfg, resume=True)
    second = json.loads(path.read_text())
    assert second["traceEvents"][: len(first["traceEvents"])] == first["traceEvents"]
    assert len(rollouts(second)) == 4 and len(marks(second)) == 1
    assert rollouts(second)[2] >= marks(second)[0] >= max(rollouts(first))
    monkeypatch.setattr(loop, "_train_step", real)
    train(cfg, resume=True)  # from step 4
    last = json.loads(path.read_text())
    assert last["traceEvents"][: len(second["traceEvents"])] == second["traceEvents"]
    assert len(rollouts(last)) == 6 and len(marks(last)) == 2
    steps = [e["args"]["step"] for e in last["traceEvents"] if e["ph"] == "X" and e["name"] == "rollout"]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_evaluation_and_checkpoints_are_in_the_trace_and_not_in_the_step_times(assets, tmp_path):
    """Work between steps (held-out evaluation, checkpoint saves) shows in the trace, stamped with the
    step it follows, and stays out of the steps' phase times (``time/*``)."""
    cfg = _config(assets, tmp_path / "run", 3, **{"eval.every": 2, "run.save_every": 1})
    run_dir = train(cfg)
    trace = json.loads((run_dir / "trace.json").read_text())

    def steps(name: str) -> list[int]:
        return [e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == name]

    assert steps("evaluation") == [2, 3] and steps("checkpoint") == [1, 2, 3]
    rows = _metrics(run_dir)
    assert not any(k in row for row in rows for k in ("time/evaluation", "time/checkpoint"))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    last_rollout = max(e["ts"] for e in events if e["name"] == "rollout")
    assert max(e["ts"] for e in events if e["name"] == "evaluation") > last_rollout  # after the last step


def test_each_step_records_the_garbage_collector_passes_it_ran_and_not_those_between_steps(
    assets, tmp_path, monkeypatch, no_automatic_gc
):
    """``gc_s`` and ``gc_passes`` count the collector's passes inside the step only. Automatic passes
    are off; each step forces one pass and each evaluation after a step two, and the fake clock makes
    every pass last 1 s. The survivors of the first step are frozen out of later passes (``gc.freeze``)
    from then until the run ends, and refrozen at each checkpoint (whose passes are not a step's
    either)."""
    import rollplex.loop as loop
    from rollplex.observe.metrics import GcClock

    monkeypatch.setattr("rollplex.observe.metrics.FREEZE_MIN_STEPS_LEFT", 0)  # a 3-step run freezes too
    ticks = itertools.count()
    monkeypatch.setattr(loop, "GcClock", functools.partial(GcClock, clock=lambda: float(next(ticks))))
    real_metrics, real_eval = loop.step_metrics, loop._maybe_eval
    frozen = []  # whether gc's permanent generation held anything, in each step

    def step_metrics(*args):  # called inside the step's timed part
        frozen.append(gc.get_freeze_count() > 0)
        gc.collect()
        return real_metrics(*args)

    monkeypatch.setattr(loop, "step_metrics", step_metrics)
    done, real_done = [], GcClock.step_done
    monkeypatch.setattr(GcClock, "step_done", lambda self, *a: (done.append(a), real_done(self, *a))[1])
    refrozen, real_refreeze = [], GcClock.refreeze
    monkeypatch.setattr(
        GcClock, "refreeze", lambda self, *a: (refrozen.append(a), real_refreeze(self, *a))[1]
    )
    monkeypatch.setattr(
        loop, "_maybe_eval", lambda *a, **k: (gc.collect(), gc.collect(), real_eval(*a, **k))[2]
    )
    callbacks = list(gc.callbacks)
    run_dir = train(_config(assets, tmp_path / "run", 3, **{"eval.every": 1, "run.save_every": 1}))
    rows = [row for row in _metrics(run_dir) if "gc_s" in row]
    assert [(row["step"], row["gc_passes"], row["gc_full_passes"], row["gc_s"]) for row in rows] == [
        (1, 1, 1, 1.0),
        (2, 1, 1, 1.0),
        (3, 1, 1, 1.0),
    ]
    assert gc.callbacks == callbacks  # the run took its callback out again
    assert frozen == [False, True, True] and gc.get_freeze_count() == 0  # frozen after step 1, until the end
    assert refrozen == [(2,), (1,), (0,)]  # at each checkpoint, between steps, with the steps left
    assert done == [(2,), (1,), (0,)]  # after each step, with the steps left


def test_a_resume_from_an_older_checkpoint_traces_each_step_once(assets, tmp_path):
    """The newest checkpoint lost (step 4 of 4): the resume trains steps 3 and 4 again from step 2's,
    and the trace keeps steps 1-2 of the first run and steps 3-4 of the resumed one."""
    cfg = _config(
        assets, tmp_path / "run", 4, **{"eval.every": 0, "data.val_path": "", "run.keep_checkpoints": 2}
    )
    run_dir = train(cfg)
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / "step_000004")
    (ckpts / "latest").unlink()
    train(cfg, resume=True)
    trace = json.loads((run_dir / "trace.json").read_text())
    steps = [e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "rollout"]
    assert steps == [1, 2, 3, 4]
    marks = [e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "i" and e["name"] == "resumed"]
    assert marks == [3]


def test_a_gradient_that_is_not_finite_skips_the_update_and_saves_good_weights(
    assets, tmp_path, monkeypatch, caplog
):
    """A NaN gradient at step 2 (poisoned as the optimizer receives it): the update is dropped, so the
    weights after step 2 equal those after step 1, step 3 trains on, every checkpoint is finite, and the
    step's metrics and the log say what happened."""
    from rollplex.memory.chunked_adamw import ChunkedAdamW

    real, calls = ChunkedAdamW.clip_and_step, []

    def poisoned(self, max_grad_norm):
        calls.append(1)
        if len(calls) == 2:
            grads = [p for p in self.params if p.grad is not None]
            grads[0].grad.view(-1)[0] = float("nan")
        return real(self, max_grad_norm)

    monkeypatch.setattr(ChunkedAdamW, "clip_and_step", poisoned)
    cfg = _config(assets, tmp_path / "run", 3, **{"run.save_every": 1, "run.keep_checkpoints": 3})
    with caplog.at_level(logging.INFO):
        run = train(cfg)
    rows = [r for r in _metrics(run) if "skipped_updates" in r]
    assert [r["skipped_updates"] for r in rows] == [0, 1, 0]
    steps = {
        s: load_file(run / "checkpoints" / f"step_{s:06d}" / "hf" / "model.safetensors") for s in (1, 2, 3)
    }
    assert all(torch.equal(steps[1][k], steps[2][k]) for k in steps[1])  # the update was dropped
    assert any(not torch.equal(steps[2][k], steps[3][k]) for k in steps[2])  # and training went on
    assert all(torch.isfinite(t).all() for weights in steps.values() for t in weights.values())
    assert "step 2: 1 of 1 updates skipped, their gradient norm not finite" in caplog.text
    assert "1 update skipped (gradient norm not finite)" in caplog.text
    from rollplex.checkpoint import load_trainer_state

    assert load_trainer_state(run / "checkpoints" / "step_000003")["updates_skipped"] == 1
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(_config(assets, run, 4, **{"run.save_every": 1, "run.keep_checkpoints": 3}), resume=True)
    assert "1 update skipped (gradient norm not finite)" in caplog.text  # the count survives a resume


@pytest.mark.parametrize("schedule", ["serial", "rollplex"])
def test_b04_rollout_reference_and_actor_read_the_same_vision_tensors(
    assets, tmp_path, monkeypatch, schedule
):
    """B04: every prefix of a group (rollout, reference, actor) is computed from the very same grid,
    pixel and second_per_grid_ts tensors, not from a recomputation: one step of each schedule, every
    prefix call recorded."""
    import rollplex.models.forward as forward
    import rollplex.phases as phases

    real, calls = forward.prefix_states, []

    def spy(model, prompts, **options):
        vision = [(p.pixel_values_videos, p.video_grid_thw, p.second_per_grid_ts) for p in prompts]
        calls.append((model, options["attached"], [p.content_key for p in prompts], vision))
        return real(model, prompts, **options)

    monkeypatch.setattr(forward, "prefix_states", spy)
    monkeypatch.setattr(phases, "prefix_states", spy)
    extra = {"schedule.kind": schedule, "schedule.prefill_fusion": schedule == "rollplex", "eval.every": 0}
    train(_config(assets, tmp_path / "run", 1, **{**extra, "data.val_path": ""}))
    seen: dict = {}
    for model, attached, keys, vision in calls:
        for key, tensors in zip(keys, vision, strict=True):
            seen.setdefault(key, []).append((model, attached, tensors))
    roles = 3 if schedule == "serial" else 2  # with fusion the actor's prefix also seeds rollout
    assert len(seen) == 2 and all(len(uses) == roles for uses in seen.values())
    for uses in seen.values():
        assert len({id(model) for model, _, _ in uses}) == 2  # the actor's and the reference's
        assert any(attached for _, attached, _ in uses) and any(not attached for _, attached, _ in uses)
        first = uses[0][2]
        assert all(t is not None for t in first)
        assert all(all(a is b for a, b in zip(first, tensors, strict=True)) for _, _, tensors in uses)


@pytest.mark.parametrize(("requested", "scope"), [(True, "layer"), (True, "parts"), (False, "parts")])
def test_model_compile_layers_reaches_both_models(assets, tmp_path, monkeypatch, requested, scope):
    """``model.compile_layers`` goes through the CUDA-only gate once, with the run's device, and its
    answer, in ``model.compile_scope``, reaches the actor and the reference (the gate is answered with
    the flag itself here, so the CPU shows the wiring; nothing runs, nothing compiles)."""
    calls = []
    monkeypatch.setattr(
        "rollplex.loop.compiles_layers", lambda flag, device: calls.append((flag, device)) or flag
    )
    overrides = {"model.compile_layers": str(requested).lower(), "model.compile_scope": scope}
    cfg = _config(assets, tmp_path, 1, **{"algo.kl_coef": 0.05, **overrides})
    run = build_run(cfg)
    assert calls == [(requested, torch.device("cpu"))]
    for model in (run.roles.actor, run.roles.reference):
        assert compiled_scope(model) == (scope if requested else None)


def test_settings_that_take_no_effect_are_named_in_a_warning(assets, tmp_path, caplog):
    off = {"model.compile_layers": "false", "model.compile_scope": "parts", "reward.temporal_mu": 0.8}
    cfg = _config(assets, tmp_path / "run", 1, **{"eval.every": 0, "data.val_path": "", **off})
    with caplog.at_level(logging.WARNING):
        train(cfg)
    assert "reward.temporal_mu set, but T-GRPO is off (reward.temporal_alpha=0): ignored" in caplog.text
    assert (
        "model.compile_scope set, but the layers are not compiled (model.compile_layers=false): ignored"
        in caplog.text
    )


def test_model_compile_layers_is_ignored_on_the_cpu(assets, tmp_path):
    cfg = _config(assets, tmp_path, 1, **{"algo.kl_coef": 0.05, "model.compile_layers": "true"})
    run = build_run(cfg)
    assert not layers_compiled(run.roles.actor) and not layers_compiled(run.roles.reference)


def test_b05_a_run_bans_every_vision_special_id_of_its_checkpoint(assets, tmp_path):
    """Field case B05: the ids a run's sampler never draws are the checkpoint's five vision ids
    (vision_start, vision_end, vision_pad, image, video), read from its config and tokenizer."""
    from rollplex.models.presets import vision_special_ids

    run = build_run(_config(assets, tmp_path / "run", 1))
    want = sorted(vision_special_ids(run.roles.actor.config))
    assert len(want) == 5 and run.roles.sampling.banned_ids.tolist() == want


def test_the_last_line_gives_short_runs_in_seconds_and_longer_ones_in_minutes():
    assert [duration_text(s) for s in (3.2, 59.4, 59.6, 84.0, 3600.0)] == [
        "3 s",
        "59 s",
        "1.0 min",
        "1.4 min",
        "60.0 min",
    ]


def test_a_run_is_validated_once_before_it_writes(assets, tmp_path, monkeypatch):
    """``rollplex train`` checks the run's fields (``validate_for_training``) and its reward functions
    exactly once, in ``loop.train``, before anything is written: a bad reward name with --overwrite
    leaves the earlier run in place."""
    import rollplex.config
    import rollplex.loop as loop
    from rollplex.cli import main
    from rollplex.config import save_config

    calls = []
    for module in (loop, rollplex.config):  # wherever a caller would take it from
        real = module.validate_for_training
        monkeypatch.setattr(
            module, "validate_for_training", lambda cfg, real=real: calls.append(1) or real(cfg)
        )
    cfg = _config(assets, tmp_path / "run", 1, **{"eval.every": 0, "data.val_path": ""})
    save_config(cfg, tmp_path / "run.yaml")
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    assert calls == [1]
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert main(["train", str(tmp_path / "run.yaml"), "reward.functions=[nosuch]", "--overwrite"]) == 2
    assert calls == [1, 1] and (tmp_path / "run" / "metrics.jsonl").read_text() == before
