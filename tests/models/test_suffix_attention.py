"""The causal and cascade suffix attentions (``models.attention.causal_shared_prefix_attention``,
``cascade_shared_prefix_attention`` with its plain-PyTorch kernels) against the dense reference
(``shared_prefix_attention``: one softmax over the concatenated scores, autograd's gradients) at the
attention call itself, in float64 on the CPU: outputs and
the gradients of the queries, the responses' own keys and values and the boundary keys and values, for
groups of different prompt lengths (the boundary zero-padded to the longest, as ``merge_prefixes``
pads it), grouped-query heads, one and several suffix positions, and a softmax scale other than
1/√D. Also the backend choice and the plan's errors."""

from __future__ import annotations

import pytest
import torch

from rollplex.models.attention import (
    SuffixPlan,
    cascade_kernels,
    cascade_shared_prefix_attention,
    causal_shared_prefix_attention,
    shared_prefix_attention,
    suffix_plan,
)
from rollplex.models.forward import suffix_backend
from tests.numerics.conftest import make_prompt, tiny_config

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


def _plan(x: dict[str, torch.Tensor], prompt_lens: list[int]) -> SuffixPlan:
    """A one-layer plan over ``x``'s boundary keys and values, for groups of ``prompt_lens``."""
    return SuffixPlan(
        [x["boundary_keys"]],
        [x["boundary_values"]],
        torch.tensor(prompt_lens),
        N,
        host_prompt_lens=tuple(prompt_lens),
    )


def _run(attention, x: dict[str, torch.Tensor], prompt_lens: list[int], scale: float) -> dict:
    plan = _plan(x, prompt_lens)
    out = attention(x["query"], x["own_keys"], x["own_values"], plan, 0, scale)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), list(x.values()))
    return {"output": out.detach(), **dict(zip(x, grads))}


FAST = pytest.mark.parametrize(
    "attention", [causal_shared_prefix_attention, cascade_shared_prefix_attention], ids=["causal", "cascade"]
)


@FAST
@pytest.mark.parametrize("prompt_lens", [[5], [3, 9], [9, 1, 4]])
@pytest.mark.parametrize("r", [1, 2, 7])
def test_equals_the_dense_reference(attention, prompt_lens, r):
    x = _inputs(prompt_lens, r)
    want = _run(shared_prefix_attention, x, prompt_lens, 0.3)
    got = _run(attention, x, prompt_lens, 0.3)
    for name, ref in want.items():
        assert (got[name] - ref).abs().max() <= 1e-12 * max(1.0, float(ref.abs().max())), name
    padding = [(i, length) for i, length in enumerate(prompt_lens) if length < max(prompt_lens)]
    for i, length in padding:  # no gradient reaches a padded boundary position
        assert not got["boundary_keys"][i, :, length:].any()
        assert not got["boundary_values"][i, :, length:].any()


@FAST
def test_the_scale_is_applied(attention):
    """The scale reaches the kernel: 0.3 and the default 1/√D give different outputs, and None is
    1/√D."""
    x = _inputs([4, 6], 3)
    default = _run(attention, x, [4, 6], D**-0.5)["output"]
    assert not torch.allclose(_run(attention, x, [4, 6], 0.3)["output"], default)
    assert torch.allclose(_run(attention, x, [4, 6], None)["output"], default, rtol=0, atol=1e-12)


@FAST
def test_host_lengths_must_cover_the_rows(attention):
    x = _inputs([4, 6], 3)
    with pytest.raises(ValueError, match="1 host prompt lengths × 3 responses != 6 query rows"):
        _run(attention, x, [4], 0.3)


def test_a_plan_of_an_unknown_backend_is_refused():
    from types import SimpleNamespace

    prefix = SimpleNamespace(
        keys=[torch.zeros(1, 1, 2, 1)], values=[], prompt_lens=None, host_prompt_lens=(2,)
    )
    with pytest.raises(ValueError, match="suffix attention 'flash': expected one of"):
        suffix_plan(prefix, 1, 1, "flash")


def test_the_default_backend_by_device_and_dtype():
    """causal where flash attention can take the activations (CUDA, bf16/fp16), masked SDPA on CUDA
    otherwise, the dense reference on the CPU; a named backend (model.suffix_attention) overrides
    (cascade is opt-in), and is checked (flex only on CUDA)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [suffix_backend(cuda, t) for t in (torch.bfloat16, torch.float16)] == ["causal", "causal"]
    assert [suffix_backend(cuda, t) for t in (torch.float32, torch.float64)] == ["sdpa", "sdpa"]
    assert suffix_backend(cpu, torch.bfloat16) == "dense"
    assert suffix_backend(cpu, torch.bfloat16, "auto") == "dense"
    assert suffix_backend(cpu, torch.float64, "causal") == "causal"
    assert suffix_backend(cuda, torch.bfloat16, "cascade") == "cascade"
    assert suffix_backend(cuda, torch.bfloat16, "flex") == "flex"
    with pytest.raises(ValueError, match="flex needs CUDA"):
        suffix_backend(cpu, torch.float32, "flex")
    with pytest.raises(ValueError, match="model.suffix_attention='flash'"):
        suffix_backend(cuda, torch.bfloat16, "flash")


def test_cascade_kernels_by_device_dtype_and_determinism(monkeypatch):
    """cuDNN for the boundary and flash for the own keys on CUDA in bf16/fp16, flash for both under
    deterministic algorithms, the plain-PyTorch parts elsewhere; named kernels (model.cascade_kernels)
    override, and are checked."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def names(device, dtype, kernels="auto"):
        return [k.name for k in cascade_kernels(device, dtype, kernels)]

    assert names(cuda, torch.bfloat16) == names(cuda, torch.float16) == ["cudnn", "flash"]
    assert names(cuda, torch.float32) == names(cpu, torch.bfloat16) == ["math", "math"]
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert names(cuda, torch.bfloat16) == ["flash", "flash"]
    assert names(cuda, torch.bfloat16, "math,cudnn") == ["math", "cudnn"]
    for bad in ("cudnn", "cudnn,flash,math", "cudnn,xformers"):
        with pytest.raises(ValueError, match="model.cascade_kernels=.*expected auto or BOUNDARY,OWN"):
            cascade_kernels(cuda, torch.bfloat16, bad)


def test_a_suffix_pass_runs_the_kernels_its_settings_name(monkeypatch):
    """``suffix_logprobs`` takes its backend and cascade kernels from its ``attention`` argument, and
    the cascade attention runs the kernels it names (here the plain-PyTorch parts, recorded)."""
    import rollplex.models.attention as attention
    import rollplex.models.forward as forward

    seen = []
    real = attention.cascade_kernels
    monkeypatch.setattr(attention, "cascade_kernels", lambda *args: seen.append(args[2:]) or real(*args))
    plans = []
    real_plan = forward.suffix_plan
    monkeypatch.setattr(forward, "suffix_plan", lambda *args: plans.append(args[3:]) or real_plan(*args))
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config()).double()
    forward.prepare_model(model)
    prompt = make_prompt([3, 2], [], seed=1)
    banned = torch.zeros(0, dtype=torch.int64)
    prefix = forward.prefix_forward(model, [prompt], temperature=1.0, banned_ids=banned, attached=False)
    settings = attention.SuffixAttention("cascade", "math,math")
    with torch.no_grad():
        forward.suffix_logprobs(
            model, prefix, torch.tensor([[5, 6, 7]]), group_size=1, temperature=1.0, banned_ids=banned,
            attention=settings,
        )  # fmt: skip
        forward.suffix_logprobs(
            model, prefix, torch.tensor([[5, 6, 7]]), group_size=1, temperature=1.0, banned_ids=banned
        )
    assert plans == [("cascade", "math,math"), ("dense", "auto")]
    assert seen and set(seen) == {("math,math",)}


def test_the_merge_falls_back_to_eager_after_a_compile_error(monkeypatch, caplog):
    """On CUDA the merge runs compiled; where compiling fails, that call and every later one run the
    eager merge (same result), after one warning."""
    import torch._dynamo.exc

    import rollplex.models.attention as attention

    calls = []

    def failing(*args):
        calls.append(1)
        failed = torch._dynamo.exc.BackendCompilerFailed  # its constructor differs between releases
        err = failed.__new__(failed)
        Exception.__init__(err, "no C compiler")
        raise err

    monkeypatch.setattr(attention, "_MERGE", {})
    monkeypatch.setattr(attention, "compile_fallback", lambda: None)  # whatever earlier tests left
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: failing)
    cuda = torch.device("cuda")
    args = (torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4), torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4))
    with caplog.at_level("WARNING", logger="rollplex"):
        first = attention._merge_on(cuda)(*args)
        second = attention._merge_on(cuda)(*args)
    want = attention._merge(*args)
    assert all(torch.equal(a, b) for got in (first, second) for a, b in zip(got, want))
    assert len(calls) == 1 and attention._merge_on(cuda) is attention._merge
    warned = [r.getMessage() for r in caplog.records if "merge runs uncompiled" in r.getMessage()]
    assert len(warned) == 1 and "no C compiler" in warned[0], warned


def test_the_merge_is_the_softmax_over_both_key_sets():
    """By hand: out_a = 1, lse_a = log 3 and out_b = 4, lse_b = log 1 give weights 3/4 and 1/4: out =
    1.75 and lse = log 4."""
    from rollplex.models.attention import _merge

    full = (1, 1, 1)
    out, lse = _merge(
        torch.ones(*full, 1),
        torch.full(full, 3.0).log(),
        torch.full((*full, 1), 4.0),
        torch.zeros(full),
    )
    assert torch.allclose(out, torch.tensor(1.75)) and torch.allclose(lse, torch.tensor(4.0).log())


def test_cascade_with_a_detached_boundary():
    """The reference's boundary does not require grad: the cascade backward leaves it without a
    gradient, and the other gradients are the dense reference's."""
    x = _inputs([3, 9], 4)
    for name in ("boundary_keys", "boundary_values"):
        x[name] = x[name].detach()
    plan = _plan(x, [3, 9])
    leaves = [x["query"], x["own_keys"], x["own_values"]]
    out = cascade_shared_prefix_attention(*leaves, plan, 0, 0.3)
    got = torch.autograd.grad(out.sum(), leaves, retain_graph=True)
    want = torch.autograd.grad(shared_prefix_attention(*leaves, plan, 0, 0.3).sum(), leaves)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(got, want))
    node = out.grad_fn.next_functions[0][0]  # the cascade Function's own node (out is its transpose)
    returned = node.apply(torch.ones(out.transpose(1, 2).shape, dtype=out.dtype))
    assert returned[3] is None and returned[4] is None  # no boundary gradient computed


def test_the_cascade_backward_is_not_differentiated_twice():
    """A second-order gradient through the cascade attention is refused rather than wrong."""
    x = _inputs([4], 2)
    plan = _plan(x, [4])
    out = cascade_shared_prefix_attention(x["query"], x["own_keys"], x["own_values"], plan, 0, 0.3)
    (dq,) = torch.autograd.grad(out.square().sum(), [x["query"]], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|marked with @once_differentiable"):
        dq.sum().backward()
