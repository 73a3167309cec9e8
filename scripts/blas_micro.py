"""cuBLAS against cuBLASLt for the decode step's products at the 3B shape (64 rows; 36 layers' weights in
one CUDA graph, µs per product), and the graph's floor: an empty kernel and a tiny elementwise one."""

import json
import sys

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (2560, 2048, True), "o": (2048, 2048, False), "gate_up": (22016, 2048, False),
          "down": (2048, 11008, False)}  # fmt: skip


def timed(fn, reps: int = 20) -> float:
    """µs per call of 36 calls captured in one CUDA graph (median of five timings of ``reps`` replays)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / reps / 36)
    return sorted(ts)[2]


def main(out: str) -> None:
    torch.manual_seed(0)
    res = {"empty_kernel": timed(lambda: [torch.cuda._sleep(0) for _ in range(36)])}
    x1 = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    res["tiny_add_64x2048"] = timed(lambda: [x1.add_(1) for _ in range(36)])
    for name, (n, k, bias) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(36)]
        bs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None for _ in range(36)]
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0], bs[0])
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            t = timed(lambda x=x, ws=ws, bs=bs: [F.linear(x, w, b) for w, b in zip(ws, bs, strict=True)])
            res[f"{name}/{lib}"] = (t, torch.equal(F.linear(x, ws[0], bs[0]), ref))
            print(name, lib, res[f"{name}/{lib}"], flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")
    print(res)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
