"""``rollplex bench schedule`` under torchrun: the same rows, each run by every process on its own shard.

    torchrun --nproc-per-node 8 -m rollplex bench schedule --preset qwen2.5-vl-32b \\
        --rows serial,both,auto,disaggregated parallel.tp_train=8 parallel.tp_rollout=4

Each row builds its parallel layout from its config (the run's ``parallel.*`` overrides; the
``disaggregated`` row, ``resolve_row``, splits the GPUs in halves), then random weights built shard by
shard on each GPU (``sharded_random_model``: no process ever holds the whole model, so 32B fits where
its full weights would not), and times ``warmup + steps`` iterations of the row's schedule on the same
synthetic prompts. Rank 0 prints and writes the rows: the median step time over the slowest rank, its
phase times and Eq. 1 terms, and the speedup over serial. The bitwise comparisons of the one-process
benchmark (fingerprints, updates) are not made here: rows of other layouts sum in other orders.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
import zlib
from pathlib import Path

import torch

from rollplex.bench.common import PromptShape, synthetic_prompt
from rollplex.bench.variants import BASELINES, ROWS
from rollplex.config import Config, ConfigError, ParallelConfig
from rollplex.memory.plan_command import PlanInputs
from rollplex.memory.runtime import build_memory, enforce_budget, plan_run
from rollplex.models.compiled import compiles_layers
from rollplex.models.forward import enable_checkpointing, prepare_model
from rollplex.models.presets import preset_config, vision_special_ids
from rollplex.parallel.dist import Comm, build_context, check_parallel, init_parallel
from rollplex.parallel.runtime import ParallelRuntime
from rollplex.parallel.tensor_parallel import shard_model
from rollplex.phases import Roles
from rollplex.rollout.engine import SamplingParams
from rollplex.schedule import make_step
from rollplex.schedule.disaggregated import rollout_only_step


def world_size() -> int:
    """The processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_row(name: str, base: ParallelConfig, world: int) -> dict:
    """The parallel settings of row ``name`` in a world of ``world`` processes: the ``disaggregated``
    row gives half the GPUs to rollout (at ``base.tp_rollout``, at most the training degree) and trains on
    the other half at ``base.tp_train`` (at most half the GPUs) × the replicas that fill it; other rows
    keep the run's ``parallel.*`` settings.

    Raises:
        ConfigError: the row needs torchrun and runs in one process, or the halves do not divide.
    """
    if ROWS[name].get("parallel.placement") != "disaggregated":
        return {}
    half = world // 2
    if world < 2 or world % 2:
        raise ConfigError(
            f"the {name} row splits the GPUs in halves: run it under torchrun on an even number"
        )
    tp_train = min(base.tp_train, half)
    tp_rollout = min(base.tp_rollout, tp_train)
    if half % tp_train or half % tp_rollout:
        raise ConfigError(
            f"the {name} row: {half} GPUs per half do not divide into parallel.tp_train={tp_train} and "
            f"parallel.tp_rollout={tp_rollout}"
        )
    return {
        "parallel.rollout_gpus": half,
        "parallel.dp": half // tp_train,
        "parallel.tp_train": tp_train,
        "parallel.tp_rollout": tp_rollout,
    }


def _small_twin(config):
    """A one-layer model of ``config``'s head dimensions on the CPU: the source of the rotary
    embeddings' buffers, which do not depend on depth, width or vocabulary."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    twin = type(config).from_dict(config.to_dict())
    text, vision = twin.text_config, twin.vision_config
    text.num_hidden_layers, text.intermediate_size, text.vocab_size = 1, 8, 64
    vision.depth, vision.intermediate_size, vision.fullatt_block_indexes = 1, 8, [0]
    with torch.device("cpu"):
        return Qwen2_5_VLForConditionalGeneration(twin)


@torch.no_grad()
def sharded_random_model(preset: str, comm: Comm, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Random weights of ``preset`` sharded for the TP group ``comm``, built on the meta device,
    sharded there (parallel.tensor_parallel.shard_model), then allocated on ``device`` shard by shard:
    norms 1, biases 0, other weights normal(0, initializer range) from a generator seeded by the
    parameter's name (and the TP rank for a split parameter, so replicated ones are equal on every
    rank). Returns (model, the full shape of every parameter)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = preset_config(preset)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config).to(dtype)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if comm.size > 1:
        shard_model(model, comm)
    model.to_empty(device=device)
    std = config.text_config.initializer_range
    for name, param in model.named_parameters():
        if name.endswith(("norm.weight", "layernorm.weight", "ln_q.weight")):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            split = tuple(param.shape) != shapes[name]
            g = torch.Generator(device=device).manual_seed(
                seed + zlib.crc32(name.encode()) + split * comm.rank
            )
            param.normal_(0.0, std, generator=g)
    twin = dict(_small_twin(config).named_buffers())
    for name, buffer in model.named_buffers():
        buffer.copy_(twin[name])
    model.requires_grad_(True)
    return model, shapes


def run_parallel_schedule_bench(cfg, out: Path | None, row_config, result_type):
    """Every row of ``cfg.rows`` on this process's shard (module docstring); rank 0 prints and writes
    the rows (``result_type``: bench.schedule.ScheduleBenchResult; ``row_config``: its per-row config).

    Raises:
        ValueError: a row's layout does not fit the world or the model (parallel.dist.check_parallel).
    """
    world, rank = world_size(), int(os.environ.get("RANK", "0"))
    ctx = init_parallel(ParallelConfig(dp=world))  # the default group; each row builds its own
    result = result_type(config=dataclasses.asdict(cfg))
    for name in cfg.rows:
        try:
            result.rows[name] = _timed_parallel_row(name, cfg, row_config, ctx.device, rank, world)
        except Exception as err:  # one row failing must not hide the others
            print(f"  {name}: failed on rank {rank}: {type(err).__name__}: {err}", flush=True)
            result.rows[name] = {"error": f"{type(err).__name__}: {err}"}
        if rank == 0:
            _summarise(result.rows)
            _write(result, out)
    return result


def _row_setup(
    name: str, cfg, row_config, device: torch.device, rank: int, world: int
) -> tuple[Roles, object, list]:
    base = row_config({}, cfg, 2).parallel  # the run's parallel.* overrides
    overrides = ROWS[name] | resolve_row(name, base, world)
    config: Config = row_config(overrides, cfg, _sms(device))
    check_parallel(config.parallel, world, preset_config(cfg.preset).text_config, cfg.groups)
    ctx = build_context(config.parallel, rank, world, device)
    dtype = getattr(torch, cfg.dtype)
    degree = ctx.train_tp if ctx.trains else ctx.rollout_tp
    actor, shapes = sharded_random_model(cfg.preset, degree, device, dtype)
    reference = None
    if ctx.trains and config.algo.kl_coef > 0:
        reference = sharded_random_model(cfg.preset, degree, device, dtype)[0].requires_grad_(False)
    compiled = compiles_layers(config.model.compile_layers, device)
    for model in (m for m in (actor, reference) if m is not None):
        m = config.model
        prepare_model(model, m.vision_attention, m.vision_mlp_padding, compiled, m.compile_scope)
        model.train(False)
    if cfg.gradient_checkpointing:
        enable_checkpointing(actor, layer_recompute=config.model.layer_recompute)
    runtime = ParallelRuntime.setup(ctx, config, actor, reference, device, shapes=shapes)
    from rollplex.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(cfg.preset)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    banned = torch.tensor(vision_special_ids(actor.config), device=device)
    sampling = SamplingParams.from_config(config.rollout, (eos,), eos, banned)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = PromptShape(cfg.text_tokens, cfg.grid)
    # this rank's memory as a training run plans and applies it (memory.runtime)
    vision = shape.length - shape.text_tokens
    plan = plan_run(config, device, PlanInputs(prompt_tokens=shape.length, vision_tokens=vision))
    enforce_budget(plan.budget_gib, device)

    def make_optimizer(pool, transfers, host_bytes):
        return runtime.optimizer(actor, pool=pool, transfers=transfers, host_bytes=host_bytes)

    memory = build_memory(plan, config, device, actor, reference, make_optimizer=make_optimizer)
    roles = Roles(
        actor,
        reference,
        memory.optimizer,
        tokenizer,
        sampling,
        generator,
        config,
        residency=memory.residency,
        offload=memory.offload,
        parallel=runtime,
    )
    step = make_step(config, device) if ctx.trains else rollout_only_step
    prompts = [synthetic_prompt(actor, shape, seed=g, device=device, dtype=dtype) for g in range(cfg.groups)]
    return roles, step, runtime.replica_share(prompts)


def _timed_parallel_row(name: str, cfg, row_config, device: torch.device, rank: int, world: int) -> dict:
    from rollplex.observe.metrics import PhaseTimer

    roles, step, prompts = _row_setup(name, cfg, row_config, device, rank, world)
    ctx = roles.parallel.ctx
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    timer, times, phases = PhaseTimer(sync=sync), [], []
    for i in range(cfg.warmup + cfg.steps):
        start = time.perf_counter()
        _, _, _, extra = step(roles, prompts, timer)
        spent = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        seconds = float(ctx.world_comm.all_reduce(spent, op="max")[0])  # the slowest rank's step
        split = {**timer.pop(), **extra}
        if rank == 0:
            print(f"    {name} iteration {i}: {seconds:.3f} s (slowest of {world} processes)", flush=True)
        if i >= cfg.warmup:
            times.append(seconds)
            phases.append(split)
    row = {
        "step_s_median": statistics.median(times),
        "step_s_spread": max(times) - min(times),
        "processes": world,
        "parallel": dataclasses.asdict(roles.config.parallel),
    }
    for key in sorted({k for p in phases for k in p}):
        row[key] = statistics.median(p.get(key, float("nan")) for p in phases)
    if device.type == "cuda":
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
        row["peak_memory_gib"] = float(ctx.world_comm.all_reduce(peak, op="max")[0])
    if rank == 0:
        print(f"  {name}: {row['step_s_median']:.3f} s/step (slowest process)", flush=True)
    return row


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def _summarise(rows: dict) -> None:
    for name, row in rows.items():
        serial = rows.get(BASELINES.get(name, "serial"), {}).get("step_s_median")
        if "error" not in row and serial is not None:
            row["speedup_vs_serial"] = serial / row["step_s_median"]


def _write(result, out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dataclasses.asdict(result), indent=2))
