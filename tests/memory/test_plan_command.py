"""``rollplex plan``: the architecture from a checkpoint folder or a preset, the workload from the
config, text and JSON output, and errors that name the setting."""

from __future__ import annotations

import json

import pytest
import torch

from rollplex.cli import main
from rollplex.config import load_config
from rollplex.memory.plan_command import PlanInputs, architecture, plan_config, plan_text, workload
from rollplex.memory.shapes import Architecture


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  preset: qwen2.5-vl-3b\n  gradient_checkpointing: true\n"
        "rollout:\n  prompts_per_step: 8\n  max_response_tokens: 512\n"
        "memory:\n  device_budget_gib: 72\n  host_budget_gib: 100\n"
    )
    return path


def test_the_workload_comes_from_the_config(config):
    cfg = load_config(config)
    work = workload(cfg, PlanInputs())
    assert (work.groups, work.group_size, work.prompt_tokens, work.response_tokens) == (8, 8, 8192, 512)
    # 16 frames = 8 frame pairs of 100352 / 28² = 128 merged tokens
    assert work.vision_tokens == 1024 and work.gradient_checkpointing and work.reference
    assert work.schedule == "serial" and work.dtype_bytes == 2
    given = workload(cfg, PlanInputs(prompt_tokens=3920, vision_tokens=3520))
    assert (given.prompt_tokens, given.vision_tokens) == (3920, 3520)
    assert workload(cfg, PlanInputs(prompt_tokens=500)).vision_tokens == 500  # at most the prompt


def test_a_checkpoint_folder_gives_the_presets_architecture(tmp_path, config):
    from rollplex.models.presets import preset_config

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(preset_config("qwen2.5-vl-3b").to_dict()))
    arch, source = architecture(load_config(config, [f"model.path={folder}", "model.preset=tiny"]))
    assert arch == Architecture.from_preset("qwen2.5-vl-3b") and source == str(folder / "config.json")
    arch, source = architecture(load_config(config, [f"model.path={tmp_path / 'nowhere'}"]))
    assert source == "preset qwen2.5-vl-3b"  # not a folder: the preset
    with pytest.raises(
        ValueError, match="model.path='.*nowhere' is not a folder and model.preset is not set"
    ):
        architecture(load_config(config, [f"model.path={tmp_path / 'nowhere'}", "model.preset="]))
    with pytest.raises(ValueError, match="model.path is empty and model.preset is not set"):
        architecture(load_config(config, ["model.preset="]))
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        architecture(load_config(config, [f"model.path={folder}"]))


def test_a_flat_config_json_of_transformers_4_reads_the_same():
    from rollplex.models.presets import preset_config

    nested = preset_config("qwen2.5-vl-7b").to_dict()
    flat = {**{k: v for k, v in nested.items() if k != "text_config"}, **nested["text_config"]}
    assert Architecture.from_hf_config(flat) == Architecture.from_hf_config(nested)
    with pytest.raises(ValueError, match="'num_hidden_layers'"):
        Architecture.from_hf_config({"hidden_size": 8, "num_attention_heads": 2, "vision_config": {}})


def test_text_and_json(config):
    cfg = load_config(config)
    text = plan_text(cfg, PlanInputs(prompt_tokens=3920, vision_tokens=3520))
    first, header = text.splitlines()[:2]
    assert first.startswith(
        "preset qwen2.5-vl-3b (3.75B parameters), serial schedule: G=8 groups of N=8, P=3920"
    )
    assert header.split()[0] == "state" and "budget 72.0 GiB" in text
    out = json.loads(plan_text(cfg, PlanInputs(), as_json=True))
    assert {"inputs", "naive_gib", "planned_peak_gib", "fits", "rows"} <= out.keys()
    assert out["inputs"]["layout"] == {
        "dp": 1,
        "tp_train": 1,
        "tp_rollout": 1,
        "shared_weights": True,
        "shard_optimizer": True,
    }


def test_parallel_degrees_come_from_the_config_and_copied_weights_from_the_argument(config):
    cfg = load_config(config, ["parallel.dp=2", "parallel.tp_train=2", "parallel.tp_rollout=1"])
    plan, described = plan_config(cfg, PlanInputs(copied_weights=True))
    assert described["layout"] == {
        "dp": 2,
        "tp_train": 2,
        "tp_rollout": 1,
        "shared_weights": False,
        "shard_optimizer": True,
    }
    rows = {row.name: row for row in plan.rows}
    assert rows["rollout_weights"].naive_gib > rows["snapshot"].naive_gib  # the rollout copy is unsharded
    with pytest.raises(ValueError, match="parallel.tp_train=3"):
        plan_config(load_config(config, ["parallel.tp_train=3"]), PlanInputs())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the device's capacity is read on CUDA")
def test_an_automatic_budget_without_a_gpu_asks_for_the_capacity(config):
    cfg = load_config(config, ["memory.device_budget_gib=0"])
    with pytest.raises(ValueError, match="--device-gib"):
        plan_config(cfg, PlanInputs())
    plan, _ = plan_config(cfg, PlanInputs(device_gib=80))
    assert plan.budget_gib == 80 - cfg.memory.margin_gib


def test_the_command_prints_the_plan(config, capsys):
    assert main(["plan", str(config), "--json", "rollout.prompts_per_step=4", "--prompt-tokens", "3920"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["workload"]["groups"] == 4 and out["inputs"]["workload"]["prompt_tokens"] == 3920
    assert main(["plan", "rollout.group_size=4"]) == 2
    assert "needs a config file first" in capsys.readouterr().err


def test_the_paper_config_plans_on_its_layout():
    cfg = load_config("configs/paper-32b.yaml")
    plan, described = plan_config(cfg, PlanInputs())
    work = described["workload"]
    assert (work["groups"], work["group_size"], work["prompt_tokens"], work["response_tokens"]) == (
        32,
        8,
        8192,
        2048,
    )
    assert work["vision_tokens"] == 7680 and described["parameters"] == 33_452_718_336
    rows = {row.name: row for row in plan.rows}
    # one TP-4 rollout shard of the language model (plus the replicated vision tower), in bf16
    rank = Architecture.from_preset("qwen2.5-vl-32b").rank_parameters(4)
    assert rows["snapshot"].naive_gib == rank.total * 2 / 2**30


def test_decode_reads_fused_views_under_several_processes():
    """Under several processes decode's fused q/k/v and gate/up are SharedWeights' buffers (views), so
    the plan counts no concatenated copies there; one process still makes them (rollout.decode)."""
    one = load_config("configs/qwen2.5-vl-7b-tp4.yaml", ["parallel.tp_train=1", "parallel.tp_rollout=1"])
    four = load_config("configs/qwen2.5-vl-7b-tp4.yaml")
    assert not workload(one, PlanInputs()).fused_views and workload(four, PlanInputs()).fused_views
    rows = {row.name: row for row in plan_config(four, PlanInputs(device_gib=80))[0].rows}
    groups, vocab = 8 // 2, 152064  # per rollout engine (tp 4 / 2: two engines); Qwen2.5-VL's vocabulary
    sampling = groups * 8 * -(-vocab // 2) * 4 * 2  # the race's buffers, no weight copies
    assert rows["decode_graphs"].gib["rollout"] == pytest.approx(sampling / 2**30)


@pytest.mark.parametrize(
    ("path", "shares"),
    [
        ("configs/paper-32b.yaml", ("67.23 %", "32.77 %")),
        ("configs/qwen2.5-vl-7b-tp4.yaml", ("70.31 %", "29.69 %")),
    ],
)
def test_the_plan_gives_the_case_split(path, shares):
    """32B at tp 8 -> 4 (configs/paper-32b.yaml) and 7B at 4 -> 2 (configs/qwen2.5-vl-7b-tp4.yaml): one line
    per case, Case 3 empty in rollplex's own layouts."""
    cfg = load_config(path)
    lines = plan_text(cfg, PlanInputs(device_gib=80)).splitlines()
    cases = [line for line in lines if line.startswith("Case ")]
    assert [c.split()[:2] for c in cases] == [["Case", "1"], ["Case", "2"], ["Case", "3"]]
    assert shares[0] in cases[0] and shares[1] in cases[1] and "0.00 %" in cases[2]
    out = json.loads(plan_text(cfg, PlanInputs(device_gib=80), as_json=True))
    assert [row["case"] for row in out["weight_sharing"]] == [1, 2, 3] and out["weight_sharing"][2][
        "params"
    ] == 0
