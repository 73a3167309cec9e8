"""torch's deterministic algorithms for a whole process (``run.deterministic``), for training and benchmarks."""

from __future__ import annotations

import os

import torch

# CUBLAS_WORKSPACE_CONFIG for deterministic cuBLAS (torch's reproducibility notes)
CUBLAS_WORKSPACE = ":4096:8"


def use_deterministic_algorithms() -> None:
    """torch's deterministic algorithms for the rest of the process (``run.deterministic``): kernels
    that accumulate with atomics (attention backward, ``index_add_``) are replaced by deterministic ones
    or raise. Call before the first CUDA matrix product: cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` (set
    here to ``:4096:8`` unless already set) when the process creates its handle."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # torch refuses determinism without it
    torch.use_deterministic_algorithms(True)
