"""Probe torch's CUDA green contexts on this install: which API it has, and whether a green stream's
kernels keep to its SMs (a bf16 matrix product timed on the whole GPU and on green streams of fewer SMs).

Usage: python scripts/green_probe.py
"""

from __future__ import annotations

import traceback

import torch


def timed(fn, stream, repeats=20):
    with torch.cuda.stream(stream):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(repeats):
            fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / repeats


def green_stream(sms):
    from torch.cuda import green_contexts as gc

    ctx = gc.GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())  # torch 2.11 and later
    return ctx, ctx.Stream()


def main():
    print("torch", torch.__version__, "cuda", torch.version.cuda)
    try:
        from torch.cuda import green_contexts as gc

        print("GreenContext attrs:", [n for n in dir(gc.GreenContext) if not n.startswith("__")])
    except Exception:
        traceback.print_exc()
        return
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(256 * 2**20, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    mm = lambda: a @ b  # noqa: E731
    cp = lambda: dst.copy_(src)  # noqa: E731
    whole = torch.cuda.Stream()
    print(f"whole GPU: matmul {timed(mm, whole):.3f} ms, copy 512 MiB {timed(cp, whole):.3f} ms")
    for sms in (16, 33, 66, 99):
        try:
            ctx, stream = green_stream(sms)
            print(
                f"green {sms} SMs: matmul {timed(mm, stream):.3f} ms, copy {timed(cp, stream):.3f} ms, "
                f"stream {stream}"
            )
        except Exception:
            traceback.print_exc()
            break


if __name__ == "__main__":
    main()
