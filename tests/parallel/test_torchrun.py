"""The start-up path under a real ``torchrun --nproc-per-node 2`` (tests/parallel/torchrun_check.py): on
the CPU with gloo and float32, and where two GPUs exist with NCCL and bfloat16 (NCCL's in-place
all-gather of the refresh, bf16 collectives, which gloo cannot run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("torchrun_check.py")


def _torchrun(extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra_env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)


def _check(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    # the two ranks share one stdout, so their lines may interleave: each must be there once
    assert [done.stdout.count(f"rank {r} ok") for r in range(2)] == [1, 1], done.stdout


def test_torchrun_on_the_cpu():
    _check(_torchrun({"CUDA_VISIBLE_DEVICES": ""}))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_torchrun_on_two_gpus():
    _check(_torchrun({}))
