"""Atomic, resumable, Hugging Face-compatible checkpoints.

Layout of a run folder::

    run_dir/checkpoints/
        step_000050/
            hf/                 model.save_pretrained (safetensors) + processor.save_pretrained
            trainer_state.pt    torch.save of the loop's dict (optimizer, RNG states, data cursor, step, ...)
            checkpoint.json     completion marker, written last: {"format": 1, "step": 50, "files": [...]}
        step_000100/
        latest                  text file naming the newest complete checkpoint folder ("step_000100")

A save writes everything into a hidden temporary sibling (``.tmp-step_000100``), fsyncs every file and
folder, writes the marker, renames the folder to its final name (``os.rename`` is atomic on POSIX),
then replaces ``latest`` atomically (``os.replace``), and only then removes checkpoints beyond ``keep``
(each first renamed to a hidden ``.trash-*`` name, so a half-deleted folder never looks complete).
A process killed at any point leaves the previous checkpoint intact and ``latest`` naming it; the hidden
leftovers are ignored by readers and removed by the next save.

A run of several processes (torchrun) writes one checkpoint with the same ``hf/`` folder (rank 0
gathers the tensor-parallel shards into full tensors: users get Hugging Face weights back) and
``trainer_state.pt`` (the run's state and its ``parallel`` layout), plus one ``rank_NNNNN.pt`` per
process (its optimizer shard and random states; ``save_sharded_checkpoint``). Every rank writes its
file into the same hidden folder before rank 0 writes the marker and renames it, so the same atomicity
holds. The run folder must be on a file system every node sees.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollplex.files import make_readable
from rollplex.parallel.dist import ParallelContext, guard

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MARKER = "checkpoint.json"
TRAINER_STATE = "trainer_state.pt"
HF_DIR = "hf"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_FORMAT = 1


def step_dir_name(step: int) -> str:
    """Folder name of the checkpoint of ``step``: ``step_{step:06d}``."""
    return f"step_{step:06d}"


def _fsync_path(path: Path) -> None:
    """fsync one file or folder (folders: so that entries created or renamed in them are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root``, children before parents."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(Path(folder) / name)
        _fsync_path(Path(folder))


def _write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, fsync it, then ``os.replace`` it onto ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _remove_leftovers(root: Path) -> None:
    """Delete hidden temporaries of killed saves or prunes (``.tmp-*``, ``.trash-*``)."""
    for entry in root.iterdir():
        if entry.name.startswith((".tmp-", ".trash-")):
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def is_complete(ckpt: Path) -> bool:
    """True when ``ckpt`` is a ``step_*`` folder whose marker names its step and every listed file exists."""
    match = _STEP_DIR.match(ckpt.name)
    marker = ckpt / MARKER
    if match is None or not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    return meta.get("step") == int(match.group(1)) and all(
        (ckpt / f).is_file() for f in meta.get("files", [])
    )


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders of ``run_dir``, oldest step first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder of ``run_dir``, or None when there is none.

    ``checkpoints/latest`` decides when it names a complete folder (so a complete folder left by a save
    killed between its rename and the ``latest`` update is not used). When ``latest`` is missing or names
    an incomplete folder, the complete ``step_*`` folder with the highest step is returned. Hidden
    temporaries (``.tmp-*``, ``.trash-*``) are never returned.
    """
    root = Path(run_dir) / CHECKPOINTS
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        if is_complete(named):
            return named
    complete = list_checkpoints(run_dir)
    return complete[-1] if complete else None


def checkpoint_step(ckpt: Path) -> int:
    """Step number of a checkpoint folder (from its marker). Raises ``ValueError`` if it is incomplete."""
    if not is_complete(ckpt):
        raise ValueError(f"checkpoint {str(ckpt)!r} is missing or incomplete (no valid {MARKER})")
    return int(json.loads((ckpt / MARKER).read_text())["step"])


def rank_state_name(rank: int) -> str:
    """File of rank ``rank``'s training state in a checkpoint of several processes."""
    return f"rank_{rank:05d}.pt"


def _write_contents(
    tmp: Path, step: int, model: Any, processor: Any, trainer_state: dict, weights: dict | None = None
) -> None:
    """Model (``weights`` as its state dict when given), processor and trainer state into ``tmp``, then
    fsync, then the marker (fsynced) last, listing every file in ``tmp`` (rank files included)."""
    if weights is None:
        model.save_pretrained(tmp / HF_DIR)
    else:
        model.save_pretrained(tmp / HF_DIR, state_dict=weights)
    if processor is not None:
        processor.save_pretrained(tmp / HF_DIR)
    torch.save(trainer_state, tmp / TRAINER_STATE)
    make_readable(tmp)
    _fsync_tree(tmp)
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    with open(tmp / MARKER, "w") as f:
        json.dump({"format": _FORMAT, "step": step, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(tmp)


def _prune(root: Path, keep: int, newest: Path) -> None:
    """Remove complete checkpoints beyond the ``keep`` newest; ``newest`` is never removed."""
    complete = list_checkpoints(root.parent)
    excess = max(0, len(complete) - keep)
    for path in [p for p in complete if p != newest][:excess]:
        trash = root / f".trash-{path.name}"
        os.rename(path, trash)
        _fsync_path(root)
        shutil.rmtree(trash)


def _check_finite(model: Any, step: int, weights: dict | None = None) -> None:
    """Refuse to save weights with a NaN or inf (they would replace, and prune, the good checkpoints).
    Checks ``weights`` (name -> tensor) or else ``model.named_parameters()`` where the model has them,
    with one device synchronisation."""
    named = weights.items if weights is not None else getattr(model, "named_parameters", None)
    if named is None:
        return
    params = [(name, p) for name, p in named() if p.is_floating_point()]
    if not params:
        return
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in params])
    if not bool(finite.all()):
        first = params[int((~finite).nonzero()[0])][0]
        raise ValueError(
            f"step {step}: the model's weights are not finite (first: {first}); not saving, so the "
            "last good checkpoint stays the latest"
        )


def save_checkpoint(
    run_dir: Path, step: int, *, model: Any, processor: Any, trainer_state: dict, keep: int
) -> Path:
    """Atomically write the checkpoint of ``step`` and return its folder ``run_dir/checkpoints/step_{step:06d}``.

    Args:
        model: object with ``save_pretrained(folder)`` (an HF ``PreTrainedModel``; safetensors weights).
        processor: object with ``save_pretrained(folder)`` written into the same ``hf/`` folder, or None.
        trainer_state: dict saved with ``torch.save`` (optimizer state, ``rng_state()``, data cursor, step).
        keep: number of newest complete checkpoints left on disk after this save (>= 1).

    Raises ``ValueError`` for ``keep < 1``, a negative step, weights with a NaN or inf (nothing is
    written, so the last good checkpoint stays the latest), or when the checkpoint of ``step`` already
    exists and is the one ``latest`` names (it would be overwritten non-atomically). A complete folder of
    the same step that ``latest`` does not name (left by a save killed before its ``latest`` update) is
    replaced.
    """
    _check_arguments(step, keep)
    _check_finite(model, step)
    final, tmp = _prepare(run_dir, step)
    _write_contents(tmp, step, model, processor, trainer_state)
    return _publish(run_dir, final, tmp, keep)


def _check_arguments(step: int, keep: int) -> None:
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")


def _prepare(run_dir: Path, step: int) -> tuple[Path, Path]:
    """The final and the hidden temporary folder of ``step``'s checkpoint, the temporary one created
    (``save_checkpoint``'s clean-up of leftovers and of an unpublished folder of the same step).

    Raises:
        ValueError: the step's checkpoint exists and is the latest.
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    final = root / step_dir_name(step)
    if final.exists():
        if latest_checkpoint(run_dir) == final:
            raise ValueError(
                f"checkpoint {str(final)!r} already exists and is the latest; refusing to overwrite"
            )
        os.rename(final, root / f".trash-{final.name}")
        _remove_leftovers(root)
    tmp = root / f".tmp-{final.name}"
    tmp.mkdir()
    return final, tmp


def _publish(run_dir: Path, final: Path, tmp: Path, keep: int) -> Path:
    """Rename the complete temporary folder onto ``final``, point ``latest`` at it, prune."""
    root = final.parent
    os.rename(tmp, final)
    _fsync_path(root)
    _write_text_atomic(root / LATEST, final.name + "\n")
    _prune(root, keep, final)
    return final


def save_sharded_checkpoint(
    run_dir: Path,
    step: int,
    *,
    ctx: ParallelContext,
    model: Any,
    weights: dict | None,
    processor: Any,
    trainer_state: dict,
    rank_state: dict,
    keep: int,
) -> Path:
    """``save_checkpoint`` for a run of several processes; every rank calls it.

    Rank 0 prepares the hidden folder; every rank writes ``rank_state`` (its optimizer shard, random
    states) there as ``rank_NNNNN.pt``; then rank 0 writes ``hf/`` from ``weights`` (the full tensors
    ``parallel.runtime.ParallelRuntime.full_state_dict`` gathered; ``model`` gives its config),
    ``trainer_state.pt`` and the marker, and publishes the folder. The ranks meet between the stages
    (``parallel.dist.guard``: a failure on any rank stops every rank there, nothing published).

    Raises:
        ValueError: as ``save_checkpoint`` (on rank 0; ``RankFailure`` on the others).
    """
    root = Path(run_dir) / CHECKPOINTS
    final, tmp = root / step_dir_name(step), root / f".tmp-{step_dir_name(step)}"
    with guard(ctx, "checkpoint"):
        if ctx.is_writer:
            _check_arguments(step, keep)
            _check_finite(model, step, weights)
            final, tmp = _prepare(run_dir, step)
    with guard(ctx, "checkpoint"):
        torch.save(rank_state, tmp / rank_state_name(ctx.rank))
    with guard(ctx, "checkpoint"):
        if ctx.is_writer:
            _write_contents(tmp, step, model, processor, trainer_state, weights)
            _publish(run_dir, final, tmp, keep)
    return final


def load_rank_state(ckpt: Path, rank: int) -> dict:
    """Rank ``rank``'s file of a checkpoint of several processes (``save_sharded_checkpoint``).

    Raises:
        ValueError: the checkpoint is incomplete or has no file of this rank.
    """
    checkpoint_step(ckpt)
    path = Path(ckpt) / rank_state_name(rank)
    if not path.is_file():
        raise ValueError(
            f"checkpoint {str(ckpt)!r} has no {path.name}: it was not written by this rank's run"
        )
    return torch.load(path, map_location="cpu", weights_only=False)


def check_layout(state: dict, layout: dict, ckpt: Path) -> None:
    """A checkpoint resumes only on the world size and ``parallel:`` section that wrote it.

    Args:
        state: its ``trainer_state`` (``parallel``: the writer's layout; absent: one process).
        layout: this run's (``ParallelRuntime.layout_key``; ``{"world": 1}`` for one process).

    Raises:
        ValueError: the layouts differ, naming both.
    """
    saved = state.get("parallel") or {"world": 1}
    if saved != layout:

        def text(lay: dict) -> str:
            return ", ".join(f"{k}={v}" for k, v in lay.items())

        raise ValueError(
            f"checkpoint {str(ckpt)!r} was written by a run of {saved['world']} process(es) ({text(saved)}); "
            f"this run has {text(layout)}: resume with the same WORLD_SIZE (torchrun --nproc-per-node × "
            "nodes) and parallel section, or start a new run"
        )


def load_trainer_state(ckpt: Path) -> dict:
    """The ``trainer_state`` dict of a complete checkpoint, tensors on CPU.

    The file is unpickled with ``weights_only=False``: load only checkpoints this program wrote.
    Raises ``ValueError`` when ``ckpt`` is not a complete checkpoint folder.
    """
    checkpoint_step(ckpt)
    return torch.load(Path(ckpt) / TRAINER_STATE, map_location="cpu", weights_only=False)


def rng_state() -> dict:
    """Generator states of python ``random``, numpy's global generator, torch CPU and (when available) CUDA.

    Returns ``{"python": tuple, "numpy": tuple, "torch": uint8 tensor, "cuda": [uint8 tensor per device]}``
    (``"cuda"`` only when CUDA is available).
    """
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the states returned by ``rng_state``; CUDA states are restored when present and CUDA is available."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
