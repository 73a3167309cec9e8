"""The schedule's stream helpers: the accumulate-grad warning, chunk barriers and green-context streams
(SM partitioning, checked on CUDA by the SM each program ran on)."""

from __future__ import annotations

import enum
import sys
import threading
import types

import pytest
import torch

from rollplex.loop import train
from rollplex.schedule import concurrency, prefix_overlap
from rollplex.schedule.concurrency import SideWork, cross_stream_backward, green_stream
from rollplex.schedule.prefix_overlap import CALIBRATION_STEPS, CoRunPolicy
from tests.schedule.test_same_update import SCHEDULES, green_capable, step_rows
from tests.test_loop import _config, assets  # noqa: F401  (fixture)

_get = getattr(torch._C, "_warn_on_accumulate_grad_stream_mismatch", None)
_set = getattr(torch._C, "_set_warn_on_accumulate_grad_stream_mismatch", None)


@pytest.mark.skipif(_get is None or _set is None, reason="this torch has no accumulate-grad stream warning")
@pytest.mark.parametrize("before", [True, False])
def test_cross_stream_backward_silences_the_warning_and_restores_it(before):
    """Off inside the body, the previous setting after it, also when the body raises."""
    original = _get()
    _set(before)
    try:
        with cross_stream_backward():
            assert _get() is False
        assert _get() is before
        with pytest.raises(RuntimeError), cross_stream_backward():
            raise RuntimeError("backward failed")
        assert _get() is before
    finally:
        _set(original)


def test_chunk_barrier_on_the_cpu_is_a_plain_wait():
    """Without CUDA there is no green stream: the barrier only waits, before and after decode ends."""
    calls = []

    def work():
        worker.chunk_barrier()
        calls.append("chunk")
        return "done"

    worker = SideWork(work, torch.device("cpu"), sms=8)
    assert worker.green is None and worker.stream is None
    worker.start()
    worker.decode_done()
    assert worker.join().value == "done" and calls == ["chunk"]


def test_the_policy_name_gives_the_sm_limit():
    assert CoRunPolicy(chunk_groups=1, prefix_sms=66).name == "overlap+priority+chunk1+sms66"
    assert CoRunPolicy().name == "overlap+priority"


def test_the_schedule_hands_the_sm_limit_to_its_worker(assets, tmp_path, monkeypatch):  # noqa: F811
    """The configured SM limit reaches the worker of every overlapped step (on a CPU it then runs on no
    stream at all), and the step records the SMs the worker got: 0 without a green context."""
    asked, barriers = [], []

    class Recording(SideWork):
        def __init__(self, fn, device, sm_carveout=0, sms=0):
            asked.append(sms)
            super().__init__(fn, device, sm_carveout, sms)

        def chunk_barrier(self):
            barriers.append(len(asked))
            super().chunk_barrier()

    monkeypatch.setattr(prefix_overlap, "SideWork", Recording)
    run = train(_config(assets, tmp_path / "run", 3, **{"run.device": "cpu", **SCHEDULES["green"]}))
    assert asked == [16]  # the first two steps calibrate, running their prefixes after decode
    assert barriers == [1, 1]  # one barrier per chunk of one group: the worker can leave the green stream
    assert [m["schedule/prefix_sms"] for m in step_rows(run)] == [0.0, 0.0, 0.0]


needs_green = pytest.mark.skipif(
    not green_capable(), reason="needs CUDA green contexts (torch, cuda.bindings)"
)


class _FakeDriver:
    """cuda.bindings.driver's three calls ``_partition_sms`` makes, answering as a driver that rounds
    up to multiples of 8 (``refuse``: the split fails)."""

    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION = 914

    class CUdevResourceType:
        CU_DEV_RESOURCE_TYPE_SM = 1

    def __init__(self, refuse: bool = False):
        self.refuse = refuse

    def cuDeviceGet(self, index):
        return self.CUresult.CUDA_SUCCESS, index

    def cuDeviceGetDevResource(self, device, kind):
        return self.CUresult.CUDA_SUCCESS, "sm resource"

    def cuDevSmResourceSplitByCount(self, groups, resource, flags, sms):
        if self.refuse:
            return self.CUresult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, [], 0, None
        group = types.SimpleNamespace(sm=types.SimpleNamespace(smCount=-(-sms // 8) * 8))
        return self.CUresult.CUDA_SUCCESS, [group], 1, None


@pytest.fixture
def fake_device(monkeypatch):
    """A 132-SM device for ``_make_green`` without a GPU; returns a function installing a fake driver."""
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(multi_processor_count=132)
    )

    def install(driver):
        package = types.ModuleType("cuda.bindings")
        package.driver = driver
        monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
        monkeypatch.setitem(sys.modules, "cuda.bindings", package)
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)

    return install


def test_partition_sms_reads_the_drivers_rounding_and_its_refusal(fake_device):
    fake_device(_FakeDriver())
    assert concurrency._partition_sms(0, 66) == (72, "")
    fake_device(_FakeDriver(refuse=True))
    count, why = concurrency._partition_sms(0, 66)
    assert count == 0 and "cannot split 66 SMs (CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION)" in why


@pytest.mark.parametrize(
    ("driver", "asked", "reason"),
    [
        (_FakeDriver(), 132, "not below the device's 132"),
        (_FakeDriver(), 130, "the driver gives 136 SMs, the device's 132"),
        (_FakeDriver(refuse=True), 66, "cannot split 66 SMs"),
    ],
)
def test_make_green_falls_back_with_the_reason(fake_device, caplog, driver, asked, reason):
    """No green context when the partition would not leave SMs out, or the driver refuses it: every
    SM, and a warning that says why (nothing of the green-context module is touched)."""
    fake_device(driver)
    with caplog.at_level("WARNING"):
        assert concurrency._make_green(0, asked) == (None, None, 0)
    assert f"prefix SMs {asked}: " in caplog.text and reason in caplog.text


def test_an_sm_limit_on_a_cpu_warns_once(caplog):
    concurrency._warn_once.cache_clear()
    with caplog.at_level("WARNING"):
        for _ in range(2):
            SideWork(lambda: None, torch.device("cpu"), sms=8)
    assert caplog.text.count("prefix SMs 8: no SM partitioning on cpu") == 1


def _sm_ids(stream: torch.cuda.Stream, programs: int = 4096) -> set[int]:
    """The SM each of ``programs`` programs of a small Triton kernel ran on, launched on ``stream``."""
    import triton
    import triton.language as tl

    @triton.jit
    def record_sm(out, spins: tl.constexpr):
        smid = tl.inline_asm_elementwise(
            "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
        acc = smid
        for i in range(spins):  # a few microseconds of work, so programs spread over the SMs
            acc = acc * 1664525 + i
        tl.store(out + tl.program_id(0), tl.where(acc == 12345, -1, smid))

    out = torch.full((programs,), -2, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(stream):
        record_sm[(programs,)](out, spins=2000)
    stream.synchronize()
    assert (out >= 0).all()  # every program wrote its SM
    return set(out.tolist())


@pytest.mark.gpu
@needs_green
@pytest.mark.parametrize("asked", [16, 66])
def test_green_stream_keeps_every_kernel_on_the_sms_it_reports(asked):
    """A kernel launched on a green stream runs on exactly as many SMs as ``green_stream`` reports (at
    least the number asked: the driver rounds up to its granularity); the same kernel on a plain
    stream spreads over more."""
    device = torch.device("cuda")
    stream, count = green_stream(device, asked)
    assert stream is not None and count >= asked
    assert green_stream(device, asked) == (stream, count)  # made once
    assert len(_sm_ids(stream)) == count
    assert len(_sm_ids(torch.cuda.Stream())) > count


@pytest.mark.gpu
@needs_green
def test_green_stream_gives_the_same_numbers():
    a, b = (torch.randn(512, 512, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    stream, _ = green_stream(torch.device("cuda"), 16)
    expected = a @ b
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = a @ b
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(got, expected)


@pytest.mark.gpu
@needs_green
def test_the_worker_leaves_the_green_stream_at_the_first_barrier_after_decode():
    """Chunks before decode ends run on the green stream, chunks after it on the plain worker stream."""
    device = torch.device("cuda")
    first_chunk, decode_over, seen = threading.Event(), threading.Event(), []

    def work():
        seen.append(torch.cuda.current_stream(device).cuda_stream)
        worker.chunk_barrier()  # decode still runs: stays
        seen.append(torch.cuda.current_stream(device).cuda_stream)
        first_chunk.set()
        decode_over.wait(timeout=60)
        worker.chunk_barrier()  # decode is over: leaves
        seen.append(torch.cuda.current_stream(device).cuda_stream)
        return torch.ones(4, device=device) * 2

    worker = SideWork(work, device, sms=16)
    assert worker.green is not None and worker.green_sms == 16
    worker.start()
    assert first_chunk.wait(timeout=60)
    worker.decode_done()
    decode_over.set()
    result = worker.join(lambda r: [r.value])
    assert seen == [worker.green.cuda_stream] * 2 + [worker.stream.cuda_stream]
    assert torch.equal(result.value.cpu(), torch.full((4,), 2.0))


def _tensors_in_cycles() -> int:
    """Tensors that only a reference cycle keeps alive now (they stay allocated until Python's collector
    runs); the collector's debug flags are restored."""
    import gc

    flags = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(flags)


@pytest.mark.parametrize("row", ["serial", "overlap", "fusion", "both"])
def test_a_step_leaves_no_tensor_to_the_garbage_collector(row, no_automatic_gc):
    """A step's tensors are freed when the step's last reference goes, not when the collector runs:
    nothing of a step, the prefixes the worker thread made included, sits in a reference cycle (the
    worker's function closing over the worker kept its result, the prefixes' boundary KV, each step)."""
    import gc

    from rollplex.bench.schedule import ROWS, _Workload, make_step
    from rollplex.observe.metrics import PhaseTimer
    from tests.bench.test_schedule_bench import _tiny

    cfg = _tiny(gradient_checkpointing=True, rows=(row,))
    work = _Workload(cfg, torch.device("cpu"))
    roles = work.roles(ROWS[row], cfg)
    step, timer = make_step(roles.config, work.device), PhaseTimer(sync=None)
    gc.collect()  # what setting up left
    for _ in range(CALIBRATION_STEPS + 1):  # the calibration steps, then one as the row runs them
        extra = step(roles, work.prompts, timer)[-1]  # the outputs dropped at once
        timer.pop()
        assert _tensors_in_cycles() == 0
    assert extra.get("schedule/overlap", 0.0) == float(row in ("overlap", "both"))


def test_the_worker_hands_over_its_result_and_error():
    """``join`` returns what the work made and keeps no reference to it, nor to the work itself (which
    closes over the worker, as the schedule's does) once it has run; an error is raised, and the worker
    keeps neither it nor the work; a worker that never started drops its work at ``wait``."""
    import weakref

    def work() -> torch.Tensor:
        worker.chunk_barrier()  # closes over the worker, as the schedule's work does
        return torch.ones(3)

    worker = SideWork(work, torch.device("cpu"))
    result = worker.start().join()
    assert torch.equal(result.value, torch.ones(3)) and worker._result is None and worker.fn is None
    kept = weakref.ref(result.value)
    del result
    assert kept() is None

    failing = SideWork(lambda: 1 / 0, torch.device("cpu")).start()
    with pytest.raises(ZeroDivisionError):
        failing.join()
    assert failing._error is None and failing.fn is None
    unstarted = SideWork(work, torch.device("cpu"))
    unstarted.wait()
    assert unstarted.fn is None
