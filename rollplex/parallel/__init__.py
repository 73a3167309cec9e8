"""Multi-GPU rollplex: SPMD processes under torchrun, tensor and data parallelism, one physical actor copy.

dist            process groups (training TP, rollout TP, share, data parallel), start-up checks,
                the writer rank, failures named by rank
layout          the one table of TP placements of every Qwen2.5-VL parameter
tensor_parallel Megatron-style sharding of the transformers model (column/row parallel, f and g)
vocab_parallel  log-probs, entropy and sampling over vocabulary shards; the model-side hook
weight_sharing  rollout-sized buffers with training shards as views (paper §3.3 Cases 1/2/3)
data_parallel   whole groups per replica, gradient all-reduce, ZeRO-1 ownership, metric reduction
optimizer       the actor's optimizer step under torchrun: ZeRO-1 ChunkedAdamW, the global norm
engines         rollout over several processes: which engine decodes which groups, from which boundary
disaggregated   the Disagg baseline's weight hand-over from the training to the rollout GPUs
runtime         all of it in a run: what the loop, the phases and the schedules call (docs/parallelism.md)
"""
