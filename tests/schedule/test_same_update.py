"""Same update: serial, rollplex and rollplex with prefill fusion train bit-identically on the CPU, and
the barriers hold (nothing writes θ_k before the optimizer phase; suffixes follow their prefixes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

from rollplex.checkpoint import load_trainer_state
from rollplex.loop import build_run, train
from rollplex.models import recompute
from rollplex.models.compiled import layers_compiled
from rollplex.observe.metrics import PhaseTimer
from rollplex.schedule import make_step
from rollplex.schedule.prefix_overlap import CALIBRATION_STEPS
from tests.test_loop import _config, _metrics, _weights, assets  # noqa: F401  (fixture)

SCHEDULES = {
    "serial": {},
    "rollplex": {"schedule.kind": "rollplex"},
    "sequential": {"schedule.kind": "rollplex", "schedule.overlap": "false"},
    "fused": {"schedule.kind": "rollplex", "schedule.prefill_fusion": "true"},
    "fused-sequential": {
        "schedule.kind": "rollplex",
        "schedule.prefill_fusion": "true",
        "schedule.overlap": "false",
    },
    "chunked": {"schedule.kind": "rollplex", "schedule.prefix_chunk_groups": "1"},
    # the reference prefix on 16 SMs while decode runs (a green context on CUDA; on a CPU, fused + chunked)
    "green": {
        "schedule.kind": "rollplex",
        "schedule.prefill_fusion": "true",
        "schedule.prefix_chunk_groups": "1",
        "schedule.prefix_sms": "16",
    },
    "auto": {"schedule.kind": "auto"},
}
# timing prefixes ("gc_": the garbage collector's time and passes), the decode step's setup time, and
# the memory plan and bytes moved (which depend on the schedule)
TIMING = ("time/", "eq1/", "schedule/", "gc_", "decode/setup_s", "memory/")


def green_capable() -> bool:
    """Whether this install can make CUDA green contexts at all (a GPU, torch's module, cuda.bindings):
    where it can, a green policy that fell back to every SM is a failure, not a skip."""
    if not torch.cuda.is_available():
        return False
    try:
        import cuda.bindings  # noqa: F401
        from torch.cuda.green_contexts import GreenContext
    except ImportError:
        return False
    return hasattr(GreenContext, "Stream")


def test_schedules_give_identical_fp32_masters_with_a_bf16_model(assets, tmp_path):  # noqa: F811
    """With the model in bf16 on the CPU the optimizer keeps FP32 master weights: rollplex with prefill
    fusion ends with serial's masters and moments bitwise, and the masters are really compared (one per
    weight in the checkpoint, whose weights moved)."""
    runs = {}
    for name in ("serial", "fused"):
        overrides = {"algo.kl_coef": 0.05, "eval.every": 0, "run.device": "cpu", "run.dtype": "bfloat16"}
        overrides["reward.functions"] = "[rollplex.bench.common:distinct_reward]"  # a nonzero update
        runs[name] = train(
            _config(assets, tmp_path / name, CALIBRATION_STEPS + 1, **overrides, **SCHEDULES[name])
        )
    assert_overlapped(runs, "fused")
    masters = [key for key in optimizer_tensors(runs["serial"]) if key[1] == "master"]
    assert masters and len(masters) == len(assert_moved(runs["serial"], assets[0]))
    assert_same_update(runs)


def test_schedules_give_identical_parameters(assets, tmp_path):  # noqa: F811
    """4 steps with KL on and 4-token responses (the suffix path runs): weights and every metric except
    timings are bitwise equal across serial, rollplex with and without the worker thread, with and
    without prefill fusion, with chunked prefix issue (with fusion and an SM limit: "green"), and auto
    (which switches policy between steps: two calibration steps, then its first two trials)."""
    runs = {}
    for name, extra in SCHEDULES.items():
        overrides = {"algo.kl_coef": 0.05, "eval.every": 0, "run.device": "cpu", **extra}
        runs[name] = train(_config(assets, tmp_path / name, CALIBRATION_STEPS + 2, **overrides))
    assert_overlapped(runs, "rollplex", "fused", "chunked", "green", "auto")
    metrics = assert_same_update(runs)
    assert any(r.get("kl", 0) > 0 for r in metrics["serial"])  # the reference path really ran


def test_schedules_give_identical_parameters_under_checkpointing(assets, tmp_path):  # noqa: F811
    """With ``model.gradient_checkpointing`` on (layer recompute in the prefix passes, whose forward runs
    without autograd; torch's checkpoint in the suffix passes) serial, rollplex and rollplex with
    prefill fusion end with bitwise the same weights, optimizer tensors and metrics, and the weights
    moved; serial under torch's checkpoint everywhere (``model.layer_recompute: false``) ends with the
    same optimizer tensors up to rounding."""
    runs = {}
    for name in ("serial", "rollplex", "fused", "torch-checkpoint"):
        overrides = {"algo.kl_coef": 0.05, "eval.every": 0, "run.device": "cpu", **SCHEDULES.get(name, {})}
        overrides["model.gradient_checkpointing"] = "true"
        overrides["model.layer_recompute"] = str(name != "torch-checkpoint").lower()
        overrides["reward.functions"] = "[rollplex.bench.common:distinct_reward]"  # a nonzero update
        cfg = _config(assets, tmp_path / name, CALIBRATION_STEPS + 1, **overrides)
        layers = build_run(cfg).roles.actor.model.language_model.layers  # checkpointed as configured
        uses = {layer._gradient_checkpointing_func.func for layer in layers}
        assert uses == {recompute.checkpoint if name != "torch-checkpoint" else checkpoint}, name
        runs[name] = train(cfg)
    assert_moved(runs["serial"], assets[0])
    assert_overlapped(runs, "rollplex", "fused")
    torch_checkpoint = runs.pop("torch-checkpoint")
    assert_same_update(runs)
    # against torch's checkpoint the parameters' gradients sum in another order: the same update up to
    # float32 rounding (measured 1.3e-6 relative, AdamW moments included; dropping the boundary keys' and
    # values' gradients in layer recompute's backward gives 1.38)
    mine, theirs = optimizer_tensors(runs["serial"]), optimizer_tensors(torch_checkpoint)
    assert mine.keys() == theirs.keys()
    worst = max(
        float((mine[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp_min(1e-30)) for k in mine
    )
    assert worst <= 1e-4


def assert_moved(run, model_dir) -> dict[str, torch.Tensor]:
    """The run folder's final weights, after asserting that some differ from the initial checkpoint's
    in ``model_dir`` (cast to the run's dtype): a zero update would make any comparison of schedules
    hold trivially."""
    final = _weights(run)
    initial = load_file(Path(model_dir) / "model.safetensors")
    moved = [k for k in final if k in initial and not torch.equal(final[k], initial[k].to(final[k].dtype))]
    assert moved, "the update was zero: nothing to compare"
    return final


def assert_overlapped(runs: dict, *names: str) -> None:
    """Assert that each named run's last step ran its prefixes beside decode (a comparison of calibration
    steps alone would leave the worker thread and the co-running untested)."""
    for name in names:
        assert step_rows(runs[name])[-1]["schedule/overlap"] == 1.0, name


def step_rows(run) -> list[dict]:
    """The metrics rows of a rollplex or auto run folder's training steps (not its evaluation rows)."""
    return [m for m in _metrics(run) if "schedule/overlap" in m]


def untimed(row: dict) -> dict:
    """A metrics row without its timings (``TIMING`` prefixes)."""
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def optimizer_tensors(run) -> dict[tuple, torch.Tensor]:
    """The optimizer's tensors in a run folder's latest checkpoint, by (parameter index, name): each
    parameter's AdamW step count and moments, and its FP32 master weight where the model is in a lower
    precision. The weights alone can hide a different update (a bf16 step is far larger than the
    update's difference, and AdamW's normalised step hides a gradient's), these cannot."""
    latest = Path(run) / "checkpoints" / (Path(run) / "checkpoints" / "latest").read_text().strip()
    state = load_trainer_state(latest)["optimizer"]
    tensors = {
        (index, name): value
        for index, moments in state["inner"]["state"].items()
        for name, value in moments.items()
    }
    tensors.update({(index, "master"): master for index, master in enumerate(state.get("masters", []))})
    return tensors


def assert_same_optimizer(run, other, name: str) -> None:
    """Run folders ``run`` and ``other`` end with bitwise the same optimizer tensors (``name``: which)."""
    mine, theirs = optimizer_tensors(run), optimizer_tensors(other)
    assert mine and mine.keys() == theirs.keys(), name
    differing = [key for key in mine if not torch.equal(mine[key], theirs[key])]
    assert not differing, f"{name}: {len(differing)} optimizer tensors differ, first {differing[0]}"


def assert_same_update(runs: dict) -> dict[str, list[dict]]:
    """Every run folder of ``runs`` (name -> folder) ends with the "serial" run's weights and optimizer
    tensors (AdamW moments, FP32 masters), bitwise, and wrote its metrics but timings; returns those
    untimed metric rows per run."""
    weights = {name: _weights(run) for name, run in runs.items()}
    metrics = {name: [untimed(r) for r in _metrics(run)] for name, run in runs.items()}
    for name in runs:
        assert all(torch.equal(weights["serial"][k], weights[name][k]) for k in weights["serial"]), name
        assert_same_optimizer(runs["serial"], runs[name], name)
        assert metrics["serial"] == metrics[name], name
    return metrics


class _Recorder:
    """Phase timer that logs (event, phase) and the actor's parameter versions at each forward call."""

    def __init__(self, model):
        self.events: list[tuple[str, str]] = []
        self.timer = PhaseTimer()
        self.current = ""
        self.model = model
        model.register_forward_pre_hook(self._forward)

    def _version(self) -> int:
        return sum(p._version for p in self.model.parameters())

    def _forward(self, *args):
        self.events.append(("forward", self.current, self._version()))

    def now(self):
        return self.timer.now()

    def record(self, name, start, end, stream="main"):
        self.events.append(("record", name, self._version()))
        self.timer.record(name, start, end, stream)

    def phase(self, name):
        recorder = self

        class _Span:
            def __enter__(self):
                recorder.current = name
                recorder.events.append(("start", name, recorder._version()))
                self.inner = recorder.timer.phase(name)
                return self.inner.__enter__()

            def __exit__(self, *exc):
                recorder.events.append(("end", name, recorder._version()))
                return self.inner.__exit__(*exc)

        return _Span()


def _check_barriers(events, order):
    phases = [name for kind, name, _ in events if kind == "start"]
    assert phases == order
    before_update = [v for kind, name, v in events if name != "optimizer"]
    assert len(set(before_update)) == 1, "θ_k changed before the optimizer phase"
    end_of_step = [v for kind, name, v in events if kind == "end" and name == "optimizer"][0]
    assert end_of_step > before_update[0], "the optimizer did not write θ_{k+1}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_gives_identical_parameters_on_gpu(assets, tmp_path):  # noqa: F811
    """On CUDA (bf16) the overlapped schedule runs the serial schedule's kernels on other streams, also
    with the reference prefix confined to 16 SMs (a green context, with prefill fusion): bitwise the
    same weights, AdamW moments and FP32 master weights after 3 steps. The models run their layers
    compiled (``model.compile_layers``, the CUDA default), so compiled layers called from the Phase-1
    worker thread are covered too. Responses
    are scored by ``distinct_reward``, and the weights must have moved: with a zero update (every
    response scored 0, the actor equal to the reference) the comparison would hold trivially."""
    cuda_run = build_run(
        _config(assets, tmp_path / "probe", 1, **{"algo.kl_coef": 0.05, "run.device": "cuda"})
    )
    assert layers_compiled(cuda_run.roles.actor) and layers_compiled(cuda_run.roles.reference)
    del cuda_run
    runs = {}
    reward = "[rollplex.bench.common:distinct_reward]"
    for name in ("serial", "rollplex", "green"):
        overrides = {"algo.kl_coef": 0.05, "eval.every": 0, "run.device": "cuda", "reward.functions": reward}
        runs[name] = train(_config(assets, tmp_path / name, 3, **overrides, **SCHEDULES[name]))
    serial = assert_moved(runs["serial"], assets[0])
    for name in ("rollplex", "green"):
        other = _weights(runs[name])
        assert all(torch.equal(serial[k], other[k]) for k in serial), name
        assert_same_optimizer(runs["serial"], runs[name], name)  # the FP32 masters too
    if green_capable():  # the calibration steps run their prefixes after decode; the others on 16 SMs
        assert [m["schedule/prefix_sms"] for m in step_rows(runs["green"])] == [0.0] * CALIBRATION_STEPS + [
            16.0
        ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_barriers(assets, tmp_path, device):  # noqa: F811
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for name, order in (
        ("serial", ["rollout", "rewards", "reference", "actor", "optimizer"]),
        ("sequential", ["rollout", "prefix", "rewards", "reference", "actor", "optimizer"]),
        ("fused-sequential", ["prefix", "rollout", "prefix", "rewards", "reference", "actor", "optimizer"]),
        ("rollplex", ["rewards", "reference", "actor", "optimizer"]),  # Phase 1 on two threads
    ):
        cfg = _config(
            assets, tmp_path / name, 2, **{"algo.kl_coef": 0.05, "run.device": device, **SCHEDULES[name]}
        )
        _check_barriers(first_overlapped_step_events(cfg), order)


def first_overlapped_step_events(cfg) -> list[tuple[str, str, int]]:
    """The recorded events (phase starts and ends, actor forwards, with θ's version) of the step after
    the rollplex schedule's calibration steps (``CALIBRATION_STEPS``) in a run of ``cfg``."""
    run = build_run(cfg)
    step = make_step(cfg, run.device)
    for _ in range(CALIBRATION_STEPS):
        step(run.roles, run.train.next_batch(), PhaseTimer())
    recorder = _Recorder(run.roles.actor.model.language_model)
    step(run.roles, run.train.next_batch(), recorder)
    return recorder.events


@pytest.mark.skipif(
    not hasattr(torch._C, "_warn_on_accumulate_grad_stream_mismatch"), reason="this torch has no such warning"
)
def test_the_actor_backward_runs_with_the_stream_warning_off(assets, tmp_path, monkeypatch):  # noqa: F811
    """The overlapped schedule's actor backward runs inside ``cross_stream_backward`` (the warning off),
    and the setting is back on after the step."""
    import rollplex.schedule.prefix_overlap as schedule

    seen, real = [], schedule.actor_backward
    warns = torch._C._warn_on_accumulate_grad_stream_mismatch
    monkeypatch.setattr(schedule, "actor_backward", lambda *a, **k: seen.append(warns()) or real(*a, **k))
    cfg = _config(assets, tmp_path / "run", 1, **{"run.device": "cpu", **SCHEDULES["rollplex"]})
    run = build_run(cfg)
    assert warns() is True
    make_step(cfg, run.device)(run.roles, run.train.next_batch(), PhaseTimer())
    assert seen == [False] and warns() is True
