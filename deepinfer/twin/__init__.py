"""The cluster twin: the mesh's real decision cores on a virtual clock, with cost models for the work.

Real (the same objects the services run; a change to their code changes the twin):
  RouterCore (admission, placement, prefix index, moves, deadlines) · WorkerCore · Scheduler · BlockPool ·
  Request and its hash chain · DevicePrefixCache imports · Stage · FetchPlanner · TieredStore (host and disk
  tiers, write-behind queue, events) · KvEventPublisher · CadenceMeter · EngineThread's rate EWMA · hash_blocks.
Cost models (`costs.CostModel`, calibrated per machine by bench/twin_calibrate.py): an engine step's time, a
  message hop, a KV transfer by bytes and transport, tier reads and writes by bytes.
Stand-ins: sockets (a hop each), the tokenizer (prompts come as token ids: it hashes them), sampling (token
  0; requests end at max_tokens, as the replay's ignore_eos requests do), the KV bytes (tiny payloads in
  stores scaled to hold as many blocks).

Modules: events (the clock), costs (cost records, versioned files in costs/), worker (a co-located worker),
cache (the cache daemon), cluster (the router and the wiring; ClusterTwin.replay). bench/twin_replay.py runs
bench_replay's workload through it and writes bench_replay's JSON.

Not yet: P/D pairs (KV handoff), speculation, swap, worker groups and the expert balancer, faults.
"""
