"""``rollplex bench decode`` on the tiny preset (CPU smoke) and the roofline byte count by hand."""

from __future__ import annotations

import pytest
import torch

from rollplex.bench.common import random_model
from rollplex.bench.decode import VARIANTS, DecodeBenchConfig, run_decode_bench, step_bytes
from rollplex.bench.variants import DEFAULT_VARIANTS


def _tiny(**changes) -> DecodeBenchConfig:
    """The tiny preset's CPU workload: 2 groups of 2 rows, 6 response tokens (4 eager), float32."""
    sizes = {"groups": 2, "group_size": 2, "response_tokens": 6, "text_tokens": 20, "eager_tokens": 4}
    return DecodeBenchConfig(preset="tiny", grid=(2, 4, 4), dtype="float32", **{**sizes, **changes})


def test_tiny_decode_bench_runs(tmp_path):
    pytest.importorskip("triton")  # the default variants include the Triton kernels (interpreted here)
    result = run_decode_bench(_tiny(), tmp_path / "decode.json")
    assert (
        set(result.rows)
        == set(DEFAULT_VARIANTS)
        == set(VARIANTS)
        - {
            "graphs+compile+triton+fused+sampling+autotune",
            "graphs+compile+triton+fused+sampling+gate+window128",
            "graphs+compile+triton+fused+sampling+gate+window512",
        }
    )
    assert (
        list(result.rows)[-1] == "graphs+compile+triton+fused+sampling+gate"
    )  # the profiled one: the CUDA default
    assert all(row["ms_per_step"] > 0 and row["setup_s"] > 0 for row in result.rows.values())
    assert (tmp_path / "decode.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton rows would run on this CUDA device")
def test_triton_rows_are_skipped_with_their_reason_where_triton_cannot_run(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = run_decode_bench(
        _tiny(groups=1, response_tokens=3, eager_tokens=3, variants=("eager", "graphs+triton"))
    )
    assert result.rows["eager"]["ms_per_step"] > 0
    assert result.rows["graphs+triton"] == {
        "skipped": "decode attention 'triton' runs on CUDA (or on the CPU under TRITON_INTERPRET=1)"
    }
    assert "failed" not in capsys.readouterr().out


def test_step_bytes_by_hand():
    """Weights of every layer + final norm + LM head, plus 2 (K, V) × layers × Hkv × D × bytes per
    cached token: prompts 10 and 20, 2 rows per group, own tokens averaged over 1..4 (2.5)."""
    model = random_model("tiny", torch.device("cpu"), torch.float32)
    lm, c = model.model.language_model, model.model.language_model.config
    weights = sum(p.numel() for p in lm.layers.parameters()) + c.hidden_size + model.lm_head.weight.numel()
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    expected = 4 * (weights + per_token * (10 + 20 + 2 * 2 * 2.5))
    assert step_bytes(model, [10, 20], 2, 4) == pytest.approx(expected)
