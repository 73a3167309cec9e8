"""Regional compilation of the layers (models.compiled) against the eager modules.

CPU: the ``aot_eager`` backend (traced, run by the eager kernels) checks the wiring in float64, for
both scopes (whole layers, and their parts): which modules run compiled, that the graphs do not grow
with calls or layers, log-probs bitwise, gradients through activation checkpointing, a deep copy
running its own weights, switching scope and off, and following the vision MLP's class. CUDA (skipped
without it): inductor's fused kernels against the eager model's full-sequence forward (the oracle),
float64 and bf16.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from rollplex.models import compiled as compiled_module
from rollplex.models.attention import ATTENTION_NAME, VISION_ATTENTION_NAME
from rollplex.models.compiled import (
    compiled_scope,
    compiles_layers,
    layers_compiled,
    set_layer_compilation,
)
from rollplex.models.forward import enable_checkpointing, prefix_forward, prepare_model, suffix_logprobs
from rollplex.models.vision_mlp import PaddedVisionMLP
from tests.numerics.conftest import BANNED, make_prompt, tiny_config
from tests.numerics.test_gpu_paths import _to

N, T = 3, 0.7
TEXT_LAYERS, VISION_BLOCKS = 3, 3


def _model(dtype=torch.float64, text_layers=TEXT_LAYERS, vision_blocks=VISION_BLOCKS):
    """A tiny Qwen2.5-VL with several layers per compiled function, random weights, checkpointing on."""
    config = tiny_config().to_dict()
    config["text_config"]["num_hidden_layers"] = text_layers
    config["text_config"].pop("layer_types", None)
    config["vision_config"]["depth"] = vision_blocks
    config["vision_config"]["fullatt_block_indexes"] = [2]
    config = Qwen2_5_VLConfig(**config)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    prepare_model(model)
    enable_checkpointing(model)
    return model


def _batch(device="cpu", dtype=torch.float64):
    prompts = _to(
        [
            make_prompt([4, 3], [("image", (1, 4, 6), 0.0)], seed=1),
            make_prompt([3, 2], [("video", (4, 4, 4), 0.5)], seed=2),
        ],
        device,
        dtype,
    )
    responses = torch.randint(3, 150, (len(prompts) * N, 5), generator=torch.Generator().manual_seed(5))
    return prompts, responses.to(device)


def _score(model, prompts, responses, attached: bool) -> torch.Tensor:
    prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=attached)
    return suffix_logprobs(model, prefix, responses, group_size=N, temperature=T, banned_ids=BANNED)[0]


def _run(model, prompts, responses):
    """(detached log-probs, attached log-probs, gradients of a weighted sum of the attached ones)."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        detached = _score(model, prompts, responses, attached=False)
    attached = _score(model, prompts, responses, attached=True)
    weights = torch.linspace(-1.0, 1.5, attached.numel(), dtype=attached.dtype, device=attached.device)
    (attached.flatten() * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return detached, attached.detach(), grads


def _compiled_modules(model) -> list:
    return [m for m in model.modules() if "forward" in vars(m)]


def _graph_calls_per_layer(model, calls: list, prompts, responses, attached: bool) -> list[int]:
    """How many compiled graphs each text layer's forward called in one scoring pass, layer by layer
    (``calls``: a list the compiled graphs append to as they run)."""
    counted = []
    for layer in model.model.language_model.layers:
        layer.register_forward_pre_hook(lambda *_: calls.clear())
        layer.register_forward_hook(lambda *_: counted.append(len(calls)))
    with torch.set_grad_enabled(attached):
        _score(model, prompts, responses, attached=attached)
    return counted


@pytest.mark.parametrize(("scope", "modules"), [("layer", 1), ("parts", 4)])
def test_compiled_layers_trace_the_same_arithmetic(caplog, scope, modules):
    """Every compiled function really compiles and every layer runs compiled (graphs counted), the
    number of graphs is bounded: a second identical pass compiles nothing, nor does a deeper model of
    the same architecture (one set of graphs shared by every layer); the variants of a function (for
    the RMSNorm: rank, batch, grad mode, prefix or suffix pass; more than torch's default limit of 8)
    fit the raised recompile limit; and the numbers are the eager ones. How many graphs a layer splits
    into around its opaque attention call is torch's business (it differs between releases): only
    that every layer calls the same ones, with and without gradients, is asserted."""
    graphs, calls = [], []

    def counting(gm, inputs):
        graphs.append(gm)
        compiled = lookup_backend("aot_eager")(gm, inputs)
        return lambda *args: calls.append(1) or compiled(*args)

    eager = _model()
    compiled = copy.deepcopy(eager)
    total = modules * (TEXT_LAYERS + VISION_BLOCKS)
    assert set_layer_compilation(compiled, True, backend=counting, scope=scope) == total
    assert compiled_scope(compiled) == scope and layers_compiled(compiled) and not layers_compiled(eager)
    prompts, responses = _batch()
    want = _run(eager, prompts, responses)
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        got = _run(compiled, prompts, responses)
        first = len(graphs)
        again = _run(compiled, prompts, responses)
        assert first > 0 and len(graphs) == first  # the second pass is served from the compile cache
        deeper = _model(text_layers=TEXT_LAYERS + 2, vision_blocks=VISION_BLOCKS + 2)
        set_layer_compilation(deeper, True, backend=counting, scope=scope)
        _run(deeper, prompts, responses)
        assert len(graphs) == first  # more layers, the same graphs
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]
    # With gradients, the layers run under activation checkpointing (also where the transformers release
    # checkpoints inside the layer's forward).
    for attached in (False, True):
        counted = _graph_calls_per_layer(compiled, calls, prompts, responses, attached)
        assert len(counted) >= TEXT_LAYERS and len(set(counted)) == 1 and counted[0] > 0, counted
    for result in (got, again):
        assert torch.equal(result[0], want[0]) and torch.equal(result[1], want[1])
        assert result[2].keys() == want[2].keys()
    assert any(name.startswith("model.visual.blocks.0.mlp") for name in want[2])
    for name, grad in want[2].items():  # traced backward formulas may sum in another order
        assert float((got[2][name] - grad).norm() / grad.norm()) <= 1e-12, name


def test_attention_functions_are_opaque_to_torch_compile():
    """Their plans hold Python state: traced into a compiled graph they would be baked in."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    prepare_model(_model())
    for name in (ATTENTION_NAME, VISION_ATTENTION_NAME):
        assert getattr(ALL_ATTENTION_FUNCTIONS[name], "_torchdynamo_disable", False), name


def test_layers_compile_on_cuda_only():
    assert compiles_layers(True, torch.device("cuda"))
    assert not compiles_layers(True, torch.device("cpu"))
    assert not compiles_layers(False, torch.device("cuda"))


def test_deep_copy_runs_its_own_weights():
    """The compiled forwards are bound methods: a copy's modules call themselves, not the original's."""
    original = _model()
    set_layer_compilation(original, True, backend="aot_eager")
    clone = copy.deepcopy(original)
    assert all(m.forward.__self__ is m for m in _compiled_modules(clone))
    reference = copy.deepcopy(original)
    set_layer_compilation(reference, False)
    with torch.no_grad():
        for model in (clone, reference):
            for p in model.parameters():
                p.mul_(1.25)
    prompts, responses = _batch()
    with torch.no_grad():
        got = _score(clone, prompts, responses, attached=False)
        want = _score(reference, prompts, responses, attached=False)
        before = _score(original, prompts, responses, attached=False)
    assert torch.equal(got, want)
    assert not torch.equal(got, before)


def test_switching_scope_and_off_and_following_the_mlp_class():
    model = _model()
    block = model.model.visual.blocks[0]
    prepare_model(model, compile_layers=True)  # whole layers by default
    assert compiled_scope(model) == "layer"
    assert block.forward.__func__.eager is type(block).forward
    prepare_model(model, vision_attention="per_chunk")  # None: stays compiled, in its scope
    assert compiled_scope(model) == "layer"
    with pytest.raises(ValueError, match="compile scope 'whole'"):
        prepare_model(model, vision_attention="batched", compile_scope="whole")
    assert compiled_scope(model) == "layer"  # nothing changed
    assert model.model.visual.config._attn_implementation != VISION_ATTENTION_NAME
    prepare_model(model, compile_scope="parts")  # stays on, in the other scope
    assert compiled_scope(model) == "parts" and "forward" not in vars(block)
    mlp = block.mlp
    assert type(mlp) is PaddedVisionMLP
    assert mlp.forward.__func__.eager is PaddedVisionMLP.forward
    prepare_model(model, vision_mlp_padding=False, compile_layers=True)
    assert mlp.forward.__func__.eager is type(mlp).forward
    assert type(mlp) is not PaddedVisionMLP and compiled_scope(model) == "parts"
    prepare_model(model, compile_scope="layer")
    assert compiled_scope(model) == "layer" and "forward" not in vars(mlp)
    assert len(_compiled_modules(model)) == TEXT_LAYERS + VISION_BLOCKS
    prepare_model(model, compile_layers=False)
    assert not _compiled_modules(model) and not layers_compiled(model)


@pytest.mark.parametrize("compile_layers", [False, None])
def test_a_bad_scope_changes_nothing_on_an_uncompiled_model(compile_layers):
    model = _model()
    set_layer_compilation(model, False)
    block = model.model.visual.blocks[0]
    before = (model.model.visual.config._attn_implementation, type(block.mlp))
    with pytest.raises(ValueError, match="compile scope 'whole'"):
        prepare_model(
            model,
            vision_attention="per_chunk",
            vision_mlp_padding=False,
            compile_layers=compile_layers,
            compile_scope="whole",
        )
    assert (model.model.visual.config._attn_implementation, type(block.mlp)) == before
    assert not _compiled_modules(model)


def test_a_layer_that_fails_to_compile_runs_uncompiled_with_one_warning(monkeypatch, caplog):
    """Where torch.compile cannot build kernels (here a backend that raises, as inductor does without a
    C compiler), the first failure is named in one warning and every compiled layer runs its own
    forward from then on: the same numbers as the eager model, and no second attempt."""
    monkeypatch.setattr(compiled_module, "_STATE", compiled_module._CompileState())
    attempts = []

    def failing(gm, inputs):
        attempts.append(1)
        raise RuntimeError("no working C compiler found\nsecond line")

    eager = _model()
    model = copy.deepcopy(eager)
    set_layer_compilation(model, True, backend=failing)
    prompts, responses = _batch()
    with caplog.at_level(logging.WARNING, logger="rollplex"):
        got = _run(model, prompts, responses)
        again = _run(model, prompts, responses)
    want = _run(eager, prompts, responses)
    assert attempts == [1] and compiled_scope(model) == "layer"
    assert compiled_module.compile_fallback() == "RuntimeError: no working C compiler found"
    warned = [r.getMessage() for r in caplog.records if "compiling the layers failed" in r.getMessage()]
    assert len(warned) == 1 and "model.compile_layers: false" in warned[0]
    for result in (got, again):
        assert torch.equal(result[0], want[0]) and torch.equal(result[1], want[1])
        assert all(torch.equal(result[2][name], grad) for name, grad in want[2].items())


def test_a_compile_failure_after_compiled_calls_is_raised(monkeypatch):
    """Once a compiled layer call has succeeded, a failure to compile another variant is not the
    machine: it is raised (running that layer uncompiled could break activation checkpointing, whose
    recomputation must save what the compiled forward saved)."""
    monkeypatch.setattr(compiled_module, "_STATE", compiled_module._CompileState())
    graphs = []

    def fails_after_the_first_graphs(gm, inputs):
        graphs.append(gm)
        if len(graphs) > 2:
            raise RuntimeError("a variant that does not compile")
        return gm.forward

    model = _model()
    set_layer_compilation(model, True, backend=fails_after_the_first_graphs)
    prompts, responses = _batch()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="a variant that does not compile"):
        _run(model, prompts, responses)
    assert compiled_module.compile_fallback() is None


def test_an_error_of_a_compiled_layer_at_run_time_is_raised(monkeypatch):
    """Only a failure to compile falls back: an error raised by compiled code as it runs propagates."""
    monkeypatch.setattr(compiled_module, "_STATE", compiled_module._CompileState())

    def raising_graph(gm, inputs):
        def run(*args):
            raise ValueError("raised by the compiled graph")

        return run

    model = _model()
    set_layer_compilation(model, True, backend=raising_graph)
    prompts, responses = _batch()
    with pytest.raises(ValueError, match="raised by the compiled graph"), torch.no_grad():
        _score(model, prompts, responses, attached=False)
    assert compiled_module.compile_fallback() is None


def test_inductor_rounds_where_eager_rounds(monkeypatch):
    """Inductor compiles the layers with ``emulate_precision_casts`` (other backends take no options):
    without it, a detached and an attached pass of one prompt differ in bf16 on CUDA, and prefill fusion
    no longer gives the serial update bitwise (tests/schedule checks that on the GPU)."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    compiled_module._compiled.cache_clear()
    try:
        model = _model()
        set_layer_compilation(model, True)  # compiles lazily: nothing runs here
        set_layer_compilation(model, True, backend="aot_eager")
    finally:
        compiled_module._compiled.cache_clear()
    by_backend = {c["backend"]: c["options"] for c in calls}
    assert by_backend == {"inductor": {"emulate_precision_casts": True}, "aot_eager": None}
    assert all(c["dynamic"] for c in calls)


def test_another_instance_forward_is_not_overwritten():
    model = _model()
    norm = model.model.language_model.layers[0].input_layernorm
    norm.forward = lambda hidden: hidden
    with pytest.raises(ValueError, match="layers.0.input_layernorm"):
        set_layer_compilation(model, True, backend="aot_eager", scope="parts")
    assert not layers_compiled(model)  # nothing was installed
    del norm.forward
    set_layer_compilation(model, True, backend="aot_eager", scope="parts")
    replaced = norm.forward = lambda hidden: hidden  # replaced after compiling
    with pytest.raises(ValueError, match="overwrite"):
        set_layer_compilation(model, True, backend="aot_eager", scope="parts")
    assert norm.forward is replaced
    mlp = model.model.visual.blocks[0].mlp
    with pytest.raises(ValueError, match="overwrite"):  # before the MLP's class changes
        prepare_model(model, vision_mlp_padding=False)
    assert type(mlp) is PaddedVisionMLP
    set_layer_compilation(model, False)  # not removed as if it were ours
    assert norm.forward is replaced and not layers_compiled(model)
    assert len(_compiled_modules(model)) == 1
    set_layer_compilation(model, True, backend="aot_eager")  # a whole layer traces the norm's forward
    assert norm.forward is replaced and compiled_scope(model) == "layer"
    layer = model.model.language_model.layers[1]
    set_layer_compilation(model, False)
    layer.forward = lambda hidden, **kwargs: hidden
    with pytest.raises(ValueError, match="language_model.layers.1 "):
        set_layer_compilation(model, True, backend="aot_eager")
    assert not layers_compiled(model)


def test_a_layer_without_its_modules_is_refused():
    model = _model()
    del model.model.language_model.layers[1].mlp
    with pytest.raises(ValueError, match="has no 'mlp'"):
        set_layer_compilation(model, True, backend="aot_eager")
    assert not _compiled_modules(model)  # nothing was installed
    with pytest.raises(ValueError, match="not a Qwen2.5-VL model"):
        set_layer_compilation(torch.nn.Linear(2, 2), True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("dtype", "lp_tol", "grad_tol"), [(torch.float64, 1e-6, 1e-5), (torch.bfloat16, 0.1, 0.1)]
)
def test_inductor_layers_match_the_eager_model_on_cuda(dtype, lp_tol, grad_tol):
    """Inductor's kernels round the float32 norms in another order: float64 agrees to float32 rounding;
    bf16 within the rollout-vs-trainer tolerance of tests/numerics."""
    eager = _model().to("cuda", dtype)
    compiled = copy.deepcopy(eager)
    set_layer_compilation(compiled, True)
    prompts, responses = _batch("cuda", dtype)
    want, got = _run(eager, prompts, responses), _run(compiled, prompts, responses)
    for g, w in zip(got[:2], want[:2], strict=True):
        assert float((g.double() - w.double()).abs().max()) <= lp_tol
    for name, grad in want[2].items():
        rel = (got[2][name].double() - grad.double()).norm() / grad.double().norm()
        assert float(rel) <= grad_tol, name
