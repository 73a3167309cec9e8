"""L2 prefetch (PTX cp.async.bulk.prefetch.L2) before the decode step's cuBLAS products at the 3B shape:
36 layers' weights in one CUDA graph, µs per (prefetch kernel, spin, product); "hot" reuses one weight
(L2-resident), "cold" cycles the 36. Usage (CUDA): python scripts/prefetch_micro.py OUT.json"""

import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from blas_micro import timed

from rollplex.rollout.decode_kernel import _prefetch_l2

SPIN = int(os.environ.get("SPIN", "10000"))  # cycles of the spin kernel between prefetch and product
SHAPES = {"o": (2048, 2048), "qkv": (2560, 2048), "down": (2048, 11008)}


@triton.jit
def _prefetch(w, nbytes, LANES: tl.constexpr, LAST: tl.constexpr):
    _prefetch_l2(w, nbytes, tl.program_id(0), tl.num_programs(0), LANES, LAST)


def _sequence(
    ws, x, programs: int = 0, last: bool = False, spin: bool = True, product: bool = True, hot=False
):
    def run():
        for w in ws:
            if programs:
                _prefetch[(programs,)](w, w.numel() * w.element_size(), LANES=128, LAST=last, num_warps=4)
            if spin:
                torch.cuda._sleep(SPIN)
            if product:
                F.linear(x, ws[0] if hot else w)

    return run


def main(out: str) -> None:
    torch.manual_seed(0)
    res = {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(36)]
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        r = {
            "cold": timed(_sequence(ws, x, spin=False)),
            "hot": timed(_sequence(ws, x, spin=False, hot=True)),
            "spin_only": timed(_sequence(ws, x, product=False)),
            "spin_cold": timed(_sequence(ws, x)),
        }
        for programs in (1, 8, 32, 132):
            for last in (False, True):
                r[f"pf{programs}{'L' if last else ''}_spin"] = timed(_sequence(ws, x, programs, last))
        r["pf32_nospin"] = timed(_sequence(ws, x, 32, spin=False))
        r["pf32_spin_noproduct"] = timed(_sequence(ws, x, 32, product=False))
        res[name] = r
        print(name, {key: round(v, 2) for key, v in r.items()}, flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
