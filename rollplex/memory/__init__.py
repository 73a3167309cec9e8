"""Memory residency (paper §3.2, Appendix Table 3): where every class of state lives in each window of
an iteration, and the machinery that moves it.

Modules:
    windows         the windows of an iteration (rollout, scoring, backward, update) and the state classes
    shapes          a Qwen2.5-VL model's sizes and parameters per tensor-parallel rank
    planner         per-class GiB per window, the naive total, the moves that fit a budget (``MemoryPlan``)
    plan_command    the body of ``rollplex plan``
    host_pool       the pinned host pool: one exact-size page-locked allocation, named views, arenas
    transfers       the load and offload streams, their events and bytes moved per class
    chunked_adamw   ``ChunkedAdamW``: FP32 masters and Adam moments per chunk on the device or in the pool
    paging          ``PagedModule``: the reference's parameters released and restored in place
    saved_offload   ``SavedTensorOffload``: the actor prefix's saved tensors to the pool and back
    residency       ``Residency``: the one owner of the pool, the streams, paging, offload and counters

Integration into the step (the schedule and loop; each call on the compute stream, in this order):

    start-up   plan = plan_memory(...)                       # or plan_command.plan_config(cfg, inputs)
               residency = Residency.from_plan(plan, device)
               if plan.reference_paging == "paged": residency.page("reference", reference_model)
               offload = residency.saved_offload(actor, plan.activation_arena_bytes) if plan.offload_activations
               optimizer = ChunkedAdamW.for_model(actor, cfg.optim, chunk_mib=cfg.memory.chunk_mib,
                   host_bytes=plan.optimizer_host_bytes, pool=residency.pool, transfers=residency.transfers)
               residency.track_optimizer(optimizer); residency.track(tag, probe) for rollout_kv, grads, ...
    Phase 1    residency.enter("rollout"); residency.wait("reference") before the reference prefix;
               each actor prefix group g inside ``offload.group(g)``
    Phase 2    residency.enter("scoring"); residency.wait("reference"); reference suffix scoring
               residency.enter("backward"); per micro-batch: offload.prefetch(g) for its groups, suffix
               forward + backward, offload.release(g)
    Phase 3    residency.enter("update"); optimizer.clip_and_step(cfg.optim.max_grad_norm)
    step end   residency.end_step(); the trace gets residency.counter_events(origin)

``memory.runtime`` builds all of this for ``loop.train`` and ``rollplex bench`` from the plan.
"""
