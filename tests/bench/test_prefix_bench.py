"""``rollplex bench prefix`` on the tiny preset (CPU smoke): both ways score the same log-probs."""

from __future__ import annotations

import json

import pytest
import torch

from rollplex.bench.prefix import VISION_ROWS, PrefixBenchConfig, run_prefix_bench
from rollplex.config import VISION_ATTENTION


def test_tiny_bench_runs_and_agrees(tmp_path):
    cfg = PrefixBenchConfig(
        preset="tiny",
        groups=2,
        group_size=3,
        response_tokens=6,
        text_tokens=20,
        grid=(2, 4, 4),
        suffix_group_sizes=(2, 3),
        dtype="float32",
    )
    result = run_prefix_bench(cfg, tmp_path / "out.json")
    assert set(result.rows) == {"reference", "actor"}
    assert result.logprob_agreement["max_abs"] <= 1e-5
    assert set(result.suffix_memory) == {"2", "3"}
    assert json.loads((tmp_path / "out.json").read_text())["prompt_tokens"] == 20 + 2 * 4 * 4 // 4


def test_vision_part_times_every_row(tmp_path):
    """Both attention modes, batched without the padded MLP, and batched compiled (VISION_ROWS)."""
    cfg = PrefixBenchConfig(
        preset="tiny", groups=2, group_size=2, response_tokens=4, text_tokens=12, grid=(2, 4, 4),
        dtype="float32", parts=("vision",),
    )  # fmt: skip
    result = run_prefix_bench(cfg, tmp_path / "out.json")
    assert {mode for mode, _, _ in VISION_ROWS.values()} == set(VISION_ATTENTION)
    assert {padding for _, padding, _ in VISION_ROWS.values()} == {True, False}
    assert {compiled for _, _, compiled in VISION_ROWS.values()} == {True, False}
    assert set(result.vision_attention) == {f"{r}/{m}" for r in ("reference", "actor") for m in VISION_ROWS}
    assert all(row["seconds"] > 0 for row in result.vision_attention.values())


def test_unknown_part_is_refused():
    with pytest.raises(ValueError, match="parts"):
        run_prefix_bench(PrefixBenchConfig(preset="tiny", parts=("compare", "visoin")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the guard is for machines without CUDA")
def test_large_workload_needs_a_gpu():
    with pytest.raises(ValueError, match="no CUDA device"):
        run_prefix_bench(PrefixBenchConfig())
