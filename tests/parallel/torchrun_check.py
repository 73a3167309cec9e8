"""Run by tests/parallel/test_torchrun.py under ``torchrun --nproc-per-node 2``: the real start-up path
(``init_parallel`` from torchrun's environment; NCCL and bfloat16 on GPUs, gloo and float32 on the
CPU), tensor parallelism 2 over tiny-tp with one shared actor copy for rollout TP 1, a refresh after an
in-place update, the sampling race, and ``guard``. Prints one line ``rank R ok`` per rank."""

from __future__ import annotations

import torch

from rollplex.config import ParallelConfig
from rollplex.models.presets import init_model
from rollplex.parallel.dist import close_parallel, guard, init_parallel
from rollplex.parallel.layout import shard_index
from rollplex.parallel.tensor_parallel import shard_model
from rollplex.parallel.weight_sharing import SharedWeights


def main() -> None:
    ctx = init_parallel(ParallelConfig(tp_train=2, tp_rollout=1))
    cuda = ctx.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    with guard(ctx, "check"):
        model = init_model("tiny-tp", seed=0, dtype=dtype, device=ctx.device)
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        shapes = shard_model(model, ctx.train_tp)
        shared = SharedWeights(model, ctx.train_tp, ctx.share, ctx.rollout_tp)
        layer = model.model.language_model.layers[0]
        q = layer.self_attn.q_proj.weight
        views = shared.fused_views(0)
        assert q.untyped_storage().data_ptr() == views.qkv.untyped_storage().data_ptr()
        with torch.no_grad():
            q.add_(1.0 + ctx.rank)  # this rank's training shard, in place
        shared.refresh()
        name = "model.language_model.layers.0.self_attn.q_proj.weight"
        want = full[name].clone()
        for t in range(2):
            want[shard_index(name, shapes[name], 2, t)] += 1.0 + t
        assert torch.equal(views.qkv[: want.shape[0]], want), "rollout q rows after refresh"
        head = model.rollplex_tp
        logits = head.logits(
            torch.randn(4, 128, generator=torch.Generator().manual_seed(1)).to(ctx.device, dtype)
        )
        tokens, _ = head.sample(logits, torch.Generator(ctx.device).manual_seed(3), temperature=0.8,
                                banned_ids=torch.tensor([435, 436]), top_p=1.0, top_k=0)  # fmt: skip
        gathered = torch.empty(2, *tokens.shape, dtype=tokens.dtype, device=tokens.device)
        ctx.world_comm.all_gather_into(gathered, tokens)
        assert torch.equal(gathered[0], gathered[1]), "every rank of the group samples the same tokens"
    print(f"rank {ctx.rank} ok", flush=True)
    close_parallel(ctx)


if __name__ == "__main__":
    main()
