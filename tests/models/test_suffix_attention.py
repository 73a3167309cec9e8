"""The causal suffix attention (``models.attention.causal_shared_prefix_attention``) against the dense
reference (``shared_prefix_attention``) at the attention call itself, in float64 on the CPU: outputs and
the gradients of the queries, the responses' own keys and values and the boundary keys and values, for
groups of different prompt lengths (the boundary zero-padded to the longest, as ``merge_prefixes``
pads it), grouped-query heads, one and several suffix positions, and a softmax scale other than
1/√D. Also the backend choice and the plan's errors."""

from __future__ import annotations

import pytest
import torch

from rollplex.models.attention import (
    SuffixPlan,
    causal_shared_prefix_attention,
    shared_prefix_attention,
    suffix_plan,
)
from rollplex.models.forward import suffix_backend

N, H, HKV, D = 3, 6, 2, 8


def _inputs(prompt_lens: list[int], r: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(len(prompt_lens) * 10 + r)
    groups, p_max = len(prompt_lens), max(prompt_lens)
    x = {
        "query": torch.randn(groups * N, H, r, D, generator=g, dtype=torch.float64),
        "own_keys": torch.randn(groups * N, HKV, r, D, generator=g, dtype=torch.float64),
        "own_values": torch.randn(groups * N, HKV, r, D, generator=g, dtype=torch.float64),
        "boundary_keys": torch.randn(groups, HKV, p_max, D, generator=g, dtype=torch.float64),
        "boundary_values": torch.randn(groups, HKV, p_max, D, generator=g, dtype=torch.float64),
    }
    for name in ("boundary_keys", "boundary_values"):  # zero padding past each prompt, as merged
        for i, length in enumerate(prompt_lens):
            x[name][i, :, length:] = 0.0
    return {k: v.requires_grad_(True) for k, v in x.items()}


def _run(attention, x: dict[str, torch.Tensor], prompt_lens: list[int], scale: float) -> dict:
    plan = SuffixPlan(
        [x["boundary_keys"]],
        [x["boundary_values"]],
        torch.tensor(prompt_lens),
        N,
        host_prompt_lens=tuple(prompt_lens),
    )
    out = attention(x["query"], x["own_keys"], x["own_values"], plan, 0, scale)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), list(x.values()))
    return {"output": out.detach(), **dict(zip(x, grads))}


@pytest.mark.parametrize("prompt_lens", [[5], [3, 9], [9, 1, 4]])
@pytest.mark.parametrize("r", [1, 2, 7])
def test_causal_equals_the_dense_reference(prompt_lens, r):
    x = _inputs(prompt_lens, r)
    want = _run(shared_prefix_attention, x, prompt_lens, 0.3)
    got = _run(causal_shared_prefix_attention, x, prompt_lens, 0.3)
    for name, ref in want.items():
        assert (got[name] - ref).abs().max() <= 1e-12 * max(1.0, float(ref.abs().max())), name
    padding = [(i, length) for i, length in enumerate(prompt_lens) if length < max(prompt_lens)]
    for i, length in padding:  # no gradient reaches a padded boundary position
        assert not got["boundary_keys"][i, :, length:].any()


def test_the_scale_is_applied():
    """The scale reaches the kernel: 0.3 and the default 1/√D give different outputs."""
    x = _inputs([4, 6], 3)
    assert not torch.allclose(
        _run(causal_shared_prefix_attention, x, [4, 6], 0.3)["output"],
        _run(causal_shared_prefix_attention, x, [4, 6], D**-0.5)["output"],
    )


def test_host_lengths_must_cover_the_rows():
    x = _inputs([4, 6], 3)
    with pytest.raises(ValueError, match="1 host prompt lengths × 3 responses != 6 query rows"):
        _run(causal_shared_prefix_attention, x, [4], 0.3)


def test_a_plan_of_an_unknown_backend_is_refused():
    from types import SimpleNamespace

    prefix = SimpleNamespace(
        keys=[torch.zeros(1, 1, 2, 1)], values=[], prompt_lens=None, host_prompt_lens=(2,)
    )
    with pytest.raises(ValueError, match="suffix attention 'flash': expected one of"):
        suffix_plan(prefix, 1, 1, "flash")


def test_the_default_backend_by_device_and_dtype(monkeypatch):
    """causal where flash attention can take the activations (CUDA, bf16/fp16), masked SDPA on CUDA
    otherwise, the dense reference on the CPU; the environment variable overrides, and is checked
    (flex only on CUDA)."""
    monkeypatch.delenv("ROLLPLEX_SUFFIX_ATTENTION", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [suffix_backend(cuda, t) for t in (torch.bfloat16, torch.float16)] == ["causal", "causal"]
    assert [suffix_backend(cuda, t) for t in (torch.float32, torch.float64)] == ["sdpa", "sdpa"]
    assert suffix_backend(cpu, torch.bfloat16) == "dense"
    monkeypatch.setenv("ROLLPLEX_SUFFIX_ATTENTION", "causal")
    assert suffix_backend(cpu, torch.float64) == "causal"
    monkeypatch.setenv("ROLLPLEX_SUFFIX_ATTENTION", "flex")
    assert suffix_backend(cuda, torch.bfloat16) == "flex"
    with pytest.raises(ValueError, match="flex needs CUDA"):
        suffix_backend(cpu, torch.float32)
    monkeypatch.setenv("ROLLPLEX_SUFFIX_ATTENTION", "flash")
    with pytest.raises(ValueError, match="ROLLPLEX_SUFFIX_ATTENTION='flash'"):
        suffix_backend(cuda, torch.bfloat16)
