"""The embedded default run: a tiny Qwen2.5-VL trained from scratch on synthetic videos.

``rollplex train`` with no config uses it. On first use it writes, once, into the cache folder
(``$ROLLPLEX_CACHE`` or ``~/.cache/rollplex``):

    default-v3/model/   ``rollplex model init --preset tiny``   (``CACHE_VERSION``)
    default-v3/data/    ``rollplex data synth`` (colour questions, canonical option order)

The task: four-way multiple choice "what colour is the largest shape?" on 8-frame 112×112 clips (four
frames sampled at 2 fps → 32 video tokens per prompt) with one large shape and up to three small ones.
The model starts from random weights, so the prompt uses the ``answer_only`` template, the response is
one token (the option letter) and the reward is ``answer_accuracy``; chance accuracy is 0.25. A model
trained from scratch does not find a multi-token answer format (letter, then end of turn) by sampling
within minutes; multi-token decoding, EOS handling and the suffix pass are exercised by the tests and by
real configs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CACHE_VERSION = "default-v3"
WIDTH = HEIGHT = 112
FRAMES, FPS = 8, 4.0
NUM_SAMPLES, SEED = 1200, 0
DOMINANT_SCALE = 1.7  # the largest shape covers about a third of the frame


def cache_root() -> Path:
    """``$ROLLPLEX_CACHE`` if set, else ``~/.cache/rollplex``."""
    return Path(os.environ.get("ROLLPLEX_CACHE", Path.home() / ".cache" / "rollplex"))


def _build_once(target: Path, build) -> Path:
    """Run ``build(tmp)`` into a temporary sibling and rename it to ``target`` (atomic); skip if present."""
    if target.exists():
        return target
    print(f"rollplex: preparing the embedded default job's {target.name} in {target} (once)", flush=True)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    build(tmp)
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.exists():
            raise
    return target


def prepare_default(root: Path | None = None) -> tuple[Path, Path]:
    """Create (once) the tiny checkpoint and the synthetic dataset; returns (model folder, data folder)."""
    from rollplex.data.synth import generate_dataset
    from rollplex.models.presets import init_checkpoint

    base = (root or cache_root()) / CACHE_VERSION
    model = _build_once(base / "model", lambda out: init_checkpoint("tiny", out, seed=SEED))
    data = _build_once(
        base / "data",
        lambda out: generate_dataset(
            out,
            NUM_SAMPLES,
            SEED,
            width=WIDTH,
            height=HEIGHT,
            num_frames=FRAMES,
            fps=FPS,
            val_fraction=0.1,
            families=("color",),
            dominant_scale=DOMINANT_SCALE,
            progress=True,
        ),
    )
    return model, data


def default_run_config(root: Path | None = None, prepare: bool = True) -> dict:
    """The nested config dict of the default run; ``prepare`` builds its cache first (without it the
    paths point where the cache would be, for listing the settings)."""
    if prepare:
        model, data = prepare_default(root)
    else:
        base = (root or cache_root()) / CACHE_VERSION
        model, data = base / "model", base / "data"
    pixels = WIDTH * HEIGHT
    return {
        "run": {"out_dir": "runs/default", "steps": 200, "save_every": 50, "seed": 0},
        "model": {"path": str(model)},
        "data": {
            "train_path": str(data / "train.json"),
            "val_path": str(data / "val.json"),
            "template": "answer_only",
            "max_prompt_tokens": 512,
            "video_min_pixels": pixels,
            "video_max_pixels": pixels,
            "video_max_frames": FRAMES,
        },
        "rollout": {"group_size": 8, "prompts_per_step": 16, "max_response_tokens": 1, "temperature": 1.0},
        "algo": {"kl_coef": 0.001, "clip_high": 0.28},
        "reward": {"functions": ["answer_accuracy"]},
        "optim": {"lr": 3e-4, "weight_decay": 0.0, "max_grad_norm": 1.0},
        "eval": {"every": 25, "num_prompts": 120},
    }
