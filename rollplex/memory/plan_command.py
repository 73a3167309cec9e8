"""``rollplex plan``: the memory plan of a run config, from shapes alone (no weights read, nothing run).

The architecture comes from ``model.path``/config.json when ``model.path`` is a folder, else from
``model.preset``; the workload from the config (``rollout.prompts_per_step``, ``rollout.group_size``,
``data.max_prompt_tokens`` unless a prompt length is given, ``rollout.max_response_tokens``,
``algo.micro_batch_groups``, the schedule, ``model.gradient_checkpointing``, ``algo.kl_coef``,
``model.freeze_vision``, ``rollout.fused_projections``, ``run.dtype``); the budgets from ``memory:``.
Vision tokens per prompt default to the largest video the data settings let through:
⌊video_max_frames / 2⌋ frame pairs of ⌊video_max_pixels / 28²⌋ merged tokens, at most the prompt length.
The parallel degrees come from the config's ``parallel:`` section. Under several processes decode
reads its fused q/k/v and gate/up weights as views of one buffer (parallel.weight_sharing), so the
planner counts no concatenated copies there (``fused_views``); the plan also gives the weight-sharing
split, Case 1/2/3 (tensors, parameters, share of the language model), at tp_train → tp_rollout.

Example:
    text = plan_text(load_config("configs/paper-32b.yaml"), PlanInputs())
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from rollplex.config import Config
from rollplex.memory.planner import GIB, Budget, Layout, MemoryPlan, Workload, plan_memory
from rollplex.memory.shapes import Architecture
from rollplex.models.presets import preset_config
from rollplex.parallel.weight_sharing import CaseRow, case_rows, classify, format_case_rows, model_heads

MERGED_TOKEN_PIXELS = 28 * 28  # pixels per merged vision token (a 2x2 block of 14x14 patches)
GPUS_PER_HOST = 8  # an automatic host budget is shared by up to this many GPU processes


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What ``rollplex plan`` takes beside the config (None = from the config or the machine)."""

    prompt_tokens: int | None = None
    vision_tokens: int | None = None
    device_gib: float | None = None  # device capacity, GiB (default: CUDA device 0's)
    copied_weights: bool = False
    # host memory the run may use, GiB (default: available_host_gib() when the plan is made); a process
    # that plans again after pinning its own pool passes what was available before it pinned
    host_available_gib: float | None = None


def architecture(cfg: Config) -> tuple[Architecture, str]:
    """The model's shapes and where they were read: ``model.path``/config.json when ``model.path`` is a
    folder, else ``model.preset``.

    Raises:
        ValueError: the folder has no config.json, or ``model.path`` is not a folder and no preset is set.
    """
    folder = Path(cfg.model.path) if cfg.model.path else None
    if folder is not None and folder.is_dir():
        config = folder / "config.json"
        if not config.is_file():
            raise ValueError(f"model.path={cfg.model.path!r} has no config.json")
        return Architecture.from_hf_config(json.loads(config.read_text())), str(config)
    if cfg.model.preset:
        return Architecture.from_preset(cfg.model.preset), f"preset {cfg.model.preset}"
    where = f"model.path={cfg.model.path!r} is not a folder" if cfg.model.path else "model.path is empty"
    raise ValueError(
        f"rollplex plan reads the model's shapes from a checkpoint folder or a preset: {where} and model.preset is not set"
    )


def workload(cfg: Config, inputs: PlanInputs) -> Workload:
    """The config's step shapes (module docstring)."""
    prompt = inputs.prompt_tokens or cfg.data.max_prompt_tokens
    video = cfg.data.video_max_frames // 2 * (cfg.data.video_max_pixels // MERGED_TOKEN_PIXELS)
    vision = inputs.vision_tokens if inputs.vision_tokens is not None else min(prompt, video)
    kind, fusion = cfg.schedule.kind, cfg.schedule.prefill_fusion
    dtype = cfg.run.dtype
    return Workload(
        groups=cfg.rollout.prompts_per_step,
        group_size=cfg.rollout.group_size,
        prompt_tokens=prompt,
        vision_tokens=vision,
        response_tokens=cfg.rollout.max_response_tokens,
        micro_batch_groups=cfg.algo.micro_batch_groups,
        schedule=kind,
        prefill_fusion=fusion,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        reference=cfg.algo.kl_coef > 0,
        freeze_vision=cfg.model.freeze_vision,
        fused_projections=cfg.rollout.fused_projections,
        fused_views=cfg.parallel.dp * cfg.parallel.tp_train > 1,  # SharedWeights' fused buffers
        dtype_bytes={"auto": 2, "bfloat16": 2, "float32": 4, "float64": 8}[dtype],
    )


def layout(cfg: Config, inputs: PlanInputs) -> Layout:
    """Parallel degrees of the config's ``parallel:`` section; shared or copied rollout weights; the
    optimizer state sharded over the data-parallel ranks or not."""
    p = cfg.parallel
    return Layout(
        p.dp, p.tp_train, p.tp_rollout, p.shared_weights and not inputs.copied_weights, p.shard_optimizer
    )


def budget(cfg: Config, inputs: PlanInputs, world: int) -> Budget:
    """``memory:``'s budgets, the automatic ones resolved on this machine.

    Raises:
        ValueError: ``memory.device_budget_gib`` is 0 and there is neither a device capacity given nor a
            CUDA device to read it from.
    """
    m = cfg.memory
    device = m.device_budget_gib or _device_capacity_gib(inputs) - m.margin_gib
    available = inputs.host_available_gib if inputs.host_available_gib is not None else available_host_gib()
    host = m.host_budget_gib or available / min(world, GPUS_PER_HOST) - m.host_margin_gib
    return Budget(
        device_gib=device,
        host_gib=max(0.0, host),
        chunk_mib=m.chunk_mib,
        workspace_gib=m.workspace_gib,
        optimizer_offload=m.optimizer_offload,
        reference_paging=m.reference_paging,
        offload_activations=m.offload_activations,
    )


def _device_capacity_gib(inputs: PlanInputs) -> float:
    if inputs.device_gib is not None:
        return inputs.device_gib
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            "memory.device_budget_gib is 0 (the device's capacity) and there is no CUDA device here: "
            "set memory.device_budget_gib or give the capacity with --device-gib"
        )
    return torch.cuda.get_device_properties(0).total_memory / GIB


def available_host_gib() -> float:
    """The host memory available now (Linux ``MemAvailable``; all physical memory elsewhere), GiB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def plan_config(cfg: Config, inputs: PlanInputs) -> tuple[MemoryPlan, dict]:
    """The plan of ``cfg`` and a description of what it was computed for."""
    (arch, source), work, lay = architecture(cfg), workload(cfg, inputs), layout(cfg, inputs)
    plan = plan_memory(arch, work, budget(cfg, inputs, lay.world), lay)
    described = {
        "model": source,
        "parameters": arch.parameters(),
        "workload": dataclasses.asdict(work),
        "layout": dataclasses.asdict(lay),
    }
    return plan, described


def weight_sharing(cfg: Config) -> list[CaseRow]:
    """The Case 1/2/3 split of the model's weights at ``parallel.tp_train`` → ``parallel.tp_rollout``
    (parallel.weight_sharing.classify on the meta device: shapes only)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    folder = Path(cfg.model.path) if cfg.model.path else None
    if folder is not None and (folder / "config.json").is_file():
        config = Qwen2_5_VLConfig.from_pretrained(folder)
    else:
        config = preset_config(cfg.model.preset)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    shapes = [(name, tuple(t.shape)) for name, t in model.named_parameters()]
    p = cfg.parallel
    return case_rows(classify(shapes, p.tp_train, p.tp_rollout, heads=model_heads(model)), p.tp_rollout)


def plan_text(cfg: Config, inputs: PlanInputs, as_json: bool = False) -> str:
    """What ``rollplex plan`` prints: the inputs, the plan's table and the weight-sharing split, or all
    as one JSON object."""
    plan, described = plan_config(cfg, inputs)
    cases = weight_sharing(cfg)
    if as_json:
        sharing = [dataclasses.asdict(row) for row in cases]
        return json.dumps({"inputs": described, **plan.to_json(), "weight_sharing": sharing}, indent=2)
    w, lay = described["workload"], described["layout"]
    head = (
        f"{described['model']} ({described['parameters'] / 1e9:.2f}B parameters), {w['schedule']} schedule: "
        f"G={w['groups']} groups of N={w['group_size']}, P={w['prompt_tokens']} prompt tokens "
        f"({w['vision_tokens']} vision), R={w['response_tokens']}, {w['micro_batch_groups']} group(s) per "
        f"micro-batch; dp={lay['dp']}, tp_train={lay['tp_train']}, tp_rollout={lay['tp_rollout']}, "
        f"{'shared' if lay['shared_weights'] else 'copied'} rollout weights, optimizer state "
        f"{'sharded over dp (ZeRO-1)' if lay['shard_optimizer'] and lay['dp'] > 1 else 'whole on each rank'}; "
        "GiB per GPU"
    )
    p = cfg.parallel
    how = "one physical copy" if lay["shared_weights"] else "rollout keeps its own copy"
    sharing = [f"weight sharing, tp_train={p.tp_train} -> tp_rollout={p.tp_rollout} ({how}):"]
    return "\n".join([head, plan.table(), *sharing, *format_case_rows(cases)])
