"""Cache-aware prefill placement: each candidate worker's predicted time to the end of the prompt's prefill,
from the prefix index and rates measured on the mesh. Pure: no sockets, no clock reads.

    predicted_s = queued_tokens / rate + uncached_tokens / rate + Σ_tier cached_tokens[tier] × fetch_s_per_token[tier]

* `queued_tokens`: the worker's prompt tokens still to compute (`Instance.queued_tokens`; the router charges
  each job it sends by its predicted *uncached* tokens, so queued cache hits are not counted as work).
* `rate`: the worker's prefill throughput: what its heartbeats report (tokens per second of engine step,
  measured over steps that computed a block or more), else an EWMA over its PrefillDone reports of
  computed tokens (prompt − cached) per second (prefill_s − fetch_s, which includes waiting in the
  worker's queue, so it underestimates a busy worker), else a configured prior.
* `cached_tokens`: the blocks the worker would find — the leading run in its own device pool or being computed
  there by a prefill this router sent (`Instance.computing`: the worker's scheduler makes a request wait for a
  prefix another one is computing, and that wait is in `queued_tokens`), then the run its cache daemon holds
  (host DRAM, then disk) — in tokens, capped so the prompt's last token is always computed (its logits give
  the first output token). So two requests with one new prefix arriving together go to one worker, the second
  reusing the first's blocks, unless its queue costs more than computing the prefix again elsewhere.
* `fetch_s_per_token`: per tier, an EWMA over PrefillDone's fetch_s per token loaded from the daemon; the
  device tier costs nothing (those blocks are in the worker's own pool). One fetch_s covers both daemon
  tiers: a report with both is split in proportion to the current estimates.

Conditional disaggregation: where the placement is a prefill/decode pair, the request may instead prefill on
the decode worker it will decode on (a decode worker runs a job sent to it to the end, as a co-located one
does). Remote costs the prefill worker's predicted time plus the KV handoff (`handoff_s_per_block`, an EWMA
over PrefillDone's handoff_s per block of prompt); local costs the decode worker's predicted time (its own
device-cached prefix, the prompt tokens already queued on it, at the rate its own prefills taught, else the
prefill worker's). Local wins when what the request gains there (remote − local) pays for the stall it
causes — each of the decode worker's running streams waits about as long as the local prefill computes — and
it computes at most `local_prefill_max_tokens` there: short or mostly cached prompts on a quiet decode worker,
or any short prompt behind a long prefill queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from deepinfer.cache.prefix_index import DAEMON_TIERS, DEVICE, DISK, HOST, TIERS, PrefixIndex
from deepinfer.protocol.messages import PrefillDone
from deepinfer.services.router_placement import PREFILL, WORKER, Instance, InstanceTable, Placement
from deepinfer.services.router_state import CACHE_AWARE, RouterConfig


@dataclass(frozen=True)
class Prediction:
    """What placing one prompt on one worker is expected to cost."""

    worker: str
    blocks: dict[str, int]  # leading blocks of the prompt expected cached there, by tier
    cached_tokens: dict[str, int]  # the same in tokens, capped at prompt − 1 in all
    uncached_tokens: int  # prompt tokens to compute
    seconds: float  # queue ahead + compute + fetch
    rate: float  # the prefill tokens/s the prediction assumed

    @property
    def cached_blocks(self) -> int:
        return sum(self.blocks.values())


PREFILL_ROLES = frozenset({PREFILL, WORKER})  # the roles that prefill prompts
Chosen = tuple[Placement, Prediction]  # a placement and the prediction for its prefill worker


def ewma(old: float, sample: float, alpha: float) -> float:
    return old + alpha * (sample - old)


class PrefillCostModel:
    """The prefix index plus the measured rates; predicts and learns."""

    def __init__(self, config: RouterConfig) -> None:
        self.cache_aware = config.placement == CACHE_AWARE
        self.block_size = config.block_size
        self.alpha = config.estimate_alpha
        self.prior_rate = config.prior_prefill_tokens_per_s
        self.index = PrefixIndex(config.kv_resync_interval_s)
        self.rates: dict[str, float] = {}  # worker name → prefill tokens/s; kept across its restarts (same machine)
        self.fetch_s_per_token = {
            DEVICE: 0.0,
            HOST: config.prior_host_fetch_s_per_token,
            DISK: config.prior_disk_fetch_s_per_token,
        }
        self.local_prefill_max_tokens = config.local_prefill_max_tokens if self.cache_aware else 0
        self.always_local = config.prefill_site == "local"
        self.handoff_s_per_block = config.prior_handoff_s_per_block

    def rate(self, worker: str) -> float:
        return self.rates.get(worker, self.prior_rate)

    def predict(self, inst: Instance, block_hashes: Sequence[bytes], prompt_tokens: int,
                rate: float | None = None) -> Prediction:
        """`rate`: the worker's prefill tokens/s, by default its measured or learnt one."""
        blocks = self.index.cached_by_tier(block_hashes, inst.name, inst.kvcache, inst.computing)
        budget = max(prompt_tokens - 1, 0)
        cached: dict[str, int] = {}
        for tier in TIERS:  # fastest first, so the cap trims the slowest tier
            cached[tier] = min(blocks[tier] * self.block_size, budget)
            budget -= cached[tier]
        uncached = prompt_tokens - sum(cached.values())
        if rate is None:
            measured = inst.load.tokens_per_s if inst.load is not None else 0.0
            rate = measured if measured > 0 else self.rate(inst.name)
        fetch = sum(n * self.fetch_s_per_token[t] for t, n in cached.items())
        seconds = (inst.queued_tokens + uncached) / rate + fetch
        return Prediction(inst.name, blocks, cached, uncached, seconds, rate)

    def choose(
        self,
        table: InstanceTable,
        block_hashes: Sequence[bytes],
        prompt_tokens: int,
        max_tokens: int,
        now: float,
        exclude: Iterable[str] = (),
    ) -> Chosen | None:
        """Where to send an encoded prompt — by least predicted time when `cache_aware`, else by the table's
        least-loaded rule; for a P/D pair, its decode worker instead where conditional disaggregation says so
        (above) — and the prediction for the worker that prefills it (for the job's expected_cached_blocks and
        the index's accuracy)."""
        predictions: dict[str, Prediction] = {}

        def predicted_s(inst: Instance) -> float:
            p = predictions[inst.name] = self.predict(inst, block_hashes, prompt_tokens)
            return p.seconds

        placement = table.place(prompt_tokens, max_tokens, now, exclude, predicted_s if self.cache_aware else None)
        if placement is None:
            return None
        chosen = placement.prefill
        remote = predictions.get(chosen.name) or self.predict(chosen, block_hashes, prompt_tokens)
        if chosen is placement.decode or not (self.local_prefill_max_tokens or self.always_local):
            return placement, remote
        decode = placement.decode
        # A decode worker's heartbeat rate times its decode steps, not prefill: until its own prefills taught
        # one, it is taken to prefill as fast as the prefill worker it would stand in for.
        local = self.predict(decode, block_hashes, prompt_tokens, self.rates.get(decode.name, remote.rate))
        if self.always_local:
            return Placement(decode, decode), local
        gain = remote.seconds + table.blocks_for(prompt_tokens) * self.handoff_s_per_block - local.seconds
        # What the request gains locally must pay for what its prefill costs the decode worker's running
        # streams: each waits about as long as that prefill computes.
        stall = decode.batch * local.uncached_tokens / local.rate
        if local.uncached_tokens <= self.local_prefill_max_tokens and gain >= stall:
            return Placement(decode, decode), local
        return placement, remote

    def backlog_s(self, table: InstanceTable, unplaced_tokens: int, now: float) -> float | None:
        """The predicted wait of a request arriving now before its prefill starts: every prompt token ahead of
        it — queued on the live prefill-capable workers, and `unplaced_tokens` the router holds that no worker
        has yet (tokenizing, or waiting for a worker) — over those workers' summed prefill rates, as the
        placement balances them. None with no live prefill-capable worker."""
        tokens, rate = unplaced_tokens, 0.0
        for inst in table.instances.values():
            if inst.role in PREFILL_ROLES and inst.placeable(now, table.heartbeat_timeout_s):
                measured = inst.load.tokens_per_s if inst.load is not None else 0.0
                rate += measured if measured > 0 else self.rate(inst.name)
                tokens += inst.queued_tokens
        return tokens / rate if rate > 0 else None

    def observe(self, done: PrefillDone) -> None:
        """Learn from a finished prefill. Reports without timings (0 s) teach nothing."""
        computed = done.num_prompt_tokens - done.num_cached_tokens
        compute_s = done.prefill_s - done.fetch_s - done.handoff_s
        if done.handoff_s > 0:
            blocks = -(-done.num_prompt_tokens // self.block_size)
            self.handoff_s_per_block = ewma(self.handoff_s_per_block, done.handoff_s / blocks, self.alpha)
        # Below a block of computed tokens the time is mostly fixed overhead, not throughput.
        if computed >= self.block_size and compute_s > 0:
            rate = self.rate(done.prefill_worker)
            self.rates[done.prefill_worker] = ewma(rate, computed / compute_s, self.alpha)
        loaded = {t: done.cached_by_tier.get(t, 0) for t in DAEMON_TIERS if done.cached_by_tier.get(t, 0) > 0}
        if not loaded or done.fetch_s <= 0:
            return
        # Split fetch_s across the tiers as the current estimates would: per token of tier t that is
        # fetch_s × cost_t / Σ n_u × cost_u (just fetch_s / n_t for a single tier).
        expected = sum(n * self.fetch_s_per_token[t] for t, n in loaded.items())
        if expected > 0:
            per_token = {t: done.fetch_s * self.fetch_s_per_token[t] / expected for t in loaded}
        else:  # every prior is 0: share alike
            per_token = dict.fromkeys(loaded, done.fetch_s / sum(loaded.values()))
        for tier, sample in per_token.items():
            self.fetch_s_per_token[tier] = ewma(self.fetch_s_per_token[tier], sample, self.alpha)
