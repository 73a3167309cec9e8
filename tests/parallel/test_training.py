"""``rollplex train`` on 2 and 4 CPU processes (gloo, float32) against one process on the same global
batch: data parallelism, tensor parallelism, TP_train = 2 × TP_rollout with one physical actor copy,
the disaggregated baseline, and checkpoints.

What must be equal, and how:

- rollout tokens and lengths, bitwise: every engine races on its rows of the whole rollout's noise
  (rollout.sampler.sample_rows) and every engine stops at the same round, so the tokens are those one
  process samples (the responses are also padded to the same width). With TP_rollout > 1 the
  vocabulary-parallel race forms the keys from shard maxima (parallel.vocab_parallel): a token could
  differ only where two candidates' keys tie to float32 rounding, which these runs do not meet.
- parameters after 2 steps, within 1e-4 absolute (a tenth of one step's largest update, lr = 1e-3):
  float32 sums are taken in another order (each replica's half of the batch, gradients all-reduced;
  TP's partial sums; the clipping norm as a float64 sum of squares instead of torch's norm of per-tensor
  norms), and Adam's update g / (√v + ε) carries a gradient's relative rounding into the weights at up
  to lr times it where g is small against its own history. Observed up to 4e-5 (tp 4/2), most
  tensors below 3e-6.
- a resumed run equals the run it continues bitwise (same processes, same arithmetic).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollplex.config import load_config
from rollplex.data.synth import generate_dataset
from rollplex.models.presets import init_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-4


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel-assets")
    data = root / "data"
    generate_dataset(
        data, 16, 0, width=56, height=56, num_frames=8, fps=4.0, val_fraction=0.25, families=("color",)
    )
    return {
        "tiny": init_checkpoint("tiny", root / "tiny", seed=0),
        "tiny-tp": init_checkpoint("tiny-tp", root / "tiny-tp", seed=0),
        "data": data,
    }


def settings(assets, out: Path, preset: str = "tiny", steps: int = 2, **extra) -> list[str]:
    """A 4-group step of 2 four-token responses each; responses scored by a reward that tells them
    apart (bench.common.distinct_reward), so the update is not zero."""
    data = assets["data"]
    values = {
        "run.out_dir": str(out),
        "run.steps": steps,
        "run.save_every": steps,
        "run.progress": False,
        "model.path": str(assets[preset]),
        "data.train_path": str(data / "train.json"),
        "data.template": "answer_only",
        "data.video_min_pixels": 3136,
        "data.video_max_pixels": 3136,
        "rollout.group_size": 2,
        "rollout.prompts_per_step": 4,
        "rollout.max_response_tokens": 4,
        "reward.functions": "[rollplex.bench.common:distinct_reward]",
        "optim.lr": 1e-3,
        **extra,
    }
    return [f"{k}={v}" for k, v in values.items()]


def recorded_train(items: list[str], resume: bool = False) -> tuple[str, list]:
    """``loop.train`` with every rollout's tokens and lengths recorded (the serial schedule's
    rollout_phase): (run folder, [(responses, lengths) per step])."""
    from rollplex.loop import train
    from rollplex.schedule import serial

    seen, original = [], serial.rollout_phase

    def recording(*args, **kwargs):
        batch = original(*args, **kwargs)
        seen.append((batch.responses.clone(), batch.response_lens.clone()))
        return batch

    serial.rollout_phase = recording
    try:
        run = train(load_config(None, items), resume=resume)
    finally:
        serial.rollout_phase = original
    return str(run), seen


def inspected_train(items: list[str]) -> dict:
    """``recorded_train`` on a rank of the pool, then this rank's rollout weights checked against its
    training parameters (pointers) and against the final checkpoint (values)."""
    from rollplex import loop
    from tests.parallel.test_weight_sharing import _pointer_checks, _rollout_errors

    runs, build = [], loop.build_run
    loop.build_run = lambda *a, **k: runs.append(build(*a, **k)) or runs[-1]
    try:
        folder, seen = recorded_train(items)
    finally:
        loop.build_run = build
    run = runs[0]
    shared, ctx = run.parallel.shared, run.parallel.ctx
    final = saved_model(Path(folder))
    full = {name: p.detach() for name, p in final.named_parameters()}
    errors = _rollout_errors(shared, full, ctx.rollout_tp.size, ctx.rollout_tp.rank)
    return {
        "folder": folder,
        "seen": seen,
        "not_views": _pointer_checks(run.roles.actor, shared),
        "errors": errors,
    }


def saved_model(run: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    latest = (run / "checkpoints" / "latest").read_text().strip()
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(run / "checkpoints" / latest / "hf")


def weights(run: Path) -> dict[str, torch.Tensor]:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return load_file(run / "checkpoints" / latest / "hf" / "model.safetensors")


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def replicas(seen_by_rank: list[list], tp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the replicas' rollouts (ranks 0, tp, 2·tp, ...) in replica order: the global batch."""
    firsts = seen_by_rank[::tp]
    return [
        (torch.cat([r[step][0] for r in firsts]), torch.cat([r[step][1] for r in firsts]))
        for step in range(len(firsts[0]))
    ]


def assert_same_rollouts(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (tokens, lengths), (want_tokens, want_lengths) in zip(got, want, strict=True):
        assert torch.equal(tokens, want_tokens) and torch.equal(lengths, want_lengths)


@pytest.fixture(scope="module")
def one_process(assets, tmp_path_factory):
    """The oracle of each preset: one process, the same global batch, 2 steps; no process group is
    started and no parallel runtime is built."""
    from rollplex.parallel import runtime

    root = tmp_path_factory.mktemp("one-process")
    built = []
    setup = runtime.ParallelRuntime.setup
    runtime.ParallelRuntime.setup = lambda *a, **k: built.append(a) or setup(*a, **k)
    try:
        out = {p: recorded_train(settings(assets, root / p, p)) for p in ("tiny", "tiny-tp")}
    finally:
        runtime.ParallelRuntime.setup = setup
    assert not torch.distributed.is_initialized() and not built
    return {p: (Path(folder), seen) for p, (folder, seen) in out.items()}


@pytest.mark.parametrize(
    ("name", "world", "extra"),
    [
        ("dp2", 2, {"parallel.dp": 2}),
        ("dp2-whole-optimizer", 2, {"parallel.dp": 2, "parallel.shard_optimizer": False}),
        ("tp2", 2, {"parallel.tp_train": 2, "parallel.tp_rollout": 2}),
        ("disaggregated", 2, {"parallel.placement": "disaggregated", "parallel.rollout_gpus": 1}),
        ("dp2-tp2", 4, {"parallel.dp": 2, "parallel.tp_train": 2, "parallel.tp_rollout": 1}),
    ],
)
def test_parallel_run_trains_as_one_process(ranks, assets, one_process, tmp_path, name, world, extra):
    """tiny: dp=2, with the optimizer state sharded (ZeRO-1) and whole on each rank; tp_train = tp_rollout = 2; disaggregated 1 + 1 (the training GPU sends its
    weights after each update); dp=2 × tp_train=2 with TP_rollout 1 (q = 2: the rollout prefix's
    key/value heads gathered in the share group, two engines per replica)."""
    results = ranks(world, recorded_train, settings(assets, tmp_path / name, **extra))
    folder, one_seen = one_process["tiny"]
    tp = extra.get("parallel.tp_train", 1)
    trainers = results[: world - extra.get("parallel.rollout_gpus", 0)]
    assert_same_rollouts(replicas([seen for _, seen in trainers], tp), one_seen)
    assert largest_difference(weights(Path(results[0][0])), weights(folder)) <= ATOL


def test_tp4_rollout_tp2_shares_one_copy_and_trains_as_one_process(ranks, assets, one_process, tmp_path):
    """tiny-tp (8 query / 4 key-value heads) at tp_train 4, tp_rollout 2 on 4 processes: the same
    rollout tokens and update as one process, every rollout weight of Case 1/2 a view inside the
    training parameters' storage, and after the last update the rollout shards hold the final weights."""
    items = settings(
        assets, tmp_path / "tp4", "tiny-tp", **{"parallel.tp_train": 4, "parallel.tp_rollout": 2}
    )
    results = ranks(4, inspected_train, items)
    folder, one_seen = one_process["tiny-tp"]
    assert_same_rollouts(replicas([r["seen"] for r in results], 4), one_seen)
    assert largest_difference(weights(Path(results[0]["folder"])), weights(folder)) <= ATOL
    for rank, out in enumerate(results):
        assert out["not_views"] == [], (rank, out["not_views"])
        assert out["errors"] == 0.0, rank  # the refresh after the last update, bitwise


def test_resume_under_dp2_continues_bitwise_and_another_world_is_refused(ranks, assets, tmp_path):
    straight = Path(
        ranks(2, recorded_train, settings(assets, tmp_path / "straight", **{"parallel.dp": 2}))[0][0]
    )
    split = tmp_path / "split"
    ranks(2, recorded_train, settings(assets, split, steps=1, **{"parallel.dp": 2}))
    ranks(2, recorded_train, settings(assets, split, **{"parallel.dp": 2}), True)
    a, b = weights(straight), weights(split)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ckpt = split / "checkpoints" / (split / "checkpoints" / "latest").read_text().strip()
    assert sorted(p.name for p in ckpt.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
    with pytest.raises(ValueError, match=r"written by a run of 2 process\(es\).*WORLD_SIZE"):
        recorded_train(settings(assets, split, steps=3), resume=True)


def torchrun_train(config: Path, items: list[str], env: dict) -> str:
    """``torchrun --nproc-per-node 2 -m rollplex train CONFIG key=value ...``; its log (stdout, stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "rollplex", "train", str(config), *items]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    return log


def test_torchrun_two_processes_train_three_steps_and_log_their_layout(assets, tmp_path):
    """The real entry point: ``torchrun --nproc-per-node 2 -m rollplex train CONFIG key=value`` on the
    CPU; rank 0 logs the layout (degrees, placement, the Case 1/2/3 split) and writes the run."""
    config = tmp_path / "run.yaml"
    config.write_text("parallel:\n  dp: 1\n  tp_train: 2\n  tp_rollout: 2\n")
    out = tmp_path / "run"
    log = torchrun_train(
        config, settings(assets, out, steps=3, **{"run.save_every": 0}), {"CUDA_VISIBLE_DEVICES": ""}
    )
    assert "parallel layout: 2 processes, dp=1, tp_train=2, tp_rollout=2, colocated" in log
    assert "Case 1:" in log and "Case 2:" in log and "Case 3: 0 tensors" in log
    assert log.count("parallel layout:") == 1  # rank 0 alone
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (out / "checkpoints" / "step_000003" / "rank_00001.pt").is_file()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(
    "layout", ["tp_train: 2\n  tp_rollout: 1", "dp: 2", "placement: disaggregated\n  rollout_gpus: 1"]
)
def test_torchrun_on_two_gpus_in_bfloat16(assets, tmp_path, layout):
    """The same entry point on two GPUs: NCCL, bfloat16, the in-place all-gather of the refresh
    (tp 2 -> 1), data parallelism and the disaggregated hand-over; three steps each, checkpoints written."""
    config = tmp_path / "run.yaml"
    config.write_text(f"run:\n  dtype: bfloat16\nparallel:\n  {layout}\n")
    out = tmp_path / "run"
    log = torchrun_train(config, settings(assets, out, steps=3), {})
    assert log.count("parallel layout:") == 1
    assert (out / "checkpoints" / "step_000003" / "rank_00001.pt").is_file()
