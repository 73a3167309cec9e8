"""Does reading W_o into L2 on a side branch of the CUDA graph, while the fused attention runs, make the
o product after it faster? Times per layer (36 layers, each with its own inputs, graph-replayed) of:
the attention; attention + o; o alone; o twice on the same weight (the second from L2); and attention +
o with a prefetch kernel of 16–64 programs on the side branch, loading with evict_last or normal
priority. Usage (CUDA): python scripts/l2_prefetch.py"""

import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, "scripts")  # attention_sweep
from attention_sweep import LAYERS, _inputs

from rollplex.rollout.decode_kernel import fused_decode_attention


@triton.jit
def _prefetch(w, n, sink, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    pid, progs = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, progs * BLOCK):
        i = start + tl.arange(0, BLOCK)
        acc += tl.load(w + i, mask=i < n, other=0.0, eviction_policy=EVICT).to(tl.float32)
    tl.store(sink + pid, tl.sum(acc, 0))


def prefetch(w, sink, progs, evict):
    _prefetch[(progs,)](w, w.numel(), sink, BLOCK=2048, EVICT=evict, num_warps=4)


def timed(fn, replays=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (replays * LAYERS)


step = 256
layers = [_inputs(step) for _ in range(LAYERS)]
wo = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
x = [torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
sink = torch.zeros(1024, device="cuda")
side = torch.cuda.Stream()


def attn_only():
    for a in layers:
        fused_decode_attention(*a)


def attn_o():
    for a, w in zip(layers, wo):
        F.linear(fused_decode_attention(*a), w)


def o_cold():
    for xi, w in zip(x, wo):
        F.linear(xi, w)


def o_twice():
    for xi, w in zip(x, wo):
        F.linear(xi, w)
        F.linear(xi, w)


def attn_o_prefetch(progs, evict):
    def fn():
        for a, w in zip(layers, wo):
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(w, sink, progs, evict)
            out = fused_decode_attention(*a)
            main.wait_stream(side)
            F.linear(out, w)

    return fn


print(f"attention only       {timed(attn_only):7.2f} us/layer")
print(f"attention + o        {timed(attn_o):7.2f}")
print(f"o cold               {timed(o_cold):7.2f}")
print(f"o twice              {timed(o_twice):7.2f}  (second from L2 = twice - cold)")
for progs in (16, 32, 64):
    for evict in ("evict_last", ""):
        print(
            f"attn + o, prefetch {progs:3d} progs {evict or 'normal':10s} {timed(attn_o_prefetch(progs, evict)):7.2f}"
        )
