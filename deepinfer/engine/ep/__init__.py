"""Expert parallelism: one MoE model's experts spread over a group of processes (ranks).

* `placement` — which rank holds which expert (pure data, versioned, dict round-trip);
* `group` — the torch.distributed groups of one rank (`init_ep_group`, `EpGroup`);
* `ep_moe` — the executor that sends tokens to their experts' ranks and sums the results back,
  and `shard_experts`, which installs it in a built model;
* `expert_move` — moving a serving group to a new placement: each rank stages the incoming experts in
  the background (from the model files, digest-checked), then every rank switches at the same round.

`LLMEngine(..., ep_group=group)` is the way in: see `deepinfer.engine.engine`.
"""
