"""cuBLAS decode products at the 3B shape against the number of rows M: 36 layers' weights (cold) or one
weight 36 times (hot, L2-resident), captured in one CUDA graph; µs per product.
Usage (CUDA): python scripts/rows_micro.py OUT.json"""

import json
import sys

import torch
import torch.nn.functional as F
from blas_micro import timed

SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "down": (2048, 11008)}


def main(out: str) -> None:
    res = {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(36)]
        for m in (8, 16, 32, 64, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cold = timed(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            hot = timed(lambda x=x, ws=ws: [F.linear(x, ws[0]) for _ in ws])
            res[f"{name}/M{m}"] = {"cold": cold, "hot": hot}
            print(name, m, round(cold, 2), round(hot, 2), flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
