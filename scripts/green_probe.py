"""Time one bf16 matrix product (8192³) and one 512 MiB copy on the whole GPU and on CUDA green-context
streams (rollplex.schedule.concurrency.green_stream) asked for 16, 33, 66 and 99 SMs, with the SM count
the driver gave each (it rounds up: to a multiple of 8 on an H200). The product is compute-bound, the
copy bandwidth-bound: how much of each a partition keeps is the trade of ``run.prefix_sms``.

Usage: python scripts/green_probe.py
"""

from __future__ import annotations

import torch

from rollplex.bench.common import cuda_script_args
from rollplex.schedule.concurrency import green_stream


def timed(fn, stream: torch.cuda.Stream, repeats: int = 20) -> float:
    """Milliseconds per call of ``fn`` on ``stream``, after one warm-up call (CUDA events)."""
    with torch.cuda.stream(stream):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(repeats):
            fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    print("torch", torch.__version__, "cuda", torch.version.cuda)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    src = torch.randn(256 * 2**20, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)

    def product():
        return a @ b

    def copy():
        return dst.copy_(src)

    whole = torch.cuda.Stream()
    print(f"whole GPU: product {timed(product, whole):.3f} ms, copy {timed(copy, whole):.3f} ms")
    for asked in (16, 33, 66, 99):
        stream, count = green_stream(torch.device("cuda"), asked)
        if stream is None:
            print(f"{asked} SMs asked: no green context here (see the warning)")
            continue
        print(
            f"{asked} SMs asked, {count} given: product {timed(product, stream):.3f} ms, "
            f"copy {timed(copy, stream):.3f} ms"
        )


if __name__ == "__main__":
    cuda_script_args(__doc__)
    main()
