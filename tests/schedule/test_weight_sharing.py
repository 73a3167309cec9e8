"""B16 (field cases): the rollout reads the trainer's current weights. With a tied and an untied output
head, and a trainable vision tower, every rollout after an update scores its tokens as the trainer does
under the same θ_k; the update reaches the head, the embedding and the vision tower; tying survives the
update; and a step never touches the frozen reference model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollplex.loop import build_run, train
from rollplex.observe.metrics import PhaseTimer
from rollplex.schedule import make_step
from tests.schedule.test_same_update import SCHEDULES
from tests.test_loop import _config, _weights, assets  # noqa: F401  (fixture)

HEAD, EMBEDDING = "lm_head.weight", "model.language_model.embed_tokens.weight"


def _checkpoint(assets, tmp_path, tie: bool):  # noqa: F811
    """The tiny test checkpoint (untied), or a copy that ties the head to the embedding as published tied
    checkpoints do (Qwen2.5-VL-3B): ``tie_word_embeddings`` in the config, no ``lm_head.weight`` stored."""
    model, _ = assets
    if not tie:
        return model
    tied = tmp_path / "tied-model"
    shutil.copytree(model, tied)
    config = json.loads((tied / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(config))
    weights = load_file(tied / "model.safetensors")
    del weights[HEAD]
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    return tied


@pytest.mark.parametrize("schedule", ["serial", "rollplex"])
@pytest.mark.parametrize("tie", [False, True])
def test_b16_rollouts_read_the_updated_weights(assets, tmp_path, tie, schedule):  # noqa: F811
    path = _checkpoint(assets, tmp_path, tie)
    overrides = {
        "model.path": str(path),
        "algo.kl_coef": 0.05,
        "optim.weight_decay": 0.0,
        "run.device": "cpu",
        "reward.functions": "[rollplex.bench.common:distinct_reward]",
    }
    # no weight decay: a parameter changes only if a nonzero gradient reached it. On the CPU in float32,
    # where a stale rollout stands out (≥ 2e-5) against the trainer's log-probs (≤ 1e-6); a bf16 rollout's
    # differences (1.7e-2 on CUDA) would hide it
    cfg = _config(assets, tmp_path / "run", 3, **overrides, **SCHEDULES[schedule])
    run = build_run(cfg)
    actor, reference = run.roles.actor, run.roles.reference
    assert (actor.lm_head.weight.data_ptr() == actor.get_input_embeddings().weight.data_ptr()) == tie
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    reference_before = {k: v.clone() for k, v in reference.state_dict().items()}
    step = make_step(cfg, run.device)
    diffs, advantages = [], []
    for _ in range(3):
        scored, stats, _, _ = step(run.roles, run.train.next_batch(), PhaseTimer())
        diffs.append(max(s.logprob_diff_max for s in stats))
        advantages.append(scored.advantages.abs().max().item())
    # the rollout's recorded log-probs are the trainer's under the same weights, after updates as before
    # (measured ≤ 1e-6; a rollout reading the step-0 weights differs by 2e-5 after one update, 0.05-1 after two)
    assert max(diffs) <= 1e-5, diffs
    assert advantages[0] > 0, advantages  # the premise: the first update has something to move
    after = actor.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert {HEAD, EMBEDDING} <= changed
    assert any(k.startswith("model.visual.") for k in changed)
    assert (actor.lm_head.weight.data_ptr() == actor.get_input_embeddings().weight.data_ptr()) == tie
    assert tie == torch.equal(after[HEAD], after[EMBEDDING])
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in reference_before.items())


def test_b16_tied_checkpoint_round_trip(assets, tmp_path, caplog):  # noqa: F811
    """A trained tied model's HF checkpoint stays tied: no separate head tensor stored, and transformers
    loads it with the head tied to the trained embedding (no untie warning), equal to the saved values."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = _checkpoint(assets, tmp_path, tie=True)
    run = train(_config(assets, tmp_path / "run", 2, **{"model.path": str(path)}))
    saved = _weights(run)
    assert HEAD not in saved
    latest = (run / "checkpoints" / "latest").read_text().strip()
    with caplog.at_level("WARNING"):
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(run / "checkpoints" / latest / "hf")
    assert "NOT tie" not in caplog.text
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    stored = "model.embed_tokens.weight"  # the embedding's name in the published checkpoint layout
    assert torch.equal(model.get_input_embeddings().weight, saved[stored])
    assert not torch.equal(saved[stored], load_file(path / "model.safetensors")[stored])  # trained
