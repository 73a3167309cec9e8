"""Which decode attention ``auto`` picks: the fused kernel on CUDA where Triton imports and the kernel
supports the heads, else the dense path; unknown names are named."""

from __future__ import annotations

import shutil

import pytest
import torch

from rollplex.rollout import decode_kernel
from rollplex.rollout.decode import (
    DENSE_WINDOW,
    DecodeShape,
    SamplingParams,
    _check_attention,
    resolve_graph_window,
)

CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # a device object only: nothing runs on it


def _shape(heads=16, kv_heads=2, head_dim=128) -> DecodeShape:
    return DecodeShape(8, 8, heads, kv_heads, head_dim, 512, head_dim**-0.5, 1e-6)


def test_auto_is_dense_on_the_cpu():
    assert _check_attention("auto", CPU, _shape()) == "dense"


@pytest.mark.skipif(decode_kernel.triton is None, reason="needs Triton")
def test_auto_is_the_fused_kernel_on_cuda():
    assert _check_attention("auto", CUDA, _shape()) == "triton"


@pytest.mark.parametrize("heads", [(16, 2, 80), (12, 5, 128), (16, 2, 8)])
def test_auto_falls_back_to_dense_where_the_kernel_cannot_run(heads):
    """Head dim 80 (not a power of two), 12 heads over 5 kv heads, head dim 8 (< 16)."""
    assert _check_attention("auto", CUDA, _shape(*heads)) == "dense"


def test_auto_falls_back_to_dense_without_triton(monkeypatch):
    monkeypatch.setattr(decode_kernel, "triton", None)
    assert _check_attention("auto", CUDA, _shape()) == "dense"


def test_explicit_backends_and_unknown_names():
    assert _check_attention("dense", CUDA, _shape()) == "dense"
    with pytest.raises(ValueError, match="expected one of"):
        _check_attention("flash", CPU, _shape())


def test_graph_window_zero_is_the_attentions_own():
    """``rollout.graph_window: 0`` (the default): one own-key chunk of the fused kernel (512 keys), 128
    with the dense attention; a positive setting is kept as given; a negative one, or an attention not
    yet resolved from "auto", is refused."""
    assert resolve_graph_window(0, "triton") == decode_kernel.OWN_CHUNK == 512
    assert resolve_graph_window(0, "dense") == DENSE_WINDOW == 128
    assert resolve_graph_window(16, "triton") == resolve_graph_window(16, "dense") == 16
    with pytest.raises(ValueError, match="resolved attention"):
        resolve_graph_window(0, "auto")
    with pytest.raises(ValueError, match="window >= 0"):
        resolve_graph_window(-1, "dense")
    with pytest.raises(ValueError, match="decode graph window -1"):
        SamplingParams(1.0, 1.0, 0, 8, (1,), 0, torch.tensor([], dtype=torch.long), graph_window=-1)


def test_compile_modes_are_built_once_and_unknown_modes_named(monkeypatch):
    """Each torch.compile mode of the decode step is built once per process with its inductor mode
    ("max-autotune" without inductor's own CUDA graphs: the decoder captures the step itself), and
    max-autotune on copies of the layer functions with code objects of their own (dynamo's caches and
    recompile limit are per code object, so one mode's recompiles cannot push the other to eager)."""
    from rollplex.rollout import decode

    calls = []
    monkeypatch.setattr(decode, "_COMPILED", {})
    monkeypatch.setattr(decode.torch, "compile", lambda fn, **options: calls.append(options) or fn)
    tuned = decode._compiled_layer("max-autotune")
    assert decode._compiled_layer("max-autotune") is tuned
    count = len(decode.EAGER_LAYER_FNS)
    assert calls == [{"mode": "max-autotune-no-cudagraphs"}] * count
    for copy, original in zip(tuned, decode.EAGER_LAYER_FNS, strict=True):
        assert copy.__code__ is not original.__code__
        assert (
            copy.__code__.co_code == original.__code__.co_code and copy.__defaults__ == original.__defaults__
        )
    assert decode._compiled_layer("default") == decode.EAGER_LAYER_FNS
    assert calls[count:] == [{}] * count
    with pytest.raises(ValueError, match="expected one of"):
        decode._compiled_layer("reduce-overhead")


def test_the_max_autotune_copy_has_its_own_recompile_budget():
    """Dynamo counts recompiles per code object: with a limit of 1, ``layer_post`` compiled under a
    second backend falls back to eager, while its max-autotune copy (``_with_own_code``) compiles, and
    computes bitwise what the original does."""
    import torch._dynamo

    from rollplex.rollout import decode

    def counting_backend(graphs: list):
        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        return backend

    g = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    shape = DecodeShape(1, 2, 4, 2, 8, 16, 8**-0.5, 1e-6)
    weights = (rand(32), None, None, rand(32, 32), rand(32), (rand(48, 32), rand(48, 32)), rand(32, 48))
    hidden, attention = rand(2, 32), rand(2, 32)
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    copy = decode._with_own_code(decode.layer_post, "max-autotune")
    graphs = {"first": [], "second": [], "copy": []}
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch({limit: 1}):
            torch.compile(decode.layer_post, backend=counting_backend(graphs["first"]))(
                hidden, attention, weights, shape
            )
            torch.compile(decode.layer_post, backend=counting_backend(graphs["second"]))(
                hidden, attention, weights, shape
            )
            out = torch.compile(copy, backend=counting_backend(graphs["copy"]))(
                hidden, attention, weights, shape
            )
    finally:
        torch._dynamo.reset()
    if graphs["second"]:
        pytest.skip("this torch keeps a recompile budget per backend: nothing shared to separate")
    assert len(graphs["first"]) == 1 and len(graphs["copy"]) == 1
    assert copy.__qualname__ == "layer_post_max_autotune" and copy.__code__ is not decode.layer_post.__code__
    assert torch.equal(out, decode.layer_post(hidden, attention, weights, shape))


def test_unknown_compile_mode_fails_when_the_settings_are_made():
    from rollplex.rollout.decode import SamplingParams

    with pytest.raises(ValueError, match="compile mode 'fast'"):
        SamplingParams(1.0, 1.0, 0, 8, (1,), 0, torch.tensor([]), compile_mode="fast")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_residual_add_is_the_add_of_the_dtype_bitwise(dtype, monkeypatch):
    """The decode step's residual add as compiled (formed in float32, rounded once) equals the plain add
    in the model's dtype bit for bit, over magnitudes 1e-4..1e4 on both sides, where half-precision sums
    round. (For float32 and float64 both paths are the same add.)"""
    from rollplex.rollout.decode import residual_add

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-4, 4, 8192, dtype=torch.float64)
    a = (torch.randn(8192, generator=g, dtype=torch.float64) * scale).to(dtype)
    b = (torch.randn(8192, generator=g, dtype=torch.float64) * scale.flip(0)).to(dtype)
    out = residual_add(a, b)
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.equal(out, a + b)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_residual_add_matches_eager_bitwise():
    """Compiled by inductor, ``residual_add(h, x·Wᵀ)`` gives the eager bf16 result bit for bit."""
    from rollplex.rollout.decode import residual_add

    g = torch.Generator().manual_seed(1)
    h, x = (torch.randn(8, 64, generator=g) * 8).bfloat16(), torch.randn(8, 32, generator=g).bfloat16()
    w = torch.randn(64, 32, generator=g).bfloat16()
    step = torch.compile(lambda h, x, w: residual_add(h, torch.nn.functional.linear(x, w)))
    assert torch.equal(step(h, x, w), h + torch.nn.functional.linear(x, w))
