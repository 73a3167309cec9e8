"""Metric sinks: the rows of metrics.jsonl, read back from TensorBoard's event files and from a fake
``wandb`` module (no network); a disabled set writes nothing; a sink turned on without its package
fails at config validation naming the extra to install."""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import pytest

from rollplex.config import ConfigError, LoggingConfig, load_config
from rollplex.observe.metrics import read_metrics
from rollplex.observe.sinks import TENSORBOARD_DIR, MetricSinks

ROWS = [
    {"step": 0, "val_accuracy": 0.25},
    {"step": 1, "reward_mean": 0.5, "time/step": 2.5, "loss": math.nan, "schedule/overlap": True},
    {"step": 2, "reward_mean": 0.75, "time/step": 2.0, "loss": 0.125, "val_accuracy": 0.5},
]


def _comparable(value: float) -> float | str:
    return "nan" if math.isnan(value) else value


def _expected(rows) -> dict[str, list[tuple[int, float | str]]]:
    """{key: [(step, value), ...]} of the rows, NaN as "nan" (so that it compares equal)."""
    out: dict[str, list[tuple[int, float | str]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step":
                out.setdefault(key, []).append((row["step"], _comparable(float(value))))
    return out


def _tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = events.Tags()["scalars"]
    return {tag: [(e.step, _comparable(e.value)) for e in events.Scalars(tag)] for tag in tags}


def _write(sinks: MetricSinks, rows) -> None:
    with sinks:
        for row in rows:
            sinks.write(row)


def test_tensorboard_gets_the_rows_of_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    _write(MetricSinks.open(tmp_path, LoggingConfig(tensorboard=True), {}), ROWS)
    assert read_metrics(tmp_path)[1]["loss"] is None  # strict JSON, where TensorBoard keeps the NaN
    assert _tensorboard_scalars(tmp_path / TENSORBOARD_DIR) == _expected(ROWS)


def test_a_resumed_run_replaces_the_tensorboard_steps_after_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    first = [{"step": s, "loss": float(s)} for s in (1, 2, 3)]
    _write(MetricSinks.open(tmp_path, LoggingConfig(tensorboard=True), {}), first)
    again = [{"step": s, "loss": 10.0 * s} for s in (2, 3)]
    _write(MetricSinks.open(tmp_path, LoggingConfig(tensorboard=True), {}, resume_step=1), again)
    assert _tensorboard_scalars(tmp_path / TENSORBOARD_DIR) == {"loss": [(1, 1.0), (2, 20.0), (3, 30.0)]}
    assert [row["loss"] for row in read_metrics(tmp_path)] == [1.0, 20.0, 30.0]


class _FakeRun:
    def __init__(self, **kwargs):
        self.init = kwargs
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, data: dict, step: int) -> None:
        self.logged.append((dict(data), step))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    """A ``wandb`` module that records its one run (importable, and found by importlib.util.find_spec)."""
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.runs = []
    module.init = lambda **kwargs: module.runs.append(_FakeRun(**kwargs)) or module.runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


@pytest.mark.parametrize("wandb_mode", [None, "online"])
def test_wandb_gets_the_rows_offline_unless_wandb_mode_is_set(tmp_path, fake_wandb, monkeypatch, wandb_mode):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    if wandb_mode is not None:
        monkeypatch.setenv("WANDB_MODE", wandb_mode)
    cfg = load_config(None, ["logging.wandb=true", "logging.wandb_project=video-r1"])
    run_dir = tmp_path / "run-7"
    _write(MetricSinks.open(run_dir, cfg.logging, {"run": {"steps": 2}}), ROWS)
    (run,) = fake_wandb.runs
    assert run.init["mode"] == ("offline" if wandb_mode is None else None)  # None: W&B reads WANDB_MODE
    assert run.init["project"] == "video-r1" and run.init["name"] == "run-7"
    assert run.init["dir"] == str(run_dir) and run.init["config"] == {"run": {"steps": 2}}
    logged: dict[str, list[tuple[int, float | str]]] = {}
    for data, step in run.logged:
        for key, value in data.items():
            logged.setdefault(key, []).append((step, _comparable(value)))
    assert logged == _expected(ROWS)
    assert [step for _, step in run.logged] == [0, 1, 2] and run.finished
    assert len(read_metrics(run_dir)) == len(ROWS)


def test_a_disabled_set_writes_nothing(tmp_path, fake_wandb):
    cfg = LoggingConfig(tensorboard=True, wandb=True)
    _write(MetricSinks.open(tmp_path / "run", cfg, {}, enabled=False), ROWS)
    assert not (tmp_path / "run").exists() and not fake_wandb.runs


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_sink_without_its_package_fails_at_validation_naming_the_extra(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # importlib.util.find_spec: not installed
    with pytest.raises(ConfigError, match=rf"logging\.{name}=true needs .* pip install 'rollplex\[{name}\]'"):
        load_config(None, [f"logging.{name}=true"])
    assert not getattr(load_config(None).logging, name)  # off by default: nothing needed
