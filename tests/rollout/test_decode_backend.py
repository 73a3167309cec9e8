"""Which decode attention ``auto`` picks: the fused kernel on CUDA where Triton imports and the kernel
supports the heads, else the dense path; unknown names are named."""

from __future__ import annotations

import pytest
import torch

from rollplex.rollout import decode_kernel
from rollplex.rollout.decode import DecodeShape, _check_attention

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


def test_compile_modes_are_built_once_and_unknown_modes_named(monkeypatch):
    """Each torch.compile mode of the decode step is built once per process with its inductor mode
    ("max-autotune" without inductor's own CUDA graphs: the decoder captures the step itself)."""
    from rollplex.rollout import decode

    calls = []
    monkeypatch.setattr(decode, "_COMPILED", {})
    monkeypatch.setattr(decode.torch, "compile", lambda fn, **options: calls.append(options) or fn)
    assert decode._compiled_layer("max-autotune") == decode.EAGER_LAYER_FNS
    assert decode._compiled_layer("max-autotune") == decode.EAGER_LAYER_FNS
    assert calls == [{"mode": "max-autotune-no-cudagraphs"}] * 3
    decode._compiled_layer("default")
    assert calls[3:] == [{}] * 3
    with pytest.raises(ValueError, match="expected one of"):
        decode._compiled_layer("reduce-overhead")
