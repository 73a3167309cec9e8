"""Checkpoints: layout, pruning, ``latest``, RNG round trip, and atomicity under a real SIGKILL."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rollplex import checkpoint as ck
from rollplex.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

REPO = Path(__file__).resolve().parents[1]


class FakeModel:
    """Stands in for a PreTrainedModel: one safetensors file holding ``value``."""

    def __init__(self, value: float):
        self.value = value

    def save_pretrained(self, folder: Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.full((3,), self.value)}, str(Path(folder) / "model.safetensors"))


def _save(run_dir: Path, step: int, keep: int = 2) -> Path:
    return save_checkpoint(
        run_dir, step, model=FakeModel(step), processor=None, trainer_state={"step": step}, keep=keep
    )


def _weights(ckpt: Path) -> float:
    return float(load_file(str(ckpt / "hf" / "model.safetensors"))["w"][0])


def test_layout_latest_and_pruning(tmp_path):
    for step in (10, 20, 30):
        path = _save(tmp_path, step, keep=2)
        assert path == tmp_path / "checkpoints" / f"step_{step:06d}"
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000020", "step_000030"]
    assert (root / "latest").read_text().strip() == "step_000030"
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt == root / "step_000030"
    assert _weights(ckpt) == 30.0
    assert load_trainer_state(ckpt) == {"step": 30}
    marker = json.loads((ckpt / "checkpoint.json").read_text())
    assert marker["step"] == 30 and sorted(marker["files"]) == ["hf/model.safetensors", "trainer_state.pt"]
    assert ck.checkpoint_step(ckpt) == 30


def test_no_checkpoint_and_bad_arguments(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert list_checkpoints(tmp_path) == []
    with pytest.raises(ValueError, match="keep=0"):
        _save(tmp_path, 1, keep=0)
    with pytest.raises(ValueError, match="incomplete"):
        load_trainer_state(tmp_path / "checkpoints" / "step_000001")


def test_incomplete_folders_are_ignored_and_leftovers_cleaned(tmp_path):
    _save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_000002" / "hf").mkdir(parents=True)  # a killed save
    unmarked = root / "step_000003"  # a folder without its marker
    unmarked.mkdir()
    assert latest_checkpoint(tmp_path) == root / "step_000001"
    (root / "latest").write_text("step_000003\n")  # latest naming an incomplete folder
    assert latest_checkpoint(tmp_path) == root / "step_000001"
    (root / "latest").unlink()
    assert latest_checkpoint(tmp_path) == root / "step_000001"
    _save(tmp_path, 2)
    assert not (root / ".tmp-step_000002").exists()
    assert latest_checkpoint(tmp_path) == root / "step_000002"


def test_missing_listed_file_makes_a_checkpoint_incomplete(tmp_path):
    _save(tmp_path, 1)
    second = _save(tmp_path, 2)
    (second / "trainer_state.pt").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000001"


def test_crash_before_latest_update_keeps_previous_and_is_repaired(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def crash(path, text):
        raise OSError("killed before latest was replaced")

    monkeypatch.setattr(ck, "_write_text_atomic", crash)
    with pytest.raises(OSError):
        _save(tmp_path, 2)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert (root / "step_000002").is_dir()  # complete but not named by latest
    assert latest_checkpoint(tmp_path) == root / "step_000001"
    path = save_checkpoint(tmp_path, 2, model=FakeModel(7.0), processor=None, trainer_state={}, keep=2)
    assert latest_checkpoint(tmp_path) == path and _weights(path) == 7.0


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    """A model with a NaN weight is refused before anything is written: the last good checkpoint stays
    the latest, and none is pruned."""
    _save(tmp_path, 1)
    good = _save(tmp_path, 2)
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.bias[1] = float("nan")
    with pytest.raises(ValueError, match="not finite.*bias"):
        save_checkpoint(tmp_path, 3, model=model, processor=None, trainer_state={}, keep=1)
    assert latest_checkpoint(tmp_path) == good
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_000001", "step_000002"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step_000001",
        "step_000002",
    ]


def test_refuses_to_overwrite_the_latest_checkpoint(tmp_path):
    _save(tmp_path, 5)
    with pytest.raises(ValueError, match="already exists"):
        _save(tmp_path, 5)
    assert _weights(latest_checkpoint(tmp_path)) == 5.0


def _draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    state = rng_state()
    expected = _draw()
    save_checkpoint(tmp_path, 1, model=FakeModel(0.0), processor=None, trainer_state={"rng": state}, keep=1)
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draw() != expected
    set_rng_state(load_trainer_state(latest_checkpoint(tmp_path))["rng"])
    assert _draw() == expected


CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2_5_VLProcessor, Qwen2VLImageProcessor)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from rollplex.checkpoint import save_checkpoint

    run_dir, flag = Path(sys.argv[1]), Path(sys.argv[2])
    text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                  fullatt_block_indexes=[0], window_size=112, tokens_per_second=2)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=60, video_token_id=61,
                              vision_start_token_id=62, vision_end_token_id=63)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    vocab = {f"t{i}": i for i in range(60)}
    vocab.update({"<|image_pad|>": 60, "<|video_pad|>": 61, "<|vision_start|>": 62, "<|vision_end|>": 63})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(), video_processor=Qwen2VLVideoProcessor(),
                                    tokenizer=PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0"))
    param_sum = sum(p.double().sum().item() for p in model.parameters())
    save_checkpoint(run_dir, 1, model=model, processor=processor, trainer_state={"step": 1, "sum": param_sum}, keep=2)

    real_save = torch.save
    def slow_save(obj, path, *args, **kwargs):  # the checkpoint of step 2 stalls mid-save
        real_save(obj, path, *args, **kwargs)
        flag.write_text("in the middle of save 2")
        time.sleep(120)
    torch.save = slow_save
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_checkpoint(run_dir, 2, model=model, processor=processor, trainer_state={"step": 2}, keep=2)
    """
)


def test_sigkill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run_dir, flag = tmp_path / "run", tmp_path / "flag"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, str(script), str(run_dir), str(flag)], cwd=REPO, env=env)
    deadline = time.monotonic() + 600  # a cold import of torch and transformers on a loaded machine
    try:
        while not flag.exists():
            assert child.poll() is None, f"child exited early with {child.returncode}"
            assert time.monotonic() < deadline, "child never reached the middle of the second save"
            time.sleep(0.05)
    finally:
        child.kill()  # SIGKILL, also when the wait fails (no child left sleeping); nothing once it has exited
    assert child.wait(timeout=30) == -signal.SIGKILL

    root = run_dir / "checkpoints"
    assert (root / ".tmp-step_000002" / "trainer_state.pt").is_file()  # the killed save got this far
    ckpt = latest_checkpoint(run_dir)
    assert ckpt == root / "step_000001"
    state = load_trainer_state(ckpt)
    assert state["step"] == 1
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt / "hf")
    assert sum(p.double().sum().item() for p in model.parameters()) == pytest.approx(state["sum"], abs=1e-9)
    processor = AutoProcessor.from_pretrained(ckpt / "hf")
    assert processor.tokenizer.convert_tokens_to_ids("<|video_pad|>") == 61

    path = save_checkpoint(run_dir, 2, model=model, processor=processor, trainer_state={"step": 2}, keep=2)
    assert latest_checkpoint(run_dir) == path == root / "step_000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(path / "hf")
    for a, b in zip(model.state_dict().values(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
