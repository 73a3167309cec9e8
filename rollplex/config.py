"""Typed run configuration: declared once, validated at load.

A ``Config`` has twelve sections (``run``, ``schedule``, ``model``, ``data``, ``rollout``, ``algo``,
``reward``, ``optim``, ``eval``, ``logging``, ``parallel``, ``memory``), each a keyword-only dataclass.
Every field has a default and a one-line description with units in
``dataclasses.field(metadata={"help": ...})``; range limits and choices sit in the same metadata, so ``rollplex train --help-config`` and the validator read one table.

Load order (later wins): dataclass defaults → ``base`` (a nested dict, e.g. the embedded default run)
→ the YAML file → ``key=value`` overrides with dotted keys (``rollout.group_size=4``, values parsed as
YAML scalars or lists). Unknown keys, wrong types, out-of-range values and conflicting fields raise
``ConfigError`` naming the field path (and both values for a conflict).

Sources of the defaults: Video-R1 training scripts and its vendored qwen-vl-utils constants
(docs/video-r1-format.md, "Training settings" and "Video sampling"); clip_high 0.28 is the DAPO "clip-higher"
value.

Example:
    cfg = load_config("run.yaml", ["rollout.group_size=4", "optim.lr=2e-6"])
    cfg.rollout.group_size   # 4
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped, out of range or conflicts with another field."""


def _meta(
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Field metadata: one-line description with units, limits (inclusive ``ge``/``le``, exclusive ``gt``/``lt``)."""
    return {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices}


def _field(default: Any, help: str, **limits: Any) -> Any:
    """A dataclass field with an immutable default and its ``_meta``."""
    return field(default=default, metadata=_meta(help, **limits))


VISION_ATTENTION = ("per_chunk", "batched")  # model.vision_attention (models.forward.prepare_model)
DECODE_ATTENTION = ("auto", "dense", "triton")  # rollout.decode_attention (rollout.decode.StaticDecoder)
COMPILE_SCOPES = ("layer", "parts")  # model.compile_scope (models.compiled)
COMPILE_MODES = ("default", "max-autotune")  # rollout.compile_mode (rollout.decode._compiled_layer)
SCHEDULES = ("serial", "rollplex", "auto")  # schedule.kind (schedule.make_step)
# model.suffix_attention (models.forward.suffix_backend; auto = the device and dtype's default)
SUFFIX_ATTENTION = ("auto", "dense", "causal", "cascade", "sdpa", "flex")
CASCADE_KERNELS = ("math", "flash", "cudnn")  # model.cascade_kernels (models.attention.ATTENTION_KERNELS)
MODEL_PRESETS = (
    "tiny",
    "qwen2.5-vl-3b",
    "qwen2.5-vl-7b",
    "qwen2.5-vl-32b",
    "tiny-tp",
)  # models.presets.PRESETS
AUTO_ON_OFF = ("auto", "on", "off")


@dataclass(kw_only=True)
class RunConfig:
    """Where the run writes, how long it runs, and on which device/dtype."""

    out_dir: str = _field("runs/rollplex", "run folder (config, metrics.jsonl, checkpoints/, report/)")
    seed: int = _field(0, "seed of python, numpy and torch RNGs", ge=0)
    steps: int = _field(100, "optimizer steps to run in total", ge=1)
    save_every: int = _field(50, "steps between checkpoints; 0 = only the final one", ge=0)
    keep_checkpoints: int = _field(2, "newest checkpoints kept on disk", ge=1)
    device: str = _field(
        "auto", "compute device; auto = cuda when available", choices=("auto", "cpu", "cuda")
    )
    dtype: str = _field(
        "auto",
        "model dtype; auto = bfloat16 on cuda, float32 on cpu",
        choices=("auto", "float32", "bfloat16", "float64"),
    )
    deterministic: bool = _field(
        False,
        "use deterministic torch algorithms: bitwise-repeatable updates, slower steps (benchmarks/README.md)",
    )
    progress: bool = _field(True, "show a progress bar with ETA")
    log_every: int = _field(
        10,
        "steps between one-line metrics summaries in the log when run.progress is off (metrics.jsonl has every step)",
        ge=1,
    )


@dataclass(kw_only=True)
class ScheduleConfig:
    """The order and concurrency of one iteration's phases (schedule/); none of them changes the update."""

    kind: str = _field(
        "serial",
        "phase schedule of one iteration: serial (phases one after another), rollplex (reference and "
        "actor prefixes computed before the responses exist, during decode, and kept for their "
        "suffixes) or auto (rollplex with prefill fusion; the first steps try each co-running policy "
        "and keep the first, in the order prefixes after decode, overlap with priority, chunked, SM "
        "carve-out, whose span is within 1% of the fastest)",
        choices=SCHEDULES,
    )
    prefill_fusion: bool = _field(
        False, "rollplex schedule: the actor's attached prefix under the current weights also seeds decode"
    )
    overlap: bool = _field(
        True, "rollplex schedule: run the Phase-1 prefixes on a worker thread (own CUDA stream) during decode"
    )
    decode_priority: bool = _field(
        True, "rollplex overlap: decode runs on a high-priority CUDA stream, the prefixes on a normal one"
    )
    prefix_chunk_groups: int = _field(
        0,
        "rollplex overlap: groups of prefix work issued at a time; the worker waits for each chunk to "
        "finish before issuing the next, so queued prefix kernels never crowd decode (0 = all at once)",
        ge=0,
    )
    prefix_sm_carveout: int = _field(
        0,
        "rollplex overlap: streaming multiprocessors kept free of the prefixes' matrix products (cuBLAS "
        "SM carve-out) while the worker runs; 0 = off",
        ge=0,
    )
    prefix_sms: int = _field(
        0,
        "rollplex overlap with prefill fusion: streaming multiprocessors the reference prefix's kernels may "
        "use while decode runs (a CUDA green context; the driver rounds the count up to its own "
        "granularity). With prefix_chunk_groups, chunks issued after decode ends get every SM; without, "
        "the whole prefix stays on the limited SMs. 0 = all; off, with a warning, where torch, "
        "cuda.bindings or the driver lacks green contexts or the rounded count is not below the device's. "
        "rollplex schedule only (auto does not try it)",
        ge=0,
    )
    auto_trials: int = _field(2, "auto schedule: trial steps per co-running policy before it keeps one", ge=1)


@dataclass(kw_only=True)
class ModelConfig:
    """The policy checkpoint (also the frozen reference)."""

    path: str = _field("", "local Hugging Face Qwen2.5-VL checkpoint folder (required)")
    freeze_vision: bool = _field(False, "keep the vision tower and merger frozen")
    gradient_checkpointing: bool = _field(
        False, "keep only each decoder layer's and vision block's input, recompute the rest in backward"
    )
    layer_recompute: bool = _field(
        True,
        "with gradient_checkpointing: the prefix and vision layers' forward runs without autograd and the "
        "layer is recomputed with it in backward (a shorter actor prefix than torch's checkpoint: "
        "benchmarks/README.md); false: torch's non-reentrant checkpoint in every layer",
    )
    vision_attention: str = _field(
        "batched",
        "vision tower attention over its windows and frames: batched (one SDPA call per distinct window "
        "length) or per_chunk (transformers' backend, one call per window; slower: benchmarks/README.md)",
        choices=VISION_ATTENTION,
    )
    vision_mlp_padding: bool = _field(
        True,
        "run the vision MLP on weights zero-padded to a 16-byte-aligned width (3420 -> 3424 in bf16), so "
        "cuBLAS takes its kernels for aligned shapes; same values up to the products' rounding, same "
        "parameters",
    )
    compile_layers: bool = _field(
        True,
        "run each decoder layer and vision block compiled by torch.compile for the prefix, suffix and "
        "training passes (CUDA only; fused elementwise kernels, same values up to rounding; the first step "
        "compiles them)",
    )
    compile_scope: str = _field(
        "layer",
        "what one compiled function covers with compile_layers: layer (a whole decoder layer or vision "
        "block, a few graphs around its attention call) or parts (its norms, attention module and MLP apart, "
        "five graphs; more host work per layer)",
        choices=COMPILE_SCOPES,
    )
    suffix_attention: str = _field(
        "auto",
        "how scored responses attend to their prompt's keys and their own: auto (causal on CUDA in "
        "bf16/fp16, sdpa on CUDA in other dtypes, dense elsewhere), dense (exact reference, score tensors "
        "in memory), causal (per group, one SDPA call with a bottom-right causal mask: flash attention), "
        "cascade (boundary and own keys as two attentions merged by log-sum-exp), sdpa (one masked SDPA "
        "call per layer) or flex (flex_attention, CUDA only)",
        choices=SUFFIX_ATTENTION,
    )
    cascade_kernels: str = _field(
        "auto",
        "with suffix_attention cascade: the kernels of its boundary and own-key parts, BOUNDARY,OWN, each "
        "one of math|flash|cudnn (e.g. cudnn,flash); auto = cudnn,flash on CUDA in bf16/fp16 (flash,flash "
        "under run.deterministic), math,math elsewhere",
    )
    preset: str = _field(
        "",
        "model preset whose shapes rollplex plan reads when model.path is not a folder; '' = none",
        choices=("", *MODEL_PRESETS),
    )


@dataclass(kw_only=True)
class DataConfig:
    """Video-R1 records and the media sampling of qwen-vl-utils (docs/video-r1-format.md,
    "Video sampling")."""

    train_path: str = _field("", "Video-R1 JSON/JSONL training records (required)")
    val_path: str = _field("", "held-out Video-R1 JSON/JSONL records; '' = none")
    data_root: str = _field("", "folder media paths are relative to; '' = folder of train_path")
    template: str = _field("video_r1", "prompt template", choices=("video_r1", "answer_only"))
    max_prompt_tokens: int = _field(8192, "longest prompt in tokens (vision tokens included)", ge=1)
    shuffle: bool = _field(True, "shuffle training records each epoch")
    video_fps: float = _field(2.0, "frames sampled per second of video", gt=0)
    video_min_frames: int = _field(4, "fewest frames sampled per video", ge=2)
    video_max_frames: int = _field(16, "most frames sampled per video", ge=2)
    video_min_pixels: int = _field(100352, "min pixels per video frame after resize (128·28²)", ge=1)
    video_max_pixels: int = _field(100352, "max pixels per video frame after resize (128·28²)", ge=1)
    video_total_pixels: int = _field(90316800, "pixel budget of all frames of one video", ge=1)
    image_min_pixels: int = _field(3136, "min pixels per image after resize (4·28²)", ge=1)
    image_max_pixels: int = _field(200704, "max pixels per image after resize (256·28²)", ge=1)


@dataclass(kw_only=True)
class RolloutConfig:
    """Sampling of the GRPO groups."""

    group_size: int = _field(8, "responses sampled per prompt (N)", ge=2)
    prompts_per_step: int = _field(8, "prompt groups per optimizer step (G)", ge=1)
    max_response_tokens: int = _field(768, "response budget in tokens (R)", ge=1)
    temperature: float = _field(1.0, "sampling temperature; log-probs use log_softmax(logits/T)", gt=0)
    top_p: float = _field(1.0, "nucleus sampling mass, in (0, 1]", gt=0, le=1)
    top_k: int = _field(0, "sample from the k most likely tokens; 0 = off", ge=0)
    cuda_graphs: bool = _field(True, "replay the decode step as CUDA graphs (CUDA only)")
    compile_decode: bool = _field(
        True,
        "compile the decode step's layer function with torch.compile before capture (CUDA only; falls "
        "back to the uncompiled step with a warning if compilation fails)",
    )
    compile_mode: str = _field(
        "default",
        "torch.compile mode of the decode step: default (cuBLAS products) or max-autotune (inductor "
        "benchmarks its Triton templates against cuBLAS for each product, once per process and shape "
        "unless its disk cache has them, and fuses what it can into them; a slower first rollout; its "
        "steps against default's: benchmarks/README.md)",
        choices=COMPILE_MODES,
    )
    graph_window: int = _field(
        0,
        "own-key window of the captured decode steps, tokens (one graph per window); 0 = the decode "
        "attention's own: 512 (one own-key chunk) with triton, whose launch is the same for any window "
        "inside a chunk, 128 with dense",
        ge=0,
    )
    decode_attention: str = _field(
        "auto",
        "decode attention: triton (fused split-K kernel, CUDA), dense (score tensors in memory) or auto "
        "(triton on CUDA when Triton is installed, else dense)",
        choices=DECODE_ATTENTION,
    )
    fused_projections: bool = _field(
        True,
        "decode: one q/k/v and one gate/up matrix product per layer, from copies of those weights "
        "concatenated when decode starts (a second copy of those weights in memory during rollout)",
    )
    fused_sampling: bool = _field(
        True,
        "decode: the sampling race (log-softmax, Gumbel race, recorded log-prob) as two Triton kernels "
        "(CUDA; plain temperature sampling only, top-p/top-k use the eager race)",
    )
    fused_gate: bool = _field(
        True,
        "decode: the MLP's gate/up product with its SiLU gate in the epilogue, one Triton kernel instead "
        "of a cuBLAS product and an elementwise kernel (CUDA; with fused_projections; decode batches of "
        "at most 64 rows, larger ones keep the cuBLAS product)",
    )


@dataclass(kw_only=True)
class AlgoConfig:
    """GRPO advantages, PPO-clip loss, KL to the reference, loss aggregation."""

    normalize_std: bool = _field(True, "divide group advantages by the group reward std")
    clip_low: float = _field(0.2, "PPO clip: ratio lower bound is 1 - clip_low", ge=0, lt=1)
    clip_high: float = _field(0.28, "PPO clip: ratio upper bound is 1 + clip_high", ge=0)
    kl_coef: float = _field(0.04, "weight of the KL-to-reference term (beta); 0 = off", ge=0)
    kl_estimator: str = _field("k3", "per-token KL estimator", choices=("k1", "k3"))
    kl_log_ratio_bound: float = _field(
        20.0,
        "clamp of |log(ref/actor)| before exp in k3 (at most 80: float32's exp overflows above 88.7, B10)",
        gt=0,
        le=80,
    )
    loss_agg: str = _field(
        "token-mean",
        "loss aggregation over tokens and sequences",
        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    )
    mini_batches: int = _field(1, "optimizer updates per rollout batch", ge=1)
    micro_batch_groups: int = _field(
        1,
        "groups per gradient-accumulation micro-batch (each keeps its prefix graph until its backward); "
        "0 = whole mini-batch",
        ge=0,
    )


@dataclass(kw_only=True)
class RewardConfig:
    """Reward functions and their weights in the total reward."""

    functions: list[str] = field(
        default_factory=lambda: ["accuracy", "format"],
        metadata=_meta("reward functions summed into the total"),
    )
    weights: list[float] = field(
        default_factory=list, metadata=_meta("weight of each function; [] = 1.0 each")
    )
    temporal_alpha: float = _field(
        0.0,
        "T-GRPO bonus (Video-R1) added to the accuracy reward of eligible responses of video groups, "
        "which costs one shuffled-frame rollout per video group; 0 = off (Video-R1 uses 0.3)",
        ge=0.0,
    )
    temporal_mu: float = _field(
        1.0,
        "T-GRPO threshold: a video group gets the bonus when its accuracy >= mu x its shuffled-frame "
        "accuracy (Video-R1's code has 0.8, its authors intend 1.0)",
        ge=0.0,
    )
    temporal_samples: int = _field(
        0,
        "T-GRPO shuffled-frame responses per video group; 0 = half the group size, at least 1 (Video-R1)",
        ge=0,
    )
    temporal_reward: str = _field(
        "",
        "the reward T-GRPO compares between ordered and shuffled frames and adds its bonus to: a name in "
        "reward.functions (a built-in accuracy, or your own module:function valued in [0, 1]); '' = the "
        "first built-in accuracy reward there",
    )


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup."""

    lr: float = _field(1e-6, "peak learning rate", ge=0)
    weight_decay: float = _field(0.01, "decoupled weight decay", ge=0)
    beta1: float = _field(0.9, "Adam first-moment decay", ge=0, lt=1)
    beta2: float = _field(0.999, "Adam second-moment decay", ge=0, lt=1)
    eps: float = _field(1e-8, "Adam denominator epsilon", gt=0)
    max_grad_norm: float = _field(5.0, "clip of the global gradient L2 norm", gt=0)
    warmup_steps: int = _field(0, "steps of linear learning-rate warmup from 0", ge=0)


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out accuracy measured during training."""

    every: int = _field(
        0,
        "steps between held-out evaluations; with data.val_path set, the run also evaluates before the first "
        "and after the last step (0 = only then)",
        ge=0,
    )
    num_prompts: int = _field(64, "held-out prompts per evaluation", ge=1)
    temperature: float = _field(0.0, "sampling temperature; 0 = greedy", ge=0)


PLACEMENTS = ("colocated", "disaggregated")  # parallel.placement (rollplex.parallel.dist)


@dataclass(kw_only=True)
class ParallelConfig:
    """GPUs under torchrun: data-parallel replicas × tensor-parallel degrees (rollplex.parallel).

    Checked here: tp_train is a multiple of tp_rollout, and rollout_gpus agrees with the placement.
    Checked when the processes start (``rollplex.parallel.dist.check_parallel``): the world size
    torchrun started, and the degrees against the model's head counts and the prompt groups.
    """

    dp: int = _field(1, "data-parallel replicas of the training model; each takes whole prompt groups", ge=1)
    tp_train: int = _field(
        1, "tensor-parallel degree of training and scoring (GPUs per replica); a multiple of tp_rollout", ge=1
    )
    tp_rollout: int = _field(
        1, "tensor-parallel degree of rollout decode (GPUs per decoding engine); divides tp_train", ge=1
    )
    placement: str = _field(
        "colocated",
        "colocated: every GPU runs rollout and training on one shared copy of the actor weights; "
        "disaggregated: parallel.rollout_gpus GPUs only decode, the others only train",
        choices=PLACEMENTS,
    )
    rollout_gpus: int = _field(
        0, "disaggregated placement: GPUs that only decode, a multiple of tp_rollout (0 when colocated)", ge=0
    )
    shared_weights: bool = _field(
        True,
        "colocated: rollout reads the actor's weights in place (one physical copy); false keeps a second, "
        "rollout-layout copy refreshed after every update (the no-sharing baseline)",
    )
    shard_optimizer: bool = _field(
        True,
        "ZeRO-1: each data-parallel rank keeps the FP32 master weights and Adam moments of 1/dp of its "
        "training shard, the updated weights gathered after the step; false keeps the whole shard's on every rank",
    )

    def __post_init__(self) -> None:
        if self.tp_train % self.tp_rollout:
            why = "the rollout shard must be the union of q = tp_train / tp_rollout training shards"
            raise conflict("parallel.tp_train", self.tp_train, "parallel.tp_rollout", self.tp_rollout, why)
        if self.placement == "colocated" and self.rollout_gpus:
            why = "colocated rollout runs on the training GPUs"
            raise conflict("parallel.rollout_gpus", self.rollout_gpus, "parallel.placement", "colocated", why)
        if self.placement == "disaggregated" and (
            not self.rollout_gpus or self.rollout_gpus % self.tp_rollout
        ):
            why = "disaggregated rollout needs a positive multiple of tp_rollout GPUs"
            raise conflict(
                "parallel.rollout_gpus", self.rollout_gpus, "parallel.tp_rollout", self.tp_rollout, why
            )


@dataclass(kw_only=True)
class LoggingConfig:
    """Where the per-step metrics go besides ``metrics.jsonl`` (observe.sinks; the same rows)."""

    tensorboard: bool = _field(
        False,
        "also write the metrics as TensorBoard scalars to run.out_dir/tensorboard (needs the tensorboard "
        "extra: pip install 'rollplex[tensorboard]')",
    )
    wandb: bool = _field(
        False,
        "also log the metrics to Weights & Biases, offline into run.out_dir/wandb (upload later with wandb "
        "sync) unless the environment sets WANDB_MODE (e.g. online); needs the wandb extra: pip install "
        "'rollplex[wandb]'",
    )
    wandb_project: str = _field("rollplex", "Weights & Biases project of the run (with logging.wandb)")


# logging.<field> -> (module it needs, extra that installs it)
LOGGING_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


@dataclass(kw_only=True)
class MemoryConfig:
    """Device and host memory budgets and where state lives (memory.planner, paper §3.2)."""

    device_budget_gib: float = _field(
        0.0, "device memory the plan may use per GPU, GiB; 0 = the device's capacity less margin_gib", ge=0
    )
    margin_gib: float = _field(
        4.0,
        "device memory an automatic budget leaves for the CUDA context, allocator fragmentation and what "
        "the plan does not count, GiB",
        ge=0,
    )
    workspace_gib: float = _field(
        1.0, "device memory planned for library workspaces and CUDA graph pools in every phase, GiB", ge=0
    )
    host_budget_gib: float = _field(
        0.0,
        "pinned host memory the pool may take per GPU process, GiB; 0 = the host's available memory shared "
        "among its GPU processes, less host_margin_gib",
        ge=0,
    )
    host_margin_gib: float = _field(
        16.0, "host memory an automatic host budget leaves to the process and the system, GiB", ge=0
    )
    chunk_mib: int = _field(
        128, "optimizer chunk: MiB of FP32 master weights updated (and streamed) at a time", ge=1
    )
    optimizer_offload: str = _field(
        "auto",
        "FP32 master weights and Adam moments in the pinned host pool, streamed through the GPU at the step: "
        "auto (as many chunks as the budget needs), on (all), off (none)",
        choices=AUTO_ON_OFF,
    )
    reference_paging: str = _field(
        "auto",
        "reference weights: auto (paged when the budget needs it), resident (always on the device), paged "
        "(on the device only while the reference prefixes and scoring run)",
        choices=("auto", "resident", "paged"),
    )
    offload_activations: str = _field(
        "auto",
        "rollplex schedule: the actor prefix's saved tensors go to the pinned host pool as they are produced "
        "and come back for the backward: auto (when the budget needs it), on, off",
        choices=AUTO_ON_OFF,
    )


@dataclass(kw_only=True)
class Config:
    """The whole run configuration; see each section's fields."""

    run: RunConfig = field(default_factory=RunConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-6`` (no dot) as a float, as YAML 1.2 does."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str = "") -> Any:
    """Parse YAML text with exponent floats (``1e-6``) read as floats.

    Raises:
        ConfigError: bad YAML, naming ``source`` (a file, an override), the line and column (1-based)
            and the parser's complaint on one line.
    """
    try:
        return yaml.load(text, Loader=_YamlLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None and source else source
        what = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"invalid YAML{' in ' + where if where else ''}: {what}") from exc


def _section_types() -> dict[str, type]:
    return {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


# keys of earlier releases and where their settings are now (a config file that sets one is told)
MOVED = {
    "run.schedule": "schedule.kind",
    **{
        f"run.{name}": f"schedule.{name}"
        for name in (
            "prefill_fusion",
            "overlap",
            "decode_priority",
            "prefix_chunk_groups",
            "prefix_sm_carveout",
            "prefix_sms",
            "auto_trials",
        )
    },
}


def _merge(into: dict, update: Any, path: str) -> None:
    """Deep-merge ``update`` into ``into`` (both nested dicts of known keys); unknown keys raise."""
    if not isinstance(update, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {update!r}")
    for key, value in update.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in into and sub in MOVED:
            raise ConfigError(f"unknown config key {sub!r}: it is {MOVED[sub]} now")
        if key not in into:
            known = ", ".join(into)
            raise ConfigError(f"unknown config key {sub!r} (known here: {known})")
        if isinstance(into[key], dict):
            _merge(into[key], value, sub)
        else:
            into[key] = value


def parse_override(item: str) -> dict:
    """``"a.b=v"`` → ``{"a": {"b": parsed v}}``; ``v`` is a YAML scalar or list, empty means ``""``.

    Raises ``ConfigError`` when ``=`` or the key is missing.
    """
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not of the form section.field=value")
    try:
        value: Any = "" if raw.strip() == "" else parse_yaml(raw)
    except ConfigError as exc:
        raise ConfigError(f"override {item!r}: {exc}") from exc
    out: dict = {}
    node = out
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) if typing.get_origin(tp) is None else str(tp)


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted (and converted) for floats."""
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list of {item_tp.__name__}, got {value!r}")
        return [_coerce(f"{path}[{i}]", v, item_tp) for i, v in enumerate(value)]
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[tp]
    if not ok and tp is float and _spells_not_finite(value):  # `nan`, `inf`: YAML reads them as text
        raise ConfigError(f"{path}: expected a finite number, got {value!r}")
    if not ok:
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if tp is float and not math.isfinite(value):  # YAML's .inf / .nan: no float setting means them
        raise ConfigError(f"{path}: expected a finite number, got {value!r}")
    return float(value) if tp is float else value


def _spells_not_finite(value: Any) -> bool:
    """Whether ``value`` is text Python reads as a float that is not finite (``nan``, ``-inf``, ...)."""
    try:
        return isinstance(value, str) and not math.isfinite(float(value))
    except ValueError:
        return False


def _check_limits(path: str, value: Any, meta: typing.Mapping) -> None:
    """Range and choice limits declared in the field metadata."""
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"{path}={value!r} is not one of {', '.join(meta['choices'])}")
    if meta["ge"] is not None and not value >= meta["ge"]:
        raise ConfigError(f"{path}={value!r} must be >= {meta['ge']}")
    if meta["gt"] is not None and not value > meta["gt"]:
        raise ConfigError(f"{path}={value!r} must be > {meta['gt']}")
    if meta["le"] is not None and not value <= meta["le"]:
        raise ConfigError(f"{path}={value!r} must be <= {meta['le']}")
    if meta["lt"] is not None and not value < meta["lt"]:
        raise ConfigError(f"{path}={value!r} must be < {meta['lt']}")


def _on_off(value: Any, meta: typing.Mapping) -> Any:
    """YAML reads an unquoted ``on`` / ``off`` as true / false: for a field whose choices are the words,
    the boolean means the word."""
    if isinstance(value, bool) and {"on", "off"} <= set(meta["choices"] or ()):
        return "on" if value else "off"
    return value


def _build_section(name: str, cls: type, values: dict) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        path = f"{name}.{f.name}"
        kwargs[f.name] = _coerce(path, _on_off(values[f.name], f.metadata), hints[f.name])
        _check_limits(path, kwargs[f.name], f.metadata)
    return cls(**kwargs)


def conflict(a: str, va: Any, b: str, vb: Any, why: str) -> ConfigError:
    """The error of two fields that conflict, naming both and their values (``a=va conflicts with b=vb: why``)."""
    return ConfigError(f"{a}={va!r} conflicts with {b}={vb!r}: {why}")


_MIN_MAX = (
    ("video_min_frames", "video_max_frames"),
    ("video_min_pixels", "video_max_pixels"),
    ("image_min_pixels", "image_max_pixels"),
)


def _check_batching(rollout: RolloutConfig, algo: AlgoConfig) -> None:
    """Mini-batches split the G groups evenly; micro-batches split each mini-batch evenly."""
    if rollout.prompts_per_step % algo.mini_batches:
        why = "mini_batches must divide prompts_per_step"
        raise conflict(
            "rollout.prompts_per_step", rollout.prompts_per_step, "algo.mini_batches", algo.mini_batches, why
        )
    groups = rollout.prompts_per_step // algo.mini_batches
    if algo.micro_batch_groups and groups % algo.micro_batch_groups:
        why = f"micro_batch_groups must divide the {groups} groups of each mini-batch (algo.mini_batches={algo.mini_batches})"
        raise conflict(
            "algo.micro_batch_groups",
            algo.micro_batch_groups,
            "rollout.prompts_per_step",
            rollout.prompts_per_step,
            why,
        )


def _check_rewards(reward: RewardConfig) -> None:
    """The reward fields' syntax; that the named functions exist and that T-GRPO compares an accuracy is
    checked with the run (``algo.rewards.check_reward_config``)."""
    if not reward.functions:
        raise ConfigError("reward.functions must name at least one reward function")
    if len(set(reward.functions)) != len(reward.functions):
        raise ConfigError(f"reward.functions={reward.functions!r} names a function twice")
    if reward.weights and len(reward.weights) != len(reward.functions):
        raise conflict(
            "reward.weights",
            reward.weights,
            "reward.functions",
            reward.functions,
            "need one weight per function",
        )
    if reward.temporal_reward and reward.temporal_reward not in reward.functions:
        why = "T-GRPO compares a reward the run computes: name one of reward.functions"
        raise conflict(
            "reward.temporal_reward", reward.temporal_reward, "reward.functions", reward.functions, why
        )


def _check_conflicts(cfg: Config) -> None:
    """Cross-field rules; each error names both fields and values."""
    for lo, hi in _MIN_MAX:
        low, high = getattr(cfg.data, lo), getattr(cfg.data, hi)
        if low > high:
            raise conflict(f"data.{lo}", low, f"data.{hi}", high, "min exceeds max")
    _check_batching(cfg.rollout, cfg.algo)
    _check_rewards(cfg.reward)
    _check_schedule(cfg)
    _check_fusion_layout(cfg)
    cascade_kernel_names(cfg.model.cascade_kernels)
    _check_logging_packages(cfg.logging)


def _check_logging_packages(cfg: LoggingConfig) -> None:
    """A metric sink that is turned on needs its package installed (found without importing it)."""
    for name, (module, extra) in LOGGING_PACKAGES.items():
        if getattr(cfg, name) and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"logging.{name}=true needs the {module} package, which is not installed: "
                f"pip install 'rollplex[{extra}]' (or set logging.{name}=false)"
            )


def _check_schedule(cfg: Config) -> None:
    """The rollplex schedule keeps prefixes computed under θ_k: one update per rollout batch."""
    sched = cfg.schedule
    if sched.kind != "serial" and cfg.algo.mini_batches != 1:
        why = "the rollplex schedule keeps actor prefixes of θ_k, so it allows one update per rollout batch"
        raise conflict("schedule.kind", sched.kind, "algo.mini_batches", cfg.algo.mini_batches, why)
    if sched.prefill_fusion and sched.kind == "serial":
        why = "prefill fusion is part of the rollplex schedule"
        raise conflict("schedule.prefill_fusion", True, "schedule.kind", sched.kind, why)
    if sched.prefix_sms and sched.kind != "rollplex":
        why = "SM partitioning is a rollplex-schedule policy (auto chooses among its own candidates)"
        raise conflict("schedule.prefix_sms", sched.prefix_sms, "schedule.kind", sched.kind, why)
    if sched.prefix_sms and not sched.overlap:
        why = "the SM limit applies to prefixes that run during decode"
        raise conflict("schedule.prefix_sms", sched.prefix_sms, "schedule.overlap", False, why)
    if sched.prefix_sms and not sched.prefill_fusion:
        why = (
            "without prefill fusion the worker computes the attached actor prefix, whose backward would "
            "then run on the limited SMs too"
        )
        raise conflict("schedule.prefix_sms", sched.prefix_sms, "schedule.prefill_fusion", False, why)


def _check_fusion_layout(cfg: Config) -> None:
    """Prefill fusion seeds decode with the actor prefix's boundary KV, which has the training layout:
    only where rollout decodes in that layout, on the same GPUs."""
    sched, par = cfg.schedule, cfg.parallel
    if sched.prefill_fusion and par.tp_train != par.tp_rollout:
        why = "schedule.prefill_fusion needs rollout and training in the same tensor-parallel layout"
        raise conflict("parallel.tp_train", par.tp_train, "parallel.tp_rollout", par.tp_rollout, why)
    if sched.prefill_fusion and par.placement == "disaggregated":
        why = "schedule.prefill_fusion needs rollout on the training GPUs"
        raise conflict("schedule.prefill_fusion", True, "parallel.placement", par.placement, why)


def uses_prefill_fusion(cfg: Config) -> bool:
    """Whether the actor prefix seeds decode: ``schedule.prefill_fusion``, and ``auto`` wherever the
    layout allows it (colocated, tp_train == tp_rollout; ``_check_fusion_layout``)."""
    par = cfg.parallel
    same_layout = par.tp_train == par.tp_rollout and par.placement == "colocated"
    return cfg.schedule.prefill_fusion or (cfg.schedule.kind == "auto" and same_layout)


def cascade_kernel_names(text: str) -> tuple[str, str] | None:
    """``model.cascade_kernels`` as its (boundary part, own part) kernel names; None for auto.

    Raises:
        ConfigError: ``text`` is neither auto nor two of ``CASCADE_KERNELS`` joined by a comma.
    """
    if text == "auto":
        return None
    names = tuple(text.split(","))
    if len(names) != 2 or not set(names) <= set(CASCADE_KERNELS):
        raise ConfigError(
            f"model.cascade_kernels={text!r}: expected auto or BOUNDARY,OWN (the kernels of the boundary "
            f"part and of the own-keys part), each one of {'|'.join(CASCADE_KERNELS)}, e.g. cudnn,flash"
        )
    return names


def config_from_dict(data: dict) -> Config:
    """Validate a complete nested dict (every section and field present) into a ``Config``.

    Raises ``ConfigError`` on a wrong type, an out-of-range value or a conflict.
    """
    sections = {name: _build_section(name, cls, data[name]) for name, cls in _section_types().items()}
    cfg = Config(**sections)
    _check_conflicts(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    """The resolved config as a nested dict of plain YAML values (lists for list fields)."""
    return dataclasses.asdict(cfg)


def load_config(
    path: str | Path | None, overrides: typing.Sequence[str] = (), base: dict | None = None
) -> Config:
    """Load and validate a run config.

    Merge order, later wins: dataclass defaults, ``base`` (nested dict), the YAML file at ``path``
    (skipped when None; an empty file is an empty mapping), then ``overrides`` (``"section.field=value"``).

    Raises ``ConfigError`` for a missing file, invalid YAML, unknown keys, wrong types, out-of-range values
    and conflicting fields; the message names the field path.
    """
    merged = config_to_dict(Config())
    if base is not None:
        _merge(merged, base, "")
    if path is not None:
        path = Path(path)
        if not path.is_file():
            override = not path.exists() and path.suffix not in (".yaml", ".yml")
            hint = " (an override is section.field=value)" if override else ""
            raise ConfigError(f"config file {str(path)!r} does not exist{hint}")
        _merge(merged, parse_yaml(path.read_text(), str(path)) or {}, "")
    for item in overrides:
        _merge(merged, parse_override(item), "")
    return config_from_dict(merged)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (sections and fields in declaration order)."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def validate_for_training(cfg: Config) -> None:
    """Check the fields a training run needs beyond load-time validation.

    Raises ``ConfigError`` when ``run.out_dir`` is empty, ``model.path`` is empty or not a folder, ``data.train_path`` is empty or
    not a file, ``data.val_path``/``data.data_root`` are set but missing, or ``eval.every > 0`` without
    ``data.val_path``.
    """
    if not cfg.run.out_dir.strip():
        raise ConfigError(
            f"run.out_dir is required (got {cfg.run.out_dir!r}): the run folder for the config, metrics and "
            "checkpoints"
        )
    required = (
        ("model.path", cfg.model.path, Path.is_dir),
        ("data.train_path", cfg.data.train_path, Path.is_file),
    )
    for name, value, exists in required:
        if not value:
            raise ConfigError(
                f"{name} is required (got ''; a config file starts from the field defaults, not from the "
                "embedded default job: see rollplex train --help-config)"
            )
        if not exists(Path(value)):
            raise ConfigError(f"{name}={value!r} does not exist")
    optional = (
        ("data.val_path", cfg.data.val_path, Path.is_file),
        ("data.data_root", cfg.data.data_root, Path.is_dir),
    )
    for name, value, exists in optional:
        if value and not exists(Path(value)):
            raise ConfigError(f"{name}={value!r} does not exist")
    if cfg.eval.every > 0 and not cfg.data.val_path:
        raise conflict("eval.every", cfg.eval.every, "data.val_path", "", "evaluation needs held-out records")


def ignored_fields(cfg: Config) -> dict[str, list[str]]:
    """Fields set away from their default that take no effect, by the setting that makes them so:
    T-GRPO's ``reward.temporal_mu``, ``reward.temporal_samples`` and ``reward.temporal_reward`` while
    ``reward.temporal_alpha`` is 0, ``model.compile_scope`` while ``model.compile_layers`` is off, and
    ``model.cascade_kernels`` while ``model.suffix_attention`` is not cascade (``loop.train`` warns about
    them)."""
    ignored: dict[str, list[str]] = {}
    if cfg.reward.temporal_alpha == 0:
        default = RewardConfig()
        names = ("temporal_mu", "temporal_samples", "temporal_reward")
        fields = [f"reward.{n}" for n in names if getattr(cfg.reward, n) != getattr(default, n)]
        if fields:
            ignored["T-GRPO is off (reward.temporal_alpha=0)"] = fields
    if not cfg.model.compile_layers and cfg.model.compile_scope != ModelConfig().compile_scope:
        ignored["the layers are not compiled (model.compile_layers=false)"] = ["model.compile_scope"]
    model = cfg.model
    if model.suffix_attention != "cascade" and model.cascade_kernels != ModelConfig().cascade_kernels:
        why = f"the suffix attention is not cascade (model.suffix_attention={model.suffix_attention})"
        ignored[why] = ["model.cascade_kernels"]
    return ignored


def data_root(cfg: DataConfig) -> Path:
    """Folder that record media paths are relative to: ``data_root``, else the folder of ``train_path``."""
    return Path(cfg.data_root) if cfg.data_root else Path(cfg.train_path).parent


def temporal_samples(reward: RewardConfig, group_size: int) -> int:
    """Shuffled-frame responses per video group of T-GRPO (``reward.temporal_samples``; 0 = N/2, at least 1)."""
    return reward.temporal_samples or max(1, group_size // 2)


def reward_weights(cfg: RewardConfig) -> list[float]:
    """One weight per reward function, in ``functions`` order (1.0 each when ``weights`` is empty)."""
    return list(cfg.weights) if cfg.weights else [1.0] * len(cfg.functions)


def resolve_device(cfg: RunConfig) -> str:
    """``"cuda"`` or ``"cpu"``; ``auto`` picks cuda when available. Raises ``ConfigError`` for cuda without CUDA."""
    import torch

    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device='cuda' but CUDA is not available")
    return cfg.device


def resolve_dtype(cfg: RunConfig, device: str) -> Any:
    """``torch.dtype`` of the model: ``auto`` = bfloat16 on cuda, float32 on cpu; else the named dtype."""
    import torch

    name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    return getattr(torch, name)


def field_docs() -> list[tuple[str, str, Any, str]]:
    """``(path, type name, default, help with limits)`` for every field, in declaration order."""
    rows = []
    for name, cls in _section_types().items():
        hints = typing.get_type_hints(cls)
        defaults = dataclasses.asdict(cls())
        for f in dataclasses.fields(cls):
            m = f.metadata
            limits = [
                f"{op} {m[key]}"
                for key, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                if m[key] is not None
            ]
            if m["choices"]:
                limits.append("one of " + "|".join(m["choices"]))
            text = m["help"] + (f" [{'; '.join(limits)}]" if limits else "")
            rows.append((f"{name}.{f.name}", _type_name(hints[f.name]), defaults[f.name], text))
    return rows


def format_config_help(job: dict | None = None) -> str:
    """Every config field with its type, default and description, one per line; where the nested config
    dict ``job`` (e.g. the embedded default run's) sets a field to another value, that value follows
    as ``(default job: ...)``. A header line says what every value must satisfy."""
    rows = field_docs()
    width = max(len(p) for p, *_ in rows)
    lines = ["field  type = default  description [bounds]; every float must be finite (no nan or inf)"]
    for path, type_name, default, text in rows:
        section, name = path.split(".", 1)
        line = f"{path:<{width}}  {type_name} = {default!r}  {text}"
        value = (job or {}).get(section, {}).get(name, default)
        if value != default:
            line += f"  (default job: {value!r})"
        lines.append(line)
    return "\n".join(lines)
