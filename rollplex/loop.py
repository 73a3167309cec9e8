"""``rollplex train``: set up the roles and data, run iterations, log, evaluate, checkpoint, resume.

The iteration itself lives in schedule/ (named phases); this module owns everything around it.

Under torchrun every process runs this same program (SPMD; parallel.dist): rank 0 alone writes the
log, metrics, trace and checkpoints; every rank's failure stops the run at the next guard with the
rank named (``parallel.dist.guard`` around set-up, each step, evaluation and checkpoints); each
training replica takes its share of the step's groups (``parallel.runtime``). One process runs exactly
as before and never touches torch.distributed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from rollplex.algo.rewards import FORMAT_REWARDS, check_reward_config, compared_values
from rollplex.checkpoint import (
    check_layout,
    latest_checkpoint,
    load_rank_state,
    load_trainer_state,
    rng_state,
    save_checkpoint,
    save_sharded_checkpoint,
    set_rng_state,
)
from rollplex.config import (
    Config,
    config_to_dict,
    data_root,
    ignored_fields,
    resolve_device,
    resolve_dtype,
    save_config,
    validate_for_training,
)
from rollplex.data.encode import PromptBuilder
from rollplex.data.loader import PromptSource
from rollplex.data.records import load_records
from rollplex.data.vision import ImageSampling, VideoSampling
from rollplex.determinism import use_deterministic_algorithms
from rollplex.memory.planner import MemoryPlan
from rollplex.memory.runtime import (
    MemoryRuntime,
    build_memory,
    enforce_budget,
    plan_run,
    refuse_unless_fits,
)
from rollplex.memory.runtime import step_metrics as memory_metrics
from rollplex.models.compiled import compile_fallback, compiles_layers
from rollplex.models.folder import check_model_folder
from rollplex.models.forward import enable_checkpointing, prepare_model, suffix_backend
from rollplex.models.positions import VisionTokens
from rollplex.observe.metrics import (
    TRACE_FILE,
    CounterSample,
    GcClock,
    PhaseTimer,
    ProgressBar,
    read_chrome_trace,
    write_chrome_trace,
)
from rollplex.observe.sinks import MetricSinks
from rollplex.optim import learning_rate
from rollplex.parallel.dist import (
    ParallelContext,
    check_parallel,
    close_parallel,
    configure_logging,
    guard,
    init_parallel,
)
from rollplex.parallel.runtime import ParallelRuntime
from rollplex.phases import ActorStats, Roles, rollout_phase, uses_temporal
from rollplex.rollout.engine import SamplingParams
from rollplex.schedule import make_step
from rollplex.schedule.disaggregated import rollout_only_step
from rollplex.types import ScoredBatch

log = logging.getLogger("rollplex")


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    trainable: bool,
    vision_attention: str = "batched",
    vision_mlp_padding: bool = True,
    compile_layers: bool = False,
    compile_scope: str = "layer",
):
    """A Qwen2.5-VL checkpoint folder as a model routed through rollplex attention (``prepare_model``)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device)
    prepare_model(model, vision_attention, vision_mlp_padding, compile_layers, compile_scope)
    model.train(False)
    model.requires_grad_(trainable)
    return model


def special_ids(model, tokenizer, path: str) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """(banned vision ids int64 [k], EOS ids of the generation config, pad id)."""
    from transformers import GenerationConfig

    cfg = model.config
    banned = {cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id}
    pad_vision = tokenizer.convert_tokens_to_ids("<|vision_pad|>")
    if isinstance(pad_vision, int) and pad_vision != tokenizer.unk_token_id:
        banned.add(pad_vision)
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    return torch.tensor(sorted(int(i) for i in banned)), eos_ids, int(pad)


def build_source(
    cfg: Config, path: str, processor, model, shuffle: bool, shuffled_twins: bool = False
) -> tuple[PromptSource, int]:
    """Records of ``path`` behind a PromptSource; returns it and the count of malformed records.
    ``shuffled_twins``: video prompts carry their shuffled-frame twin (T-GRPO)."""
    records, malformed = load_records(path)
    data = cfg.data
    root = data_root(data)
    vision = model.config.vision_config
    builder = PromptBuilder(
        processor=processor,
        template=data.template,
        data_root=root,
        max_prompt_tokens=data.max_prompt_tokens,
        video=VideoSampling(
            fps=data.video_fps,
            min_frames=data.video_min_frames,
            max_frames=data.video_max_frames,
            min_pixels=data.video_min_pixels,
            max_pixels=data.video_max_pixels,
            total_pixels=data.video_total_pixels,
        ),
        image=ImageSampling(min_pixels=data.image_min_pixels, max_pixels=data.image_max_pixels),
        tokens=VisionTokens.from_config(model.config),
        temporal_patch_size=int(vision.temporal_patch_size),
        shuffled_twins=shuffled_twins,
        seed=cfg.run.seed,
    )
    source = PromptSource(records, builder, cfg.rollout.prompts_per_step, seed=cfg.run.seed, shuffle=shuffle)
    return source, malformed


@dataclass
class Run:
    """Everything a training run holds."""

    cfg: Config
    run_dir: Path
    roles: Roles
    processor: object
    train: PromptSource
    val: PromptSource | None
    malformed: int
    device: torch.device
    step_fn: Callable | None = None  # the schedule's step (schedule.make_step); set by build_run
    val_malformed: int = 0  # malformed held-out records (skipped at load)
    updates_skipped: int = 0  # optimizer updates dropped for a gradient norm that is not finite, whole run
    memory: MemoryRuntime | None = None  # the plan and residency (memory.runtime); set by build_run
    parallel: ParallelRuntime | None = None  # this rank's part of a run of several processes


def _check_suffix_attention(cfg: Config) -> str:
    """The suffix attention backend of the run's device and dtype (``model.suffix_attention``), checked
    as the run starts (a job of one-token responses never reaches the suffix attention, so it would not
    fail there).

    Raises:
        ValueError: a backend the device cannot run (``models.forward.suffix_backend``).
    """
    device = torch.device(resolve_device(cfg.run))
    dtype = resolve_dtype(cfg.run, device.type)
    return suffix_backend(device, dtype, cfg.model.suffix_attention)


def build_run(
    cfg: Config,
    ctx: ParallelContext | None = None,
    actor_path: str | None = None,
    plan: MemoryPlan | None = None,
) -> Run:
    """Models, optimizer, sampling and data of a run (from ``cfg``, checked by ``train`` before; no
    checkpoint applied), its memory as ``plan`` says (``memory.runtime``; default: ``plan_run``'s), with
    the device budget enforced before the models load. With ``ctx`` of several processes the models
    are loaded on the CPU, sharded for this rank and moved to its GPU (``parallel.runtime``);
    ``actor_path`` loads the actor from another folder (a resumed parallel run's checkpoint: its weights
    before they are sharded)."""
    from transformers import AutoProcessor

    device = torch.device(resolve_device(cfg.run))
    dtype = resolve_dtype(cfg.run, device.type)
    parallel_run = ctx is not None and ctx.world > 1
    if parallel_run:
        device = ctx.device
    load_device = torch.device("cpu") if parallel_run else device
    plan = plan if plan is not None else plan_run(cfg, device)
    enforce_budget(plan.budget_gib, device)
    seed_everything(cfg.run.seed)
    if cfg.run.deterministic:
        use_deterministic_algorithms()
    processor = AutoProcessor.from_pretrained(cfg.model.path)
    vision = {
        "vision_attention": cfg.model.vision_attention,
        "vision_mlp_padding": cfg.model.vision_mlp_padding,
        "compile_layers": compiles_layers(cfg.model.compile_layers, device),
        "compile_scope": cfg.model.compile_scope,
    }
    actor = load_model(actor_path or cfg.model.path, dtype, load_device, trainable=True, **vision)
    if cfg.model.freeze_vision:
        actor.model.visual.requires_grad_(False)
    if cfg.model.gradient_checkpointing:
        # transformers checkpoints a layer only in training mode; Qwen2.5-VL has no active dropout.
        enable_checkpointing(actor, layer_recompute=cfg.model.layer_recompute)
    reference = None
    if cfg.algo.kl_coef > 0 and (not parallel_run or ctx.trains):  # rollout-only ranks score nothing
        reference = load_model(cfg.model.path, dtype, load_device, trainable=False, **vision)
    parallel = None
    if parallel_run:
        parallel = ParallelRuntime.setup(ctx, cfg, actor, reference, device)
    banned, eos_ids, pad = special_ids(actor, processor.tokenizer, cfg.model.path)
    sampling = SamplingParams.from_config(cfg.rollout, eos_ids, pad, banned.to(device))
    # under torchrun the actor's optimizer is parallel.optimizer's (ZeRO-1 ChunkedAdamW over the
    # data-parallel group, one gradient reduction, the global norm, the rollout refresh after it)
    make_optimizer = None
    if parallel is not None:

        def make_optimizer(pool, transfers, host_bytes):
            return parallel.optimizer(actor, pool=pool, transfers=transfers, host_bytes=host_bytes)

    memory = build_memory(plan, cfg, device, actor, reference, make_optimizer=make_optimizer)
    generator = torch.Generator(device=device).manual_seed(cfg.run.seed)
    roles = Roles(
        actor,
        reference,
        memory.optimizer,
        processor.tokenizer,
        sampling,
        generator,
        cfg,
        residency=memory.residency,
        offload=memory.offload,
        parallel=parallel,
    )
    train_source, malformed = build_source(
        cfg,
        cfg.data.train_path,
        processor,
        actor,
        cfg.data.shuffle,
        shuffled_twins=uses_temporal(roles),
    )
    val_source, val_malformed = None, 0
    if cfg.data.val_path:
        val_source, val_malformed = build_source(cfg, cfg.data.val_path, processor, actor, shuffle=False)
    step_fn = make_step(cfg, device) if parallel is None or parallel.trains else rollout_only_step
    return Run(
        cfg,
        Path(cfg.run.out_dir),
        roles,
        processor,
        train_source,
        val_source,
        malformed,
        device,
        step_fn,
        val_malformed,
        parallel=parallel,
        memory=memory,
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def evaluate(run: Run) -> tuple[float, float | None]:
    """Greedy held-out accuracy (mean accuracy reward) and the chance accuracy of the val set.

    Chance is the mean of 1/len(options) when every val record is multiple choice, else None.
    """
    from rollplex.algo.rewards import compute_rewards

    prompts = run.val.all_prompts(run.cfg.eval.num_prompts)
    greedy = replace(run.roles.sampling, temperature=run.cfg.eval.temperature)
    # Its own generator: evaluation never moves the training sampler's random stream.
    roles = replace(run.roles, generator=torch.Generator(device=run.device).manual_seed(run.cfg.run.seed + 1))
    correct = []
    for start in range(0, len(prompts), run.cfg.rollout.prompts_per_step):
        chunk = prompts[start : start + run.cfg.rollout.prompts_per_step]
        if run.parallel is not None:  # each replica scores its share (a rollout-only rank decodes all)
            chunk = run.parallel.replica_share(chunk)
        rollout = rollout_phase(roles, chunk, 1, greedy)
        if chunk and (run.parallel is None or run.parallel.trains):
            rewards = compute_rewards(
                rollout.texts, [p.record for p in chunk], list(run.cfg.reward.functions), None
            )
            correct.append(rewards.accuracy.float())
    accuracy = float(torch.cat(correct).mean()) if correct else float("nan")
    if run.parallel is not None:
        accuracy = run.parallel.mean_over_replicas(correct)
    records = [p.record for p in prompts]
    chance = None
    if records and all(r.problem_type == "multiple choice" for r in records):
        chance = float(np.mean([1.0 / len(r.options) for r in records]))
    return accuracy, chance


def step_metrics(scored: ScoredBatch, stats: list[ActorStats], norms: list[float]) -> dict[str, float]:
    """Scalars of one step (metrics.jsonl keys)."""
    rollout, rewards = scored.rollout, scored.rewards
    tokens = max(1, sum(s.tokens for s in stats))
    out = {
        "reward_mean": float(rewards.total.mean()),
        "accuracy": float(rewards.accuracy.mean()),
        "kl": sum(s.kl for s in stats) / tokens,
        "loss": sum(s.loss for s in stats) / len(stats),
        "clip_fraction": sum(s.clip_fraction for s in stats) / tokens,
        "entropy": sum(s.entropy for s in stats) / tokens,
        "response_length": float(rollout.response_lens.float().mean()),
        "truncated_fraction": float(rollout.truncated.float().mean()),
        "decode/setup_s": rollout.setup_s,
        "grad_norm": float(np.mean(norms)),
        "skipped_updates": sum(not math.isfinite(n) for n in norms),  # optim.clip_and_step dropped them
        "zero_variance_groups": scored.zero_variance_groups,
        "reward_errors": rewards.errors,
        "logprob_diff_max": max(s.logprob_diff_max for s in stats),
        "logprob_diff_mean": sum(s.logprob_diff_sum for s in stats) / tokens,
    }
    for name, values in rewards.per_function.items():
        out[f"reward/{name}"] = float(values.float().mean())
    if any(name in FORMAT_REWARDS for name in rewards.per_function):
        out["format_rate"] = float(rewards.format.mean())
    out.update(temporal_metrics(scored))
    return out


def temporal_metrics(scored: ScoredBatch) -> dict[str, float]:
    """T-GRPO's scalars (none when it is off): video groups in the batch, flagged shuffled-frame responses,
    the mean accuracy of the groups' ordered and shuffled-frame responses, and the fraction of those groups
    given the bonus."""
    shuffled = scored.shuffled
    if shuffled is None:
        return {}
    out = {
        "temporal/video_groups": float(len(shuffled.groups)),
        "temporal/reward_errors": float(shuffled.errors),
    }
    if shuffled.groups:
        n = scored.rollout.group_size
        ordered = compared_values(scored.rewards, shuffled).view(-1, n)[shuffled.groups]
        bonus = scored.rewards.per_function["temporal"].view(-1, n)[shuffled.groups]
        out["temporal/ordered_accuracy"] = float(ordered.mean())
        out["temporal/shuffled_accuracy"] = float(shuffled.accuracy.mean())
        out["temporal/bonus_group_fraction"] = float((bonus > 0).any(dim=1).float().mean())
    return out


def trainer_state(run: Run, step: int) -> dict:
    return {**_run_state(run, step), **_rank_state(run)}


def _run_state(run: Run, step: int) -> dict:
    """The state every process of a run shares: step, data cursor, schedule, skipped updates."""
    return {
        "step": step,
        "train_cursor": run.train.state_dict(),
        "schedule": run.step_fn.state_dict() if hasattr(run.step_fn, "state_dict") else None,
        "updates_skipped": run.updates_skipped,
    }


def _rank_state(run: Run) -> dict:
    """A process's own state: its optimizer (its ZeRO-1 shard under torchrun) and random states."""
    return {
        "optimizer": run.roles.optimizer.state_dict(),
        "rng": rng_state(),
        "generator": run.roles.generator.get_state(),
    }


def _restore_run_state(run: Run, state: dict) -> int:
    run.train.load_state_dict(state["train_cursor"])
    if state.get("schedule") is not None and hasattr(run.step_fn, "load_state_dict"):
        run.step_fn.load_state_dict(state["schedule"])
    run.updates_skipped = int(state.get("updates_skipped", 0))
    return int(state["step"])


def _restore_rank_state(run: Run, state: dict) -> None:
    run.roles.optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    run.roles.generator.set_state(state["generator"])


def restore_parallel(run: Run, ckpt: Path) -> int:
    """A parallel run's state from ``ckpt`` (its weights were loaded with the model: ``build_run``'s
    ``actor_path``): the shared state and this rank's own file; returns the step to continue from.

    Raises:
        ValueError: the checkpoint has no file of this rank (``checkpoint.load_rank_state``).
    """
    _restore_rank_state(run, load_rank_state(ckpt, run.parallel.ctx.rank))
    return _restore_run_state(run, load_trainer_state(ckpt))


def restore(run: Run, ckpt: Path) -> int:
    """Load actor weights and trainer state from ``ckpt``; returns the step to continue from."""
    from safetensors.torch import load_file

    state = load_trainer_state(ckpt)
    weights = {}
    for file in sorted((ckpt / "hf").glob("*.safetensors")):
        weights.update(load_file(file))
    missing, unexpected = _load_hf_weights(run.roles.actor, weights)
    if unexpected or missing:
        raise ValueError(
            f"checkpoint {ckpt} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    _restore_rank_state(run, state)
    return _restore_run_state(run, state)


def _load_hf_weights(model, weights: dict) -> tuple[list[str], list[str]]:
    """Copy saved tensors into ``model`` by name, accepting the on-disk (legacy) and in-memory key names."""
    params = dict(model.state_dict())
    missing, unexpected = [], []
    renamed = {_in_memory_name(k, params): v for k, v in weights.items()}
    with torch.no_grad():
        for name, value in renamed.items():
            if name not in params:
                unexpected.append(name)
                continue
            params[name].copy_(value)
    for name in params:
        if name not in renamed and not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            missing.append(name)
    return missing, unexpected


def _in_memory_name(key: str, params: dict) -> str:
    if key in params:
        return key
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith("model.language_model."):
        return "model.language_model." + key[len("model.") :]
    return key


def train(cfg: Config, resume: bool = False, overwrite: bool = False) -> Path:
    """Run GRPO training as configured; returns the run folder. Under torchrun every process calls it
    (module docstring).

    Args:
        resume: continue from the run folder's latest checkpoint; a run already at ``run.steps``
            returns at once and writes nothing.
        overwrite: start over in a run folder that already holds a run (its checkpoints and metrics are
            removed first); without it such a folder is refused, so no run history is lost by accident.

    Raises:
        ConfigError / DatasetError (ValueError): bad config, unreadable dataset or nothing usable left,
            or a run folder that already holds a run (without ``resume`` or ``overwrite``); a
            ``parallel:`` section that does not fit the processes torchrun started or the model.
        ValueError: ``resume`` without a checkpoint, with one of the other schedule (auto against
            rollplex), or with one written by another world size or ``parallel:`` section; a
            ``model.suffix_attention`` that cannot run on the run's device
            (``models.forward.suffix_backend``).
        parallel.dist.RankFailure: another process of the run failed (its log names the error).
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ctx = init_parallel(cfg.parallel)  # torchrun's processes; one process: no process group at all
    configure_logging(ctx)
    run_dir = _train(cfg, ctx, resume, overwrite)
    close_parallel(ctx)
    return run_dir


def _train(cfg: Config, ctx: ParallelContext, resume: bool, overwrite: bool) -> Path:
    """``train`` on this process of the run ``ctx`` describes."""
    _quiet_library_progress()
    started = time.perf_counter()
    validate_for_training(cfg)  # once per run, before --overwrite clears anything
    check_model_folder(cfg.model.path)  # before anything loads from it, and before --overwrite clears
    check_reward_config(cfg.reward)
    if ctx.world > 1:
        check_parallel(cfg.parallel, ctx.world, _text_config(cfg.model.path), cfg.rollout.prompts_per_step)
    backend = _check_suffix_attention(cfg)
    device = ctx.device if ctx.world > 1 else torch.device(resolve_device(cfg.run))
    plan = plan_run(cfg, device)  # shapes only
    refuse_unless_fits(plan)  # before step 1, and before --overwrite clears anything
    with guard(ctx, "set-up"):
        if ctx.is_writer:
            _claim_run_dir(Path(cfg.run.out_dir), resume, overwrite)
    ckpt = _resume_checkpoint(Path(cfg.run.out_dir)) if resume else None  # before anything is written or said
    chosen = (
        "the device and dtype's default" if cfg.model.suffix_attention == "auto" else "model.suffix_attention"
    )
    log.info("suffix attention (how responses attend to their prompt's keys): %s, %s", backend, chosen)
    for why, fields in ignored_fields(cfg).items():
        log.warning("%s set, but %s: ignored", ", ".join(fields), why)
    if device.type == "cuda":
        log.info("memory plan, GiB per GPU (h = in the pinned host pool):\n%s", plan.table())
    else:  # host memory only: the per-GPU table would be all zeros
        log.info("memory plan: %s device, every class of state resident", device.type)
    step = 0
    with guard(ctx, "set-up"):
        if ckpt is not None:
            check_layout(load_trainer_state(ckpt), layout_key(ctx, cfg), ckpt)
        actor_path = str(ckpt / "hf") if ckpt is not None and ctx.world > 1 else None
        run = build_run(cfg, ctx, actor_path, plan)
        if run.parallel is not None:
            for line in run.parallel.describe():
                log.info("%s", line)
        if ckpt is not None:
            step = restore(run, ckpt) if run.parallel is None else restore_parallel(run, ckpt)
    if ckpt is not None:
        log.info("resumed from %s at step %d", ckpt, step)
        if step >= cfg.run.steps:  # leave the folder as it is: its config, metrics and trace stay
            log.info(
                "the run is at step %d of run.steps=%d: nothing left to train (raise run.steps to go on)",
                step,
                cfg.run.steps,
            )
            return run.run_dir
    if ctx.is_writer:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run.run_dir / "config.yaml")
    resume_step = step if resume else None  # metrics and trace spans after it are replaced
    metrics = MetricSinks.open(
        run.run_dir, cfg.logging, config_to_dict(cfg), resume_step=resume_step, enabled=ctx.is_writer
    )
    trace_path = run.run_dir / TRACE_FILE
    earlier_trace = read_chrome_trace(trace_path) if resume and ctx.is_writer else None
    with guard(ctx, "evaluation"):
        first_eval = {} if resume else _maybe_eval(run, step, force=True)
    if first_eval:
        metrics.write({"step": step, **first_eval})
    timer = PhaseTimer(sync=torch.cuda.synchronize if run.device.type == "cuda" else None)
    record: dict = {}
    bar = ProgressBar(total=cfg.run.steps, initial=step, enabled=cfg.run.progress and ctx.is_writer)
    # sinks closed and warnings no longer routed above the bar on leaving; GcClock: see step_done
    with metrics, bar, GcClock() as gc_clock:
        while step < cfg.run.steps:
            timer.step = step + 1  # the trace's spans carry the step metrics.jsonl numbers them by
            with guard(ctx, f"step {step + 1}"):
                record = _train_step(run, step, timer, gc_clock)
            run.updates_skipped += record["skipped_updates"]
            step += 1
            gc_clock.step_done(cfg.run.steps - step)  # the long-lived heap out of later passes
            with guard(ctx, "evaluation"):
                record.update(_maybe_eval(run, step, force=step == cfg.run.steps, timer=timer))
            metrics.write(record)
            bar.update(record)
            if not cfg.run.progress and (step % cfg.run.log_every == 0 or step == cfg.run.steps):
                log.info(_log_line(record))
            if _should_save(cfg, step):
                # between steps: in the trace, not the step's times
                with timer.phase("checkpoint", count=False):
                    # a cycle that died among the frozen objects waits no longer
                    gc_clock.refreeze(cfg.run.steps - step)
                    _save(run, step, ctx)
                # a killed run keeps its trace
                if ctx.is_writer:
                    counters = _memory_counters(run)
                    write_chrome_trace(timer.spans, trace_path, earlier_trace, resume_step, counters)
    # the last step always saves a checkpoint, and with it the trace
    _summary(run, first_eval, record, time.perf_counter() - started)
    return run.run_dir


def _text_config(path: str):
    """The language model's config of the checkpoint folder ``path`` (its config.json only)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).text_config


def layout_key(ctx: ParallelContext, cfg: Config) -> dict:
    """What a checkpoint must have been written by to resume here (``checkpoint.check_layout``)."""
    if ctx.world == 1:
        return {"world": 1}
    p = cfg.parallel
    names = ("dp", "tp_train", "tp_rollout", "placement", "rollout_gpus")
    return {"world": ctx.world, **{name: getattr(p, name) for name in names}}


def _save(run: Run, step: int, ctx: ParallelContext) -> None:
    """The checkpoint of ``step``: one process's, or every rank's part of a parallel run's (rank 0 writes
    the Hugging Face weights, gathered from the tensor-parallel shards, and the run's state; every rank
    its optimizer shard and random states)."""
    cfg = run.cfg
    if run.parallel is None:
        save_checkpoint(
            run.run_dir,
            step,
            model=run.roles.actor,
            processor=run.processor,
            trainer_state=trainer_state(run, step),
            keep=cfg.run.keep_checkpoints,
        )
        return
    with guard(ctx, "checkpoint"):
        weights = run.parallel.full_state_dict(run.roles.actor) if run.parallel.trains else None
    shared = {**_run_state(run, step), "parallel": layout_key(ctx, cfg)}
    save_sharded_checkpoint(
        run.run_dir,
        step,
        ctx=ctx,
        model=run.roles.actor,
        weights=weights,
        processor=run.processor,
        trainer_state=shared,
        rank_state=_rank_state(run),
        keep=cfg.run.keep_checkpoints,
    )


def _resume_checkpoint(run_dir: Path) -> Path:
    """The latest checkpoint of ``run_dir``.

    Raises:
        ValueError: the folder holds no checkpoint (nothing is written to it then).
    """
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise ValueError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
    return ckpt


def _claim_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to start a new run on top of an old one unless asked to overwrite it."""
    held = [p for p in (run_dir / "metrics.jsonl", run_dir / "checkpoints") if p.exists()]
    if not held or resume:
        return
    if not overwrite:
        raise ValueError(
            f"run folder {run_dir} already holds a run ({', '.join(p.name for p in held)}): pass --resume to "
            "continue it, --overwrite to start over, or choose another run.out_dir"
        )
    for path in held:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (run_dir / TRACE_FILE).unlink(missing_ok=True)


def _log_line(record: dict) -> str:
    fields = (
        ("step", "step", "{:d}"),
        ("reward", "reward_mean", "{:.3f}"),
        ("acc", "accuracy", "{:.3f}"),
        ("val_acc", "val_accuracy", "{:.3f}"),
        ("kl", "kl", "{:.4f}"),
        ("s/step", "time/step", "{:.2f}"),
    )
    return " ".join(f"{label} {fmt.format(record[key])}" for label, key, fmt in fields if key in record)


def _quiet_library_progress() -> None:
    """Keep transformers' own per-load/per-save progress bars out of the run's console."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _train_step(run: Run, step: int, timer: PhaseTimer, gc_clock: GcClock) -> dict:
    cfg = run.cfg
    run.roles.optimizer.set_lr(learning_rate(step, cfg.optim.lr, cfg.optim.warmup_steps))
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    gc_clock.pop()  # passes between steps (evaluation, checkpoints) are not the step's
    start = time.perf_counter()
    with timer.phase("data"):
        prompts = run.train.next_batch()
        if run.parallel is not None:  # this replica's groups (every group on a rollout-only rank)
            prompts = run.parallel.replica_share(prompts)
    scored, stats, norms, schedule_metrics = run.step_fn(run.roles, prompts, timer)
    if scored is None:  # a disaggregated rollout-only rank: nothing of its own to report
        timer.pop()
        return {"step": step + 1, "skipped_updates": 0}
    if run.parallel is not None:  # the replicas' actor sums, so every metric is the whole batch's
        stats = [_reduced(run.parallel, s) for s in stats]
    record = {"step": step + 1, **step_metrics(scored, stats, norms), **schedule_metrics}
    record.update(timer.pop())
    record["time/step"] = time.perf_counter() - start
    record.update(gc_clock.pop())
    if record["skipped_updates"]:
        log.warning(
            "step %d: %d of %d updates skipped, their gradient norm not finite (the weights are as "
            "before each of them)",
            step + 1,
            record["skipped_updates"],
            len(norms),
        )
    record["skipped_samples"] = len(run.train.skipped) + run.malformed
    record["lr"] = learning_rate(step, cfg.optim.lr, cfg.optim.warmup_steps)  # what set_lr was given
    record.update(step_memory(run.device))
    if run.memory is not None:
        record.update(memory_metrics(run.memory))
    if run.parallel is not None:  # rank 0 writes the slowest rank's times, the replicas' totals
        record = run.parallel.reduce_record(record)
    return record


def _memory_counters(run: Run) -> list[CounterSample]:
    """The residency manager's samples (each window's start) as two counter tracks of the trace: GiB on
    the device and in the host pool, per state class."""
    if run.memory is None:
        return []
    out = []
    for sample in run.memory.residency.samples:
        for track, values in (("device GiB", sample.device), ("host pool GiB", sample.host)):
            out.append(CounterSample(track, sample.time, {k: v / 2**30 for k, v in values.items()}))
    return out


def _reduced(parallel: ParallelRuntime, stats: ActorStats) -> ActorStats:
    """One mini-batch's actor sums over the data-parallel replicas (the largest log-prob gap)."""
    values = parallel.reduce_stats(asdict(stats), frozenset({"logprob_diff_max"}))
    return ActorStats(**{**values, "tokens": int(values["tokens"])})


def step_memory(device: torch.device) -> dict[str, float]:
    """Device memory of the step just run, GiB (2**30 bytes), from the caching allocator: ``peak_memory_gib``,
    the most allocated at once since the step's start (the loop resets the peak there), and
    ``memory_allocated_gib``, what is still allocated after it: weights, optimizer state and whatever
    outlives the step. The second should stay flat from step to step; growth is a leak. Empty on a device
    other than CUDA."""
    if device.type != "cuda":
        return {}
    return {
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "memory_allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
    }


def _maybe_eval(run: Run, step: int, force: bool, timer: PhaseTimer | None = None) -> dict:
    """The held-out metrics where evaluation is due after ``step`` (or ``force``), else {}; with ``timer``,
    the evaluation is a span of its trace, outside the step's phase times."""
    every = run.cfg.eval.every
    if run.val is None or (not force and (every <= 0 or step % every)):
        return {}
    span = timer.phase("evaluation", count=False) if timer is not None else contextlib.nullcontext()
    with span:
        accuracy, chance = evaluate(run)
    out = {"val_accuracy": accuracy, "val_skipped_samples": len(run.val.skipped) + run.val_malformed}
    if chance is not None:
        out["chance_accuracy"] = chance
    return out


def _should_save(cfg: Config, step: int) -> bool:
    every = cfg.run.save_every
    return step == cfg.run.steps or (every > 0 and step % every == 0)


def duration_text(seconds: float) -> str:
    """A wall-clock duration as the run's last line gives it: seconds under a minute ("42 s"), else
    minutes to a tenth ("1.4 min")."""
    return f"{seconds:.0f} s" if seconds < 59.5 else f"{seconds / 60:.1f} min"


def _skipped_text(last: dict) -> str:
    """The samples skipped over the run (``skipped_samples``, and ``val_skipped_samples`` where the run
    evaluates), both counts once either is not 0, e.g. "samples skipped: 4 training, 0 held-out (each
    named in a warning above)"; "" where none was."""
    counts = {"training": last.get("skipped_samples", 0)}
    if "val_skipped_samples" in last:
        counts["held-out"] = last["val_skipped_samples"]
    if not any(counts.values()):
        return ""
    text = ", ".join(f"{n} {split}" for split, n in counts.items())
    return f"samples skipped: {text} (each named in a warning above)"


def _summary(run: Run, first: dict, last: dict, seconds: float) -> None:
    parts = [f"run folder {run.run_dir}", f"{duration_text(seconds)} from model load to last save"]
    if "val_accuracy" in first and "val_accuracy" in last:
        parts.append(f"held-out accuracy {first['val_accuracy']:.3f} -> {last['val_accuracy']:.3f}")
    elif "val_accuracy" in last:
        parts.append(f"held-out accuracy {last['val_accuracy']:.3f}")
    if "chance_accuracy" in last:
        parts.append(f"chance {last['chance_accuracy']:.3f}")
    skipped = _skipped_text(last)
    if skipped:
        parts.append(skipped)
    if run.updates_skipped:
        plural = "s" if run.updates_skipped != 1 else ""
        parts.append(f"{run.updates_skipped} update{plural} skipped (gradient norm not finite)")
    fallback = compile_fallback()
    if fallback is not None:
        parts.append(f"layers ran uncompiled ({fallback})")
    log.info("done: %s", "; ".join(parts))
    if not math.isfinite(last.get("loss", 0.0)):
        log.warning("the last loss was not finite")
