"""Run configuration: defaults, merge order, YAML parsing, validation errors, round trip."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from rollplex.config import (
    Config,
    ConfigError,
    config_to_dict,
    data_root,
    field_docs,
    format_config_help,
    ignored_fields,
    load_config,
    parse_override,
    parse_yaml,
    resolve_device,
    resolve_dtype,
    reward_weights,
    save_config,
    validate_for_training,
)

# The defaults of the specification, written out by hand.
SPEC_DEFAULTS = {
    "run": {
        "out_dir": "runs/rollplex", "seed": 0, "steps": 100, "save_every": 50, "keep_checkpoints": 2,
        "device": "auto", "dtype": "auto", "deterministic": False,
        "progress": True,
        "log_every": 10,
    },
    "schedule": {
        "kind": "serial", "prefill_fusion": False, "overlap": True, "decode_priority": True,
        "prefix_chunk_groups": 0, "prefix_sm_carveout": 0, "prefix_sms": 0, "auto_trials": 2,
    },
    "model": {
        "path": "",
        "freeze_vision": False,
        "gradient_checkpointing": False,
        "layer_recompute": True,
        "vision_attention": "batched",
        "vision_mlp_padding": True,
        "compile_layers": True,
        "compile_scope": "layer",
        "suffix_attention": "auto",
        "cascade_kernels": "auto",
        "preset": "",
    },
    "data": {
        "train_path": "", "val_path": "", "data_root": "", "template": "video_r1", "max_prompt_tokens": 8192,
        "shuffle": True, "video_fps": 2.0, "video_min_frames": 4, "video_max_frames": 16,
        "video_min_pixels": 100352, "video_max_pixels": 100352, "video_total_pixels": 90316800,
        "image_min_pixels": 3136, "image_max_pixels": 200704,
    },
    "rollout": {
        "group_size": 8, "prompts_per_step": 8, "max_response_tokens": 768, "temperature": 1.0, "top_p": 1.0,
        "top_k": 0,
        "cuda_graphs": True,
        "compile_decode": True,
        "compile_mode": "default",
        "graph_window": 0,
        "decode_attention": "auto",
        "fused_projections": True,
        "fused_sampling": True,
        "fused_gate": True,
    },
    "algo": {
        "normalize_std": True, "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.04, "kl_estimator": "k3",
        "kl_log_ratio_bound": 20.0, "loss_agg": "token-mean", "mini_batches": 1, "micro_batch_groups": 1,
    },
    "reward": {
        "functions": ["accuracy", "format"],
        "weights": [],
        "temporal_alpha": 0.0,
        "temporal_mu": 1.0,
        "temporal_samples": 0,
        "temporal_reward": "",
    },
    "optim": {
        "lr": 1e-6, "weight_decay": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "max_grad_norm": 5.0,
        "warmup_steps": 0,
    },
    "eval": {"every": 0, "num_prompts": 64, "temperature": 0.0},
    "logging": {"tensorboard": False, "wandb": False, "wandb_project": "rollplex"},
    "parallel": {
        "dp": 1, "tp_train": 1, "tp_rollout": 1, "placement": "colocated", "rollout_gpus": 0,
        "shared_weights": True, "shard_optimizer": True,
    },
    "memory": {
        "device_budget_gib": 0.0, "margin_gib": 4.0, "workspace_gib": 1.0, "host_budget_gib": 0.0,
        "host_margin_gib": 16.0, "chunk_mib": 128, "optimizer_offload": "auto", "reference_paging": "auto",
        "offload_activations": "auto",
    },
}  # fmt: skip


def test_defaults_match_specification():
    assert config_to_dict(load_config(None)) == SPEC_DEFAULTS
    assert config_to_dict(Config()) == SPEC_DEFAULTS


def test_merge_order_base_then_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  group_size: 4\n  top_k: 5\noptim:\n  lr: 3e-6\n")
    base = {"rollout": {"group_size": 16, "prompts_per_step": 2}, "run": {"steps": 7}}
    cfg = load_config(path, ["rollout.top_k=9", "run.steps=11"], base=base)
    assert cfg.rollout.group_size == 4  # file beats base
    assert cfg.rollout.prompts_per_step == 2  # base beats defaults
    assert cfg.rollout.top_k == 9  # override beats file
    assert cfg.run.steps == 11  # override beats base
    assert cfg.optim.lr == 3e-6 and isinstance(cfg.optim.lr, float)
    assert cfg.rollout.max_response_tokens == 768  # untouched default


def test_exponent_without_dot_is_a_float():
    assert parse_yaml("1e-6") == 1e-6
    assert parse_yaml("-2E+3") == -2000.0
    assert parse_yaml("12") == 12 and isinstance(parse_yaml("12"), int)
    assert parse_yaml("1.5") == 1.5
    assert load_config(None, ["optim.eps=1e-10"]).optim.eps == 1e-10


def test_override_parsing():
    assert parse_override("rollout.group_size=4") == {"rollout": {"group_size": 4}}
    assert parse_override("reward.functions=[accuracy, format]") == {
        "reward": {"functions": ["accuracy", "format"]}
    }
    assert parse_override("data.val_path=") == {"data": {"val_path": ""}}
    assert parse_override("model.path=a=b") == {"model": {"path": "a=b"}}


def test_int_is_accepted_for_float_and_converted():
    cfg = load_config(None, ["rollout.temperature=2", "reward.weights=[1, 0.5]"])
    assert cfg.rollout.temperature == 2.0 and type(cfg.rollout.temperature) is float
    assert cfg.reward.weights == [1.0, 0.5] and all(type(w) is float for w in cfg.reward.weights)
    assert reward_weights(cfg.reward) == [1.0, 0.5]
    assert reward_weights(load_config(None).reward) == [1.0, 1.0]


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("rollout.group_size=1", ["rollout.group_size=1", ">= 2"]),
        ("rollout.top_p=0", ["rollout.top_p", "> 0"]),
        ("rollout.top_p=1.01", ["rollout.top_p", "<= 1"]),
        ("rollout.temperature=0", ["rollout.temperature", "> 0"]),
        ("eval.temperature=-0.1", ["eval.temperature", ">= 0"]),
        ("algo.clip_low=-0.1", ["algo.clip_low", ">= 0"]),
        ("optim.beta2=1.0", ["optim.beta2", "< 1"]),
        ("optim.lr=.nan", ["optim.lr"]),
        ("optim.lr=nan", ["optim.lr", "finite", "'nan'"]),  # plain text to YAML, refused alike
        ("algo.kl_coef=-Infinity", ["algo.kl_coef", "finite", "'-Infinity'"]),
        ("rollout.temperature=warm", ["rollout.temperature", "expected float", "'warm'"]),
        ("algo.kl_coef=.inf", ["algo.kl_coef", "finite", "inf"]),
        ("reward.weights=[1.0, .nan]", ["reward.weights[1]", "finite", "nan"]),
        ("optim.max_grad_norm=.inf", ["optim.max_grad_norm", "finite", "inf"]),  # no upper limit
        ("algo.kl_log_ratio_bound=100", ["algo.kl_log_ratio_bound", "<= 80"]),  # B10: exp overflows past 88.7
        ("algo.clip_low=1.5", ["algo.clip_low=1.5", "< 1"]),  # the ratio's lower bound 1 - clip_low > 0
        ("schedule.kind=overlap", ["schedule.kind", "serial", "rollplex"]),
        ("model.suffix_attention=flash", ["model.suffix_attention", "auto", "causal", "cascade", "flex"]),
        (
            "model.cascade_kernels=cudnn",
            ["model.cascade_kernels='cudnn'", "BOUNDARY,OWN", "math|flash|cudnn"],
        ),
        ("model.cascade_kernels=math,xformers", ["model.cascade_kernels='math,xformers'", "BOUNDARY,OWN"]),
        ("run.schedule=rollplex", ["unknown config key 'run.schedule'", "schedule.kind now"]),
        ("run.prefill_fusion=true", ["unknown config key 'run.prefill_fusion'", "schedule.prefill_fusion"]),
        ("run.device=tpu", ["run.device", "auto", "cpu", "cuda"]),
        ("algo.loss_agg=sum", ["algo.loss_agg", "token-mean"]),
        ("run.steps=1.5", ["run.steps", "int", "1.5"]),
        ("run.steps=true", ["run.steps", "int"]),
        ("run.progress=1", ["run.progress", "bool"]),
        ("model.path=3", ["model.path", "str"]),
        ("reward.functions=accuracy", ["reward.functions", "list"]),
        ("reward.weights=[1, x]", ["reward.weights[1]", "float"]),
        ("reward.temporal_alpha=-0.3", ["reward.temporal_alpha", "-0.3"]),
        ("reward.temporal_samples=-1", ["reward.temporal_samples"]),
        ("reward.temporal_mu=-1", ["reward.temporal_mu"]),
        ("rollout.grup_size=4", ["rollout.grup_size", "unknown"]),
        ("trainer.lr=1", ["trainer", "unknown"]),
        ("rollout=4", ["rollout", "mapping"]),
        ("justtext", ["justtext", "section.field=value"]),
    ],
)
def test_invalid_values_name_the_field(override, needles):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    for needle in needles:
        assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["data.video_min_frames=20"], ["data.video_min_frames=20", "data.video_max_frames=16"]),
        (["data.video_min_pixels=200000"], ["data.video_min_pixels=200000", "data.video_max_pixels=100352"]),
        (["data.image_max_pixels=1000"], ["data.image_min_pixels=3136", "data.image_max_pixels=1000"]),
        (["algo.mini_batches=3"], ["rollout.prompts_per_step=8", "algo.mini_batches=3"]),
        (["algo.mini_batches=2", "algo.micro_batch_groups=3"], ["algo.micro_batch_groups=3", "4 groups"]),
        (["reward.weights=[1.0]"], ["reward.weights=[1.0]", "reward.functions=['accuracy', 'format']"]),
        (["reward.functions=[format, format]"], ["reward.functions", "twice"]),
        (["reward.functions=[]"], ["reward.functions"]),
        (
            ["reward.temporal_reward=answer_accuracy", "reward.temporal_alpha=0.3"],
            ["reward.temporal_reward='answer_accuracy'", "reward.functions=['accuracy', 'format']"],
        ),
    ],
)
def test_conflicts_name_both_fields(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for needle in needles:
        assert needle in str(info.value)


def test_micro_batches_that_divide_are_accepted():
    cfg = load_config(None, ["algo.mini_batches=2", "algo.micro_batch_groups=2"])
    assert (cfg.algo.mini_batches, cfg.algo.micro_batch_groups) == (2, 2)


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist$"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(
        ConfigError, match=r"'run\.steps' does not exist \(an override is section\.field=value\)"
    ):
        load_config("run.steps")  # an override without its "="
    nested = tmp_path / "nested.yaml"
    nested.write_text("data:\n  train_path: a.jsonl\n  fps: 3\n")
    with pytest.raises(ConfigError, match=r"'data\.fps'"):
        load_config(nested)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)
    broken = tmp_path / "broken.yaml"
    broken.write_text("run:\n  steps: 3\n  seed: [1,\n")
    with pytest.raises(ConfigError, match=rf"invalid YAML in {re.escape(str(broken))}:4:1: \S") as err:
        load_config(broken)
    assert "\n" not in str(err.value) and "<unicode string>" not in str(err.value)
    with pytest.raises(ConfigError, match=r"override 'run\.seed=\[1,': invalid YAML: \S"):
        load_config(None, ["run.seed=[1,"])
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert config_to_dict(load_config(empty)) == SPEC_DEFAULTS


def test_save_then_load_round_trip(tmp_path):
    cfg = load_config(
        None, ["rollout.group_size=3", "reward.weights=[0.5, 2]", "optim.lr=1e-7", "run.seed=5"]
    )
    path = tmp_path / "config.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert list(parse_yaml(path.read_text())) == [
        "run",
        "schedule",
        "model",
        "data",
        "rollout",
        "algo",
        "reward",
        "optim",
        "eval",
        "logging",
        "parallel",
        "memory",
    ]


def test_validate_for_training(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    train = tmp_path / "train.jsonl"
    train.write_text("")
    with pytest.raises(ConfigError, match=r"model\.path is required"):
        validate_for_training(load_config(None))
    with pytest.raises(ConfigError, match=r"data\.train_path is required"):
        validate_for_training(load_config(None, [f"model.path={model_dir}"]))
    ok = [f"model.path={model_dir}", f"data.train_path={train}"]
    validate_for_training(load_config(None, ok))
    with pytest.raises(ConfigError, match=r"model\.path=.*does not exist"):
        validate_for_training(
            load_config(None, [f"model.path={tmp_path / 'nope'}", f"data.train_path={train}"])
        )
    with pytest.raises(ConfigError, match=r"data\.val_path=.*does not exist"):
        validate_for_training(load_config(None, [*ok, f"data.val_path={tmp_path / 'val.jsonl'}"]))
    with pytest.raises(ConfigError, match=r"eval\.every=5 conflicts with data\.val_path=''"):
        validate_for_training(load_config(None, [*ok, "eval.every=5"]))
    with pytest.raises(ConfigError, match=r"run\.out_dir is required"):  # would write into the current folder
        validate_for_training(load_config(None, [*ok, "run.out_dir="]))


def test_t_grpo_settings_without_alpha_are_reported():
    """T-GRPO's threshold, sample count and compared reward take no effect while reward.temporal_alpha is
    0: they are the fields ``loop.train`` warns about; with alpha set, or at their defaults, there are
    none."""
    both = ["reward.temporal_mu=0.8", "reward.temporal_samples=4", "reward.temporal_reward=accuracy"]
    names = ["reward.temporal_mu", "reward.temporal_samples", "reward.temporal_reward"]
    assert ignored_fields(load_config(None, both)) == {"T-GRPO is off (reward.temporal_alpha=0)": names}
    assert ignored_fields(load_config(None)) == {}
    assert ignored_fields(load_config(None, [*both, "reward.temporal_alpha=0.3"])) == {}


def test_a_compile_scope_without_compiled_layers_is_reported():
    off = ["model.compile_layers=false", "model.compile_scope=parts"]
    why = "the layers are not compiled (model.compile_layers=false)"
    assert ignored_fields(load_config(None, off)) == {why: ["model.compile_scope"]}
    assert ignored_fields(load_config(None, off[:1])) == {}  # the scope at its default
    assert ignored_fields(load_config(None, off[1:])) == {}  # compiled: the scope applies


def test_cascade_kernels_without_the_cascade_attention_are_reported():
    kernels = "model.cascade_kernels=flash,flash"
    why = "the suffix attention is not cascade (model.suffix_attention=auto)"
    assert ignored_fields(load_config(None, [kernels])) == {why: ["model.cascade_kernels"]}
    assert ignored_fields(load_config(None, [kernels, "model.suffix_attention=cascade"])) == {}
    assert ignored_fields(load_config(None, ["model.suffix_attention=causal"])) == {}


def test_the_config_choices_are_the_models_names():
    """The suffix attention and cascade kernel names the config accepts are those models.attention runs
    (auto aside), so a name that loads never fails later."""
    from rollplex.config import CASCADE_KERNELS, SUFFIX_ATTENTION
    from rollplex.models.attention import ATTENTION_KERNELS
    from rollplex.models.attention import SUFFIX_ATTENTION as BACKENDS

    assert SUFFIX_ATTENTION == ("auto", *BACKENDS)
    assert CASCADE_KERNELS == tuple(ATTENTION_KERNELS)


def test_data_root_defaults_to_folder_of_train_path(tmp_path):
    cfg = load_config(None, [f"data.train_path={tmp_path / 'sub' / 'train.jsonl'}"])
    assert data_root(cfg.data) == tmp_path / "sub"
    cfg = load_config(
        None, [f"data.train_path={tmp_path / 'train.jsonl'}", f"data.data_root={tmp_path / 'media'}"]
    )
    assert data_root(cfg.data) == tmp_path / "media"


def test_resolve_dtype():
    cfg = load_config(None)
    assert resolve_dtype(cfg.run, "cpu") == torch.float32
    assert resolve_dtype(cfg.run, "cuda") == torch.bfloat16
    assert resolve_dtype(load_config(None, ["run.dtype=float64"]).run, "cuda") == torch.float64


def test_compile_scopes_are_the_models_and_a_bad_one_is_refused_by_name():
    from rollplex.config import COMPILE_SCOPES
    from rollplex.models.compiled import SCOPES

    assert COMPILE_SCOPES == SCOPES
    assert load_config(None, ["model.compile_scope=parts"]).model.compile_scope == "parts"
    with pytest.raises(ConfigError, match=r"model\.compile_scope='whole' is not one of layer, parts"):
        load_config(None, ["model.compile_scope=whole"])


def test_every_field_has_a_help_line():
    rows = field_docs()
    n_fields = sum(len(dataclasses.fields(type(section))) for section in vars(Config()).values())
    assert len(rows) == n_fields == sum(len(v) for v in SPEC_DEFAULTS.values())
    assert all(text.strip() for *_, text in rows)
    by_path = {path: (tp, default, text) for path, tp, default, text in rows}
    assert by_path["rollout.group_size"] == ("int", 8, "responses sampled per prompt (N) [>= 2]")
    assert by_path["reward.functions"][0] == "list[str]"
    help_text = format_config_help()
    assert len(help_text.splitlines()) == n_fields + 1  # and a header
    assert "every float must be finite" in help_text.splitlines()[0]
    assert "rollout.top_p" in help_text and "(0, 1]" in help_text
    job = format_config_help({"rollout": {"top_k": 5, "top_p": 1.0}}).splitlines()
    assert [line.split()[0] for line in job if "(default job:" in line] == ["rollout.top_k"]
    assert next(line for line in job if line.startswith("rollout.top_k")).endswith("(default job: 5)")


def test_resolve_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(load_config(None, ["run.device=cpu"]).run) == "cpu"
    assert resolve_device(load_config(None).run) == "cpu"
    with pytest.raises(ConfigError, match=r"run\.device='cuda'"):
        resolve_device(load_config(None, ["run.device=cuda"]).run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(load_config(None).run) == "cuda"


def test_schedule_conflicts_name_both_fields():
    with pytest.raises(ConfigError, match=r"schedule\.kind='rollplex'.*algo\.mini_batches=2"):
        load_config(None, ["schedule.kind=rollplex", "algo.mini_batches=2"])
    with pytest.raises(ConfigError, match=r"schedule\.prefill_fusion=True.*schedule\.kind='serial'"):
        load_config(None, ["schedule.prefill_fusion=true"])
    cfg = load_config(None, ["schedule.kind=rollplex", "schedule.prefill_fusion=true"])
    assert (cfg.schedule.kind, cfg.schedule.prefill_fusion) == ("rollplex", True)
    with pytest.raises(
        ConfigError, match=r"schedule\.prefix_sms=64.*schedule\.prefill_fusion=False.*backward"
    ):
        load_config(None, ["schedule.kind=rollplex", "schedule.prefix_sms=64"])
    with pytest.raises(ConfigError, match=r"schedule\.prefix_sms=64.*schedule\.overlap=False"):
        load_config(
            None,
            [
                "schedule.kind=rollplex",
                "schedule.prefill_fusion=true",
                "schedule.overlap=false",
                "schedule.prefix_sms=64",
            ],
        )
    for schedule in ("serial", "auto"):
        with pytest.raises(ConfigError, match=rf"schedule\.prefix_sms=64.*schedule\.kind='{schedule}'"):
            load_config(None, [f"schedule.kind={schedule}", "schedule.prefix_sms=64"])
    cfg = load_config(
        None, ["schedule.kind=rollplex", "schedule.prefill_fusion=true", "schedule.prefix_sms=64"]
    )
    assert cfg.schedule.prefix_sms == 64


def test_every_config_file_of_the_repository_loads():
    """The config files under configs/ use the fields as they are now (a renamed or moved field fails)."""
    files = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert files
    for path in files:
        load_config(path)


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("memory.device_budget_gib=-1", ["memory.device_budget_gib", "-1"]),
        ("memory.chunk_mib=0", ["memory.chunk_mib", ">= 1"]),
        ("memory.optimizer_offload=always", ["memory.optimizer_offload", "auto, on, off"]),
        ("memory.reference_paging=never", ["memory.reference_paging", "auto, resident, paged"]),
        ("memory.offload_activations=sometimes", ["memory.offload_activations"]),
        ("model.preset=qwen2.5-vl-72b", ["model.preset", "qwen2.5-vl-32b"]),
    ],
)
def test_memory_and_preset_values_are_checked_by_name(override, needles):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert all(needle in str(info.value) for needle in needles)


def test_on_and_off_unquoted_in_yaml_mean_the_words(tmp_path):
    """YAML 1.1 reads on/off as booleans; the fields whose choices are the words take them as the words."""
    path = tmp_path / "run.yaml"
    path.write_text("memory:\n  optimizer_offload: off\n  offload_activations: on\n")
    cfg = load_config(path, ["memory.reference_paging=paged"])
    assert (cfg.memory.optimizer_offload, cfg.memory.offload_activations) == ("off", "on")
    assert load_config(None, ["memory.optimizer_offload=on"]).memory.optimizer_offload == "on"
    with pytest.raises(ConfigError, match="run.progress"):  # a boolean field is still a boolean
        load_config(None, ["run.progress=auto"])


def test_model_presets_are_the_models_presets():
    from rollplex.config import MODEL_PRESETS
    from rollplex.models.presets import PRESETS

    assert MODEL_PRESETS == PRESETS
    assert load_config(None, ["model.preset=qwen2.5-vl-7b"]).model.preset == "qwen2.5-vl-7b"
