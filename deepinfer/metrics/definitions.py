"""Every metric DeepInfer exports, in one place. Names follow vLLM's where one exists, under `deepinfer_`.

Labels: `service` (the role: router, tokenizer, worker / prefill / decode, kvcache, balancer) and `instance`
(the process's mesh name) keep one process's values apart from another's; the other labels take values
from small fixed sets (a finish reason, an error code, a cache tier, a transfer path, a worker group and
its ranks, an HTTP endpoint): never a request id or anything else unbounded.

Multiprocess behaviour (see the package docstring): counters and histograms add up over processes.
Gauges say how in `multiprocess_mode`: "livesum" for amounts (running, waiting, blocks, bytes) — each
process reports its own labelled share, and the share of a process that exited disappears once the
supervisor calls `process_exited`; "livemax" where a sum means nothing (a placement version, a ratio).

Nothing here holds a value: every metric has labels, and a sample's storage is made when a recorder binds
its labels (`deepinfer.metrics.recorders`), after `sync_value_class()`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

# The `_created` series of each counter and histogram: the multiprocess collector never exports them, so a
# single process does not either (one set of series, whichever way a mesh runs).
disable_created_metrics()

# vLLM's buckets, with finer steps at the low end for small models and CPU hosts.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

WHO = ("service", "instance")  # the process a value comes from

# --- requests, recorded at the router from each RequestFinished / ErrorReply sent to a client -----------

TIME_TO_FIRST_TOKEN = Histogram(
    "deepinfer_time_to_first_token_seconds", "Arrival at the router to the first text sent to the client.",
    WHO, buckets=TTFT_BUCKETS)
INTER_TOKEN_LATENCY = Histogram(
    "deepinfer_inter_token_latency_seconds",
    "Mean time per output token after the first, one observation per finished request (vLLM: "
    "time_per_output_token).", WHO, buckets=ITL_BUCKETS)
E2E_REQUEST_LATENCY = Histogram(
    "deepinfer_e2e_request_latency_seconds", "Arrival at the router to the request's end.", WHO,
    buckets=E2E_BUCKETS)
REQUEST_QUEUE_TIME = Histogram(
    "deepinfer_request_queue_time_seconds", "Arrival at the router to its prefill job being sent.", WHO,
    buckets=E2E_BUCKETS)
REQUEST_PREFILL_TIME = Histogram(
    "deepinfer_request_prefill_time_seconds", "Prefill compute, as the prefill worker reported it.", WHO,
    buckets=E2E_BUCKETS)
PROMPT_TOKENS = Counter("deepinfer_prompt_tokens", "Prompt tokens of finished requests.", WHO)
GENERATION_TOKENS = Counter("deepinfer_generation_tokens", "Tokens generated for finished requests.", WHO)
REQUEST_SUCCESS = Counter("deepinfer_request_success", "Requests ended by RequestFinished, by finish reason.",
                          (*WHO, "finished_reason"))
REQUEST_ERRORS = Counter("deepinfer_request_errors",
                         "Requests ended by an ErrorReply to the client (refused at arrival or failed), by code.",
                         (*WHO, "code"))
PREFIX_CACHE_QUERIES = Counter(
    "deepinfer_prefix_cache_queries", "Prompt tokens of finished requests, each looked up in the prefix cache.", WHO)
PREFIX_CACHE_HITS = Counter(
    "deepinfer_prefix_cache_hits",
    "Prompt tokens found cached, by the tier their KV came from (device, host, disk); hits{tier} / queries is "
    "that tier's share of the hit rate.", (*WHO, "tier"))

# --- the router ---------------------------------------------------------------------------------------------

ROUTER_INFLIGHT = Gauge(
    "deepinfer_router_requests_inflight",
    "Requests admitted and not ended yet, by phase: tokenizing, parked (waiting for a live worker), prefilling, "
    "decoding, finishing.", (*WHO, "phase"), multiprocess_mode="livesum")
ROUTER_EVENTS = Counter(
    "deepinfer_router_events",
    "Router events by kind: admitted, retries, moves, stale, kv_events, resyncs, forged, malformed, "
    "refused_deltas (text of a request from another worker than its own), handoffs_adopted (a request whose "
    "prefill worker was lost after its KV reached the decode worker, decoding on), drains_begun, drains_finished "
    "and drains_timed_out (members that drained, and those that left still holding requests: moved, cause drain).",
    (*WHO, "event"))
ROUTER_REFUSED_MESSAGES = Counter(
    "deepinfer_router_refused_messages",
    "Client messages the router's front refused on decoding, by the reply's code: request_too_large (over the "
    "client limits), invalid_request (malformed, answered by its request id), bad_message (no request id could be "
    "read). The connection they came on is kept.", (*WHO, "code"))
ROUTER_SHED = Counter(
    "deepinfer_router_shed",
    "Requests refused with overloaded instead of queueing, by cause: predicted_wait (the prefill backlog's "
    "predicted wait over max_queue_wait_s), queue_requests, queue_tokens, tenant_inflight, tenant_tokens, draining, "
    "ttft_slo (the predicted time to first token over the request's SLO), tpot_slo (every decode worker predicted, "
    "with the request, to give tokens slower than its TPOT SLO or one promised to a stream there).",
    (*WHO, "cause"))
ROUTER_MIGRATIONS = Counter(
    "deepinfer_router_migrations",
    "Requests placed anew on other workers, by cause: prefill_death, decode_death, worker_death, "
    "tokenizer_death, handoff_failure (a prefill or KV handoff failed without a death), drain.", (*WHO, "cause"))
TTFT_PREDICTION_RATIO = Histogram(
    "deepinfer_router_ttft_over_predicted",
    "Per request, its actual time to first token over the one predicted at its first placement (the wait so far "
    "plus the worker's predicted queue, fetch and compute; what TTFT SLOs are enforced with): 1 is exact.",
    WHO, buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0))
TPOT_PREDICTION_RATIO = Histogram(
    "deepinfer_router_tpot_over_predicted",
    "Per finished request, its actual time per output token over the one predicted at its first placement (its "
    "decode worker's measured cadence with one more stream; what TPOT SLOs are enforced with): 1 is exact.",
    WHO, buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0))
ROUTER_PREFILL_SITES = Counter(
    "deepinfer_router_prefill_sites",
    "Requests with a prefill/decode pair to choose from, by where they were prefilled: remote (a prefill worker, "
    "then the KV handoff) or local (on their decode worker: conditional disaggregation, local_prefill_max_tokens).",
    (*WHO, "site"))
ROUTER_RESUMES = Counter(
    "deepinfer_router_resumes",
    "Client resumes after a lost connection (router_resume), by case: attached (this router held the request), "
    "reclaimed (the worker that kept it through a router restart goes on with it), readmitted (computed again), "
    "reclaim_refused (that worker no longer had it: computed again), refused.", (*WHO, "case"))
ROUTER_SLOW_CLIENTS = Gauge("deepinfer_router_slow_clients", "Clients whose messages wait in a backlog.", WHO,
                            multiprocess_mode="livesum")
MESH_LIVE_INSTANCES = Gauge("deepinfer_router_live_instances", "Mesh members the router sees alive, by role.",
                            (*WHO, "role"), multiprocess_mode="livesum")

# --- workers (service: worker, prefill or decode) -----------------------------------------------------------

NUM_REQUESTS_RUNNING = Gauge("deepinfer_num_requests_running", "Sequences in the running batch.", WHO,
                             multiprocess_mode="livesum")
NUM_REQUESTS_WAITING = Gauge("deepinfer_num_requests_waiting", "Requests queued, not yet running.", WHO,
                             multiprocess_mode="livesum")
QUEUED_PROMPT_TOKENS = Gauge("deepinfer_queued_prompt_tokens", "Prompt tokens admitted and not computed yet.", WHO,
                             multiprocess_mode="livesum")
KV_BLOCKS_USED = Gauge("deepinfer_kv_blocks_used", "KV blocks of the device pool in use.", WHO,
                       multiprocess_mode="livesum")
KV_BLOCKS_FREE = Gauge("deepinfer_kv_blocks_free", "KV blocks of the device pool free.", WHO,
                       multiprocess_mode="livesum")
KV_CACHE_USAGE = Gauge("deepinfer_kv_cache_usage_perc", "Share of the device KV pool in use (1 = full).", WHO,
                       multiprocess_mode="livemax")
NUM_PREEMPTIONS = Counter("deepinfer_num_preemptions", "Sequences preempted (their KV swapped out or recomputed).",
                          WHO)
NUM_SWAPPED_PREEMPTIONS = Counter("deepinfer_num_swapped_preemptions",
                                  "Preemptions that copied the KV to host memory, predicted cheaper than recomputing.",
                                  WHO)
STEP_DURATION = Histogram("deepinfer_worker_step_duration_seconds", "Wall time of one engine step.", WHO,
                          buckets=STEP_BUCKETS)
STEP_BATCH_SIZE = Histogram("deepinfer_worker_step_batch_size", "Requests given new tokens by one engine step.",
                            WHO, buckets=BATCH_BUCKETS)
STEP_TOKENS = Histogram("deepinfer_worker_step_tokens", "Tokens computed by one engine step (vLLM: "
                        "iteration_tokens).", WHO, buckets=STEP_TOKEN_BUCKETS)
SPEC_DRAFT_TOKENS = Counter("deepinfer_spec_decode_num_draft_tokens", "Draft tokens verified.", WHO)
SPEC_ACCEPTED_TOKENS = Counter("deepinfer_spec_decode_num_accepted_tokens", "Draft tokens accepted.", WHO)
KV_TRANSFER_BYTES = Counter(
    "deepinfer_kv_transfer_bytes",
    "KV bytes moved: handoff_send / handoff_recv (prefill to decode), cache_fetch / cache_store (cache daemon), "
    "swap_out / swap_in (preempted requests to host memory and back).",
    (*WHO, "path"))
KV_TRANSFER_SECONDS = Histogram(
    "deepinfer_kv_transfer_seconds",
    "One KV move: handoff_send from KvTransfer sent to KvAck; cache_fetch, a prefix loaded from the daemon.",
    (*WHO, "path"), buckets=TRANSFER_BUCKETS)

CACHE_FETCH_PLANS = Counter(
    "deepinfer_cache_fetch_plans",
    "A worker's prefixes past its device pool, by what it chose (cache.fetch_plan): faster (fetched), slower "
    "(computed: fetching was predicted slower), probe (slower, fetched to measure again), unmeasured (fetched "
    "before its prefill rate was known), miss (the cache daemon held none), always (fetched without a plan: "
    "fetch_policy = always).",
    (*WHO, "decision"))

# --- the cache daemon ---------------------------------------------------------------------------------------

CACHE_TIER_BLOCKS = Gauge("deepinfer_cache_tier_blocks", "Blocks held by a cache daemon tier.", (*WHO, "tier"),
                          multiprocess_mode="livesum")
CACHE_TIER_BYTES = Gauge("deepinfer_cache_tier_bytes", "Bytes held by a cache daemon tier.", (*WHO, "tier"),
                         multiprocess_mode="livesum")
CACHE_TIER_CAPACITY = Gauge("deepinfer_cache_tier_capacity_bytes", "A cache daemon tier's capacity.",
                            (*WHO, "tier"), multiprocess_mode="livesum")
CACHE_EVICTIONS = Counter("deepinfer_cache_evictions", "Blocks evicted from a cache daemon tier.", (*WHO, "tier"))
CACHE_LOOKUPS = Counter("deepinfer_cache_lookups", "Block reads of a cache daemon tier, by result (hit, miss).",
                        (*WHO, "tier", "result"))
CACHE_REFUSED = Counter("deepinfer_cache_refused",
                        "Cache daemon requests refused, by reason: namespace (a lookup, fetch or store naming "
                        "another namespace than the daemon's), kv (a store whose KV or hashes do not fit).",
                        (*WHO, "reason"))
CACHE_PENDING_WRITES = Gauge("deepinfer_cache_pending_writes", "Blocks queued for the disk tier.", WHO,
                             multiprocess_mode="livesum")
CACHE_DISK_WRITE_ERRORS = Counter("deepinfer_cache_disk_write_errors",
                                  "Block writes the disk tier failed, by cause: no_space (ENOSPC, EDQUOT: the pool "
                                  "is full), io (any other: a read-only or vanished mount, a failing device). The "
                                  "blocks stay in host DRAM; requests are not affected.", (*WHO, "cause"))

# --- expert parallelism (recorded at the router from each group's ExpertLoad) -------------------------------

EXPERT_RANK_TOKENS = Counter(
    "deepinfer_expert_rank_tokens", "Tokens a worker group's rank computed (its attention load).",
    (*WHO, "group", "rank"))
EXPERT_RANK_ASSIGNMENTS = Counter(
    "deepinfer_expert_rank_assignments",
    "Token-to-expert assignments a rank's experts computed, summed over MoE layers (its expert load).",
    (*WHO, "group", "rank"))
EXPERT_LOAD_MAX_OVER_MEAN = Gauge(
    "deepinfer_expert_load_max_over_mean",
    "Mean over MoE layers of the busiest rank's expert load over the mean rank's, in the last report.",
    (*WHO, "group"), multiprocess_mode="livemax")
EXPERT_PLACEMENT_VERSION = Gauge("deepinfer_expert_placement_version", "The expert placement a group runs.",
                                 (*WHO, "group"), multiprocess_mode="livemax")
BALANCER_DECISIONS = Counter("deepinfer_balancer_decisions",
                             "Placement decisions by outcome: sent, adopted, abandoned.", (*WHO, "outcome"))

# --- every service --------------------------------------------------------------------------------------------

SERVICE_UP = Gauge("deepinfer_service_up", "1 while the service serves.", WHO, multiprocess_mode="livesum")
SERVICE_PROGRESS = Counter("deepinfer_service_progress",
                           "Work done: engine steps (workers) or messages handled (tokenizers).", WHO)
MALFORMED_MESSAGES = Counter("deepinfer_malformed_messages", "Messages dropped as malformed.", WHO)

# --- the HTTP gateway -----------------------------------------------------------------------------------------

HTTP_REQUESTS = Counter("deepinfer_http_requests", "HTTP requests answered, by endpoint and status code.",
                        ("endpoint", "status"))
HTTP_REQUEST_DURATION = Histogram("deepinfer_http_request_duration_seconds",
                                  "HTTP request to the end of its response, by endpoint.", ("endpoint",),
                                  buckets=HTTP_BUCKETS)
HTTP_REFUSALS = Counter("deepinfer_http_refusals",
                        "HTTP requests the gateway refused, or connections and streams it ended, by cause (the "
                        "fixed set deepinfer.gateway.limits.REFUSAL_CAUSES: body_too_large, header_timeout, "
                        "slow_client, ...).", ("cause",))
