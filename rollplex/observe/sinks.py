"""Where each metric row goes: ``metrics.jsonl`` always, TensorBoard and Weights & Biases on request.

The loop writes every row once, to ``MetricSinks``; each sink gets the same row
(``{"step": int, "<name>": float | int | bool, ...}``, the keys of observe.metrics):

- ``MetricsWriter``: ``run_dir/metrics.jsonl``, the run's record (report, resume and bench read it).
- ``TensorBoardSink`` (``logging.tensorboard``): one scalar per key, tagged with the key, at the row's
  step, in ``run_dir/tensorboard`` (``torch.utils.tensorboard.SummaryWriter``); view it with
  ``tensorboard --logdir run_dir/tensorboard``.
- ``WandbSink`` (``logging.wandb``): ``wandb.log(row, step=step)`` in one W&B run per training process
  (project ``logging.wandb_project``, named after the run folder, the run config attached), offline
  into ``run_dir/wandb`` unless the environment sets ``WANDB_MODE`` (``wandb sync`` uploads an offline run).

A value that is not finite (a loss gone NaN) reaches TensorBoard and W&B as it is, where
``metrics.jsonl`` writes ``null`` (strict JSON). A resumed run rewrites the steps after its
checkpoint: ``metrics.jsonl`` drops its rows after that step, TensorBoard is told to discard them
(``purge_step``), and W&B starts a new run whose steps continue from the checkpoint's.

Only one process of a run writes metrics: ``MetricSinks.open(..., enabled=False)`` (every process but
rank 0 of a multi-process run) gives a ``MetricSinks`` that writes nothing and opens no file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from rollplex.config import LoggingConfig
from rollplex.observe.metrics import MetricsWriter

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"

Row = Mapping[str, float | int | bool]


class MetricSink(Protocol):
    """Receives every metric row of the run, in step order."""

    def write(self, row: Row) -> None: ...

    def close(self) -> None: ...


def _scalars(row: Row) -> dict[str, float]:
    """The row's metrics without ``step``, as floats."""
    return {key: float(value) for key, value in row.items() if key != "step"}


class TensorBoardSink:
    """One TensorBoard scalar per metric at the row's step, flushed after each row.

    Args:
        log_dir: the event files' folder (created if missing).
        resume_step: where a resumed run continues; TensorBoard discards the events of later steps
            that the earlier run wrote (``purge_step``). None: a new run.
    """

    def __init__(self, log_dir: Path, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step is not None else None
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def write(self, row: Row) -> None:
        for key, value in _scalars(row).items():
            self._writer.add_scalar(key, value, global_step=row["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """The rows as ``wandb.log`` calls of one W&B run.

    Args:
        run_dir: the run folder; W&B writes under ``run_dir/wandb``, and the run is named after it.
        project: W&B project.
        config: the run's resolved config (nested dict), attached to the W&B run.

    Offline (``mode="offline"``) unless ``WANDB_MODE`` is set, which then decides (W&B reads it).
    """

    def __init__(self, run_dir: Path, project: str, config: Mapping):
        import wandb

        (run_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        mode = None if "WANDB_MODE" in os.environ else "offline"
        self._run = wandb.init(
            project=project, name=run_dir.name, dir=str(run_dir), config=dict(config), mode=mode
        )

    def write(self, row: Row) -> None:
        self._run.log(_scalars(row), step=row["step"])

    def close(self) -> None:
        self._run.finish()


class MetricSinks:
    """Every sink of the run behind one ``write`` and one ``close`` (a context manager too).

    Example:
        sinks = MetricSinks.open(run_dir, cfg.logging, config_to_dict(cfg))
        sinks.write({"step": 1, "reward_mean": 0.5, "time/step": 2.1})
        sinks.close()
    """

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = sinks

    @classmethod
    def open(
        cls,
        run_dir: Path,
        cfg: LoggingConfig,
        config: Mapping,
        resume_step: int | None = None,
        enabled: bool = True,
    ) -> MetricSinks:
        """The sinks ``cfg`` turns on, ``metrics.jsonl``'s first, for the run in ``run_dir``.

        Args:
            config: the run's resolved config (nested dict), for W&B.
            resume_step: None for a new run; a resumed run's checkpoint step (rows after it are replaced).
            enabled: False gives no sink at all (a process that is not rank 0).
        """
        if not enabled:
            return cls([])
        run_dir = Path(run_dir)
        sinks: list[MetricSink] = [MetricsWriter(run_dir, resume_step=resume_step)]
        if cfg.tensorboard:
            sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIR, resume_step))
        if cfg.wandb:
            sinks.append(WandbSink(run_dir, cfg.wandb_project, config))
        return cls(sinks)

    def write(self, row: Row) -> None:
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
