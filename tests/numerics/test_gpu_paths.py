"""GPU paths against the CPU-exact ones: fused suffix attention (causal, masked SDPA, flex_attention) and
bf16 rollout vs trainer.

Skipped without CUDA. Tolerances: fp32 fused vs dense ≤ 1e-4 abs on log-probs (TF32 off) and ≤ 1e-3
relative on gradients; bf16 causal suffix vs the float64 oracle: log-probs max |Δ| ≤ 0.05, mean ≤ 2e-3
(field case B01's reference point for bf16 suffix-vs-full agreement), gradient error ≤ 2 × masked
SDPA's + 1e-3; bf16 rollout-recorded vs trainer log-probs max |Δ| ≤ 0.1, mean ≤ 0.01.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rollplex.models.attention import SuffixAttention
from rollplex.models.forward import AUTO_SUFFIX_ATTENTION, prefix_forward, suffix_logprobs
from rollplex.rollout import decode
from rollplex.rollout.decode import GATE_MAX_ROWS
from rollplex.rollout.engine import SamplingParams, generate
from tests.numerics.conftest import BANNED, make_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
N, T = 4, 1.0


def _to(prompts, device, dtype):
    for p in prompts:
        for name in ("pixel_values", "pixel_values_videos"):
            value = getattr(p, name)
            if value is not None:
                setattr(p, name, value.to(device, dtype))
    return prompts


def _prompts(device, dtype):
    prompts = [
        make_prompt([4, 3], [("image", (1, 4, 6), 0.0)], seed=1),
        make_prompt([3, 2], [("video", (4, 4, 4), 0.5)], seed=2),
        make_prompt([12], [], seed=3),
    ]
    return _to(prompts, device, dtype)


def _score(model, prompts, responses, attached, attention=AUTO_SUFFIX_ATTENTION):
    prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=attached)
    return suffix_logprobs(
        model, prefix, responses, group_size=N, temperature=T, banned_ids=BANNED, attention=attention
    )[0]


def _scored_with(backend, model, prompts, responses, kernels="auto"):
    """``_score`` (attached) and its backward under the suffix attention ``backend`` (cascade with
    ``kernels``): the log-probs and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    lp = _score(model, prompts, responses, attached=True, attention=SuffixAttention(backend, kernels))
    _weighted(lp).backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _suffix_kernels(backend, model, prompts, responses, kernels="auto") -> set[str]:
    """The names of the CUDA kernels of one detached suffix pass under ``backend`` (cascade with
    ``kernels``; the prefix runs before the profile starts: its own attention runs flash attention too)."""
    from torch.profiler import ProfilerActivity, profile

    attention = SuffixAttention(backend, kernels)
    with torch.no_grad():
        prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            suffix_logprobs(
                model, prefix, responses, group_size=N, temperature=T, banned_ids=BANNED, attention=attention
            )
            torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


def _weighted(lp):
    """A loss that weights the rows differently: -1 .. 1 down the batch."""
    return (lp * torch.linspace(-1, 1, lp.shape[0], dtype=lp.dtype, device=lp.device)[:, None]).sum()


def _responses(count, length):
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, 150, (count, length), generator=g).cuda()


@pytest.mark.parametrize(
    ("backend", "length"),
    [("causal", 20), ("causal", 9), ("cascade", 20), ("cascade", 9), ("sdpa", 20), ("sdpa", 9), ("flex", 9)],
)
def test_fused_suffix_matches_dense(models, backend, length):
    """causal (the CUDA default in bf16/fp16), cascade (opt-in) and sdpa (the float32 default) at any
    length; flex (opt-in) at a length its compiled kernel accepts. In float32 flash attention does not
    run, so causal takes another SDPA kernel and cascade its plain-PyTorch parts (the next tests run
    flash attention and cuDNN's in bf16)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = copy.deepcopy(models[0]).float().cuda()
    prompts = _prompts("cuda", torch.float32)
    responses = _responses(len(prompts) * N, length)
    lp_d, g_d = _scored_with("dense", model, prompts, responses)
    lp_f, g_f = _scored_with(backend, model, prompts, responses)
    assert (lp_d - lp_f).abs().max() <= 1e-4
    for name, grad in g_d.items():
        rel = (grad - g_f[name]).norm() / grad.norm().clamp_min(1e-12)
        assert rel <= 1e-3, (name, float(rel))


def _errors_against_the_oracle(oracle, model, prompts, responses, backends, kernels="auto") -> dict:
    """Per suffix backend: (log-probs − the float64 oracle's, every parameter's gradient's relative L2
    error), of ``model`` (bf16, CUDA) scored attached and backpropagated as ``_scored_with`` does, the
    oracle being a copy of ``oracle`` (float64) on the CPU under the dense suffix; cascade with
    ``kernels``."""
    oracle = copy.deepcopy(oracle)
    oracle.zero_grad(set_to_none=True)
    dense = SuffixAttention("dense")
    want = _score(oracle, _prompts("cpu", torch.float64), responses.cpu(), attached=True, attention=dense)
    _weighted(want).backward()
    want_grad = torch.cat([p.grad.flatten() for p in oracle.parameters()])
    errors = {}
    for backend in backends:
        lp, grads = _scored_with(backend, model, prompts, responses, kernels)
        got = torch.cat([g.flatten() for g in grads.values()]).double().cpu()
        errors[backend] = (lp.double().cpu() - want.detach(), (got - want_grad).norm() / want_grad.norm())
    return errors


@pytest.mark.parametrize("kernels", ["cudnn,flash", "flash,flash"])
def test_cascade_suffix_in_bf16(models, kernels):
    """bf16 on CUDA: the cascade suffix pass launches its parts' kernels (cuDNN's for the boundary by
    default, flash attention's for the own keys), and its log-probs and gradients are as close to the
    float64 oracle (dense, on the CPU) as the causal backend's: log-probs within B01's bf16 reference
    (0.05 max, 2e-3 mean), the gradient's relative L2 error at most twice causal's, plus 1e-3."""
    model = _bf16_model(models[0])
    prompts = _prompts("cuda", torch.bfloat16)
    responses = _responses(len(prompts) * N, 20)
    names = _suffix_kernels("cascade", model, prompts, responses, kernels)
    assert any("pytorch_flash" in k for k in names), names  # the own part, in either setting
    assert any("cudnn" in k.lower() for k in names) == kernels.startswith("cudnn"), names
    errors = _errors_against_the_oracle(models[0], model, prompts, responses, ("cascade", "causal"), kernels)
    diff, rel = errors["cascade"]
    print(f"cascade ({kernels}) vs float64: log-probs max {float(diff.abs().max()):.3g}, gradient {float(rel):.3g};"
          f" causal: gradient {float(errors['causal'][1]):.3g}")  # fmt: skip
    assert diff.abs().max() <= 0.05 and diff.abs().mean() <= 2e-3
    assert rel <= 2 * errors["causal"][1] + 1e-3


def test_causal_suffix_runs_flash_attention_in_bf16(models):
    """bf16 on CUDA: the causal suffix pass launches flash attention's kernels (``pytorch_flash``) and
    masked SDPA's does not, and causal's log-probs and gradients are as close to the float64 oracle
    (dense, on the CPU) as masked SDPA's: log-probs within B01's bf16 reference (0.05 max, 2e-3 mean),
    and the gradient's relative L2 error at most twice masked SDPA's, plus 1e-3."""
    model = _bf16_model(models[0])
    prompts = _prompts("cuda", torch.bfloat16)
    responses = _responses(len(prompts) * N, 20)
    flash = {
        b: any("pytorch_flash" in k for k in _suffix_kernels(b, model, prompts, responses))
        for b in ("causal", "sdpa")
    }
    assert flash == {"causal": True, "sdpa": False}
    errors = _errors_against_the_oracle(models[0], model, prompts, responses, ("causal", "sdpa"))
    diff, rel = errors["causal"]
    print(f"causal vs float64: log-probs max {float(diff.abs().max()):.3g}, gradient {float(rel):.3g}")
    print(f"sdpa vs float64: gradient {float(errors['sdpa'][1]):.3g}")
    assert diff.abs().max() <= 0.05 and diff.abs().mean() <= 2e-3
    assert rel <= 2 * errors["sdpa"][1] + 1e-3


def _bf16_model(model):
    """A bf16 CUDA copy with transformers' own RMSNorm (the float64 fixture patches it to be exact)."""
    model = copy.deepcopy(model).to(torch.bfloat16).cuda()
    for module in model.modules():
        module.__dict__.pop("forward", None)
    return model


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _bf16_rollout(model, prompts, generator=None, **decode):
    decode = {"max_tokens": 40, "graph_window": 16, **decode}
    params = SamplingParams(T, 1.0, 0, decode.pop("max_tokens"), (1,), 2, BANNED, **decode)
    prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=False)
    return generate(
        model,
        prompts,
        prefix,
        group_size=N,
        params=params,
        tokenizer=_Tok(),
        generator=generator if generator is not None else torch.Generator(device="cuda").manual_seed(0),
    )


def _spy_gate(monkeypatch) -> list[bool]:
    """What ``decode.fused_gate_runs`` answers each time a decoder asks (only with fused_gate and fused
    projections on): the gated kernel is on where it answers True (12 rows, within its limit)."""
    seen, real = [], decode.fused_gate_runs
    monkeypatch.setattr(decode, "fused_gate_runs", lambda device: seen.append(real(device)) or seen[-1])
    return seen


@pytest.mark.parametrize(
    ("compile", "attention", "fused", "sampling", "gate"),
    [
        (False, "dense", False, False, False),
        (True, "dense", False, False, False),
        (False, "triton", False, False, False),
        (True, "triton", False, False, False),
        (True, "triton", True, False, False),
        (True, "triton", True, True, False),
        (True, "triton", True, True, True),
        (False, "triton", True, True, True),
        ("max-autotune", "triton", True, True, False),
    ],
)
def test_bf16_rollout_vs_trainer_logprobs(models, compile, attention, fused, sampling, gate, monkeypatch):
    """bf16: the captured (optionally compiled — a string is the torch.compile mode —, with the fused
    Triton attention, with fused q/k/v and gate/up products, with the fused sampling race, with the
    gate/up product and SiLU gate as one Triton kernel) decode steps
    record log-probs within 0.1 (max) and 0.01 (mean) of the trainer's prefix + suffix path, over 40
    tokens in three own-key windows."""
    model = _bf16_model(models[0])
    prompts = _prompts("cuda", torch.bfloat16)
    asked = _spy_gate(monkeypatch)
    batch = _bf16_rollout(
        model,
        prompts,
        cuda_graphs=True,
        compile=bool(compile),
        compile_mode=compile if isinstance(compile, str) else "default",
        attention=attention,
        fused_projections=fused,
        fused_sampling=sampling,
        fused_gate=gate,
    )
    assert asked == ([True] if gate else []) and batch.responses.shape[0] <= GATE_MAX_ROWS
    trainer = _score(model, prompts, batch.responses, attached=True).detach()
    diff = (trainer - batch.logprobs).abs()[batch.response_mask()]
    print(
        f"bf16 rollout (compile={compile}, {attention}, fused={fused}) vs trainer |dlogp|: "
        f"max {float(diff.max()):.4g} mean {float(diff.mean()):.4g}"
    )
    assert float(diff.max()) <= 0.1 and float(diff.mean()) <= 0.01


def test_one_graph_per_own_key_chunk_gives_the_same_rollout(models, monkeypatch):
    """With the fused attention the default window is one own-key chunk: the 199 decode steps of a
    200-token budget replay one graph (window 199, the cache's length) where 128-token windows, the
    earlier default, capture two (128, 199), and the rollout is bitwise theirs."""
    from rollplex.rollout.decode import StaticDecoder

    captured, capture_on = [], StaticDecoder._capture_on

    def spy(self, warm, current, lengths):
        captured.append(lengths)
        return capture_on(self, warm, current, lengths)

    monkeypatch.setattr(StaticDecoder, "_capture_on", spy)
    model = _bf16_model(models[0])
    prompts = _prompts("cuda", torch.bfloat16)
    gens = [torch.Generator(device="cuda").manual_seed(0) for _ in range(2)]
    options = {"max_tokens": 200, "attention": "triton", "cuda_graphs": True, "compile": True}
    default = _bf16_rollout(model, prompts, gens[0], graph_window=0, fused_projections=True, **options)
    fine = _bf16_rollout(model, prompts, gens[1], graph_window=128, fused_projections=True, **options)
    assert captured == [[199], [128, 199]]
    assert default.setup_s > 0 and fine.setup_s > 0
    assert torch.equal(default.responses, fine.responses)
    assert torch.equal(default.logprobs, fine.logprobs)


@pytest.mark.parametrize(
    ("attention", "sampling", "gate"),
    [("dense", False, False), ("triton", False, False), ("triton", True, False), ("triton", True, True)],
)
def test_graph_replay_equals_eager_decode(models, attention, sampling, gate, monkeypatch):
    """CUDA-graph replay runs the same kernels as the eager steps, sampling with the generator
    registered with the graphs included (and with the gated gate/up kernel): bitwise the same
    rollout, and the generator ends in the same state (39 steps: rounds of 16, 16 and 7)."""
    model = _bf16_model(models[0])
    prompts = _prompts("cuda", torch.bfloat16)
    gens = [torch.Generator(device="cuda").manual_seed(0) for _ in range(2)]
    options = {
        "attention": attention,
        "fused_sampling": sampling,
        "fused_projections": gate,
        "fused_gate": gate,
    }
    asked = _spy_gate(monkeypatch)
    graphed = _bf16_rollout(model, prompts, gens[0], cuda_graphs=True, **options)
    eager = _bf16_rollout(model, prompts, gens[1], cuda_graphs=False, **options)
    assert asked == ([True, True] if gate else [])
    assert torch.equal(gens[0].get_state(), gens[1].get_state())
    assert torch.equal(graphed.responses, eager.responses)
    assert torch.equal(graphed.logprobs, eager.logprobs)


def test_batched_vision_attention_bf16(models, monkeypatch):
    """bf16 on CUDA: the batched vision attention gives the vision tower's output within bf16 rounding
    of transformers' per-window loop (same kernels, batched), gradients included; this transformers
    version hands the window boundaries over: the window and the frame boundaries, each read once
    (``chunk_plan``), whatever the number of blocks."""
    from rollplex.models.forward import prepare_model
    from tests.models.test_vision_attention import spy_batching

    reference = _bf16_model(models[0])
    prepare_model(reference, vision_attention="per_chunk")
    batched = copy.deepcopy(reference)
    prepare_model(batched, vision_attention="batched")
    grid = torch.tensor([[4, 12, 20]], device="cuda")
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
    counts = spy_batching(monkeypatch)
    outs, grads = [], []
    for model in (reference, batched):
        px = pixels.clone().requires_grad_(True)
        out = model.model.visual(px, grid_thw=grid).pooler_output.float()
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), px)[0].float())
    scale = float(outs[0].abs().max())
    print(f"batched vs per-window vision: max {float((outs[0] - outs[1]).abs().max()):.3g} of {scale:.3g}")
    assert counts["reads"] == 2 and counts["sdpa"] == counts["buckets"]
    assert float((outs[0] - outs[1]).abs().max()) <= 2e-2 * scale
    assert float((grads[0] - grads[1]).abs().max()) <= 2e-2 * float(grads[0].abs().max())
