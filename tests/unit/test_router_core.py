"""RouterCore driven directly with messages and a fake clock: admission, placement, streaming, usage and
timings, liveness, stale messages, and exactly one terminal message per admitted request."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.cache.hashing import CacheNamespace, HashKeys, hash_blocks
from deepinfer.protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    EncodeRequest,
    EncodeResult,
    ErrorReply,
    GenerateRequest,
    Heartbeat,
    Hello,
    KvEvents,
    KvResync,
    LogprobWire,
    PrefillDone,
    PrefillJob,
    RequestFinished,
    SamplingParamsWire,
    ServiceExited,
    StreamDelta,
    TextDeltaItem,
    TextDeltas,
)
from deepinfer.services.router import MeshPins
from deepinfer.services.router_admission import UNPLACED
from deepinfer.services.router_core import Outbound, Phase, RouterConfig, RouterCore

C1, C2 = b"client-1", b"client-2"


class Mesh:
    """A router core plus the heartbeats of a set of fake instances."""

    def __init__(self, config: RouterConfig | None = None, **instances: str) -> None:
        self.core = RouterCore(config or RouterConfig(heartbeat_timeout_s=3.0))
        self.seq: dict[str, int] = {}
        self.inc: dict[str, str] = {}
        self.now = 0.0
        self.n = 0
        for name, role in instances.items():
            self.beat(name, role)

    def beat(self, name: str, role: str, incarnation: str | None = None, **load: Any) -> list[Outbound]:
        if incarnation is not None and incarnation != self.inc.get(name):
            self.inc[name], self.seq[name] = incarnation, 0
        self.inc.setdefault(name, "i0")
        self.seq[name] = self.seq.get(name, 0) + 1
        load.setdefault("free_blocks", 1000)
        load.setdefault("progress", self.seq[name])
        hb = Heartbeat(role, name, self.inc[name], self.seq[name], total_blocks=1000, **load)
        return self.core.on_heartbeat(hb, self.now)

    def generate(self, client: bytes = C1, rid: str | None = None, n: int = 10, **kw: Any) -> list[Outbound]:
        if rid is None:
            self.n += 1
            rid = f"c{self.n}"
        kw.setdefault("prompt_token_ids", list(range(100, 100 + n)) if "prompt" not in kw else None)
        return self.core.on_generate(client, GenerateRequest(rid, **kw), self.now)

    def admit(self, client: bytes = C1, **kw: Any) -> EncodeRequest:
        [out] = self.generate(client, **kw)
        assert isinstance(out.msg, EncodeRequest), out
        return out.msg

    def encoded(self, enc: EncodeRequest, n: int | None = None, hashes: list[bytes] | None = None) -> list[Outbound]:
        ids = enc.prompt_token_ids if n is None else list(range(n))
        sender = self.core.request(enc.request_id).where.tokenizer
        result = EncodeResult(enc.request_id, ids or [1], hashes or [])
        return self.core.on_encode_result(sender, result, self.now)

    def placed(self, client: bytes = C1, **kw: Any) -> PrefillJob:
        [out] = self.encoded(self.admit(client, **kw))
        assert isinstance(out.msg, PrefillJob)
        return out.msg

    def done(self, job: PrefillJob, dest: str | None = None, **kw: Any) -> list[Outbound]:
        worker = dest or self.core.request(job.request_id).where.prefill
        kw.setdefault("num_cached_tokens", 0)
        return self.core.on_prefill_done(PrefillDone(job.request_id, worker, len(job.token_ids), **kw), self.now)

    def deltas(self, *items: TextDeltaItem, tokenizer: str = "tok0", worker: str | None = None) -> list[Outbound]:
        return self.core.on_text_deltas(tokenizer, TextDeltas(tokenizer, list(items), worker), self.now)


def msgs(out: list[Outbound], kind: type | None = None) -> list[Any]:
    return [o.msg for o in out if kind is None or isinstance(o.msg, kind)]


def dests(out: list[Outbound], kind: type) -> list[str | bytes]:
    return [o.dest for o in out if isinstance(o.msg, kind)]


def assert_clean(core: RouterCore) -> None:
    """Nothing in flight, and every piece of accounting back to zero."""
    assert core.num_inflight == 0 and core.queued_requests == 0 and core.queued_tokens == 0
    assert core.unplaced_tokens == 0 and not core._inflight_by_tenant and not core._queued_tokens_by_tenant
    for inst in core.table.instances.values():
        assert not inst.held and inst.prefill_tokens == inst.pending_blocks == inst.assigned == 0, inst.name
        assert not +inst.computing and not +inst.tpot_slos, inst.name
    m = core.metrics
    assert m.admitted == sum(m.finished.values()) + sum(m.errors.values())


def basic_mesh(**kw: Any) -> Mesh:
    config = RouterConfig(**{"heartbeat_timeout_s": 3.0, **kw})
    return Mesh(config, tok0="tokenizer", pre0="prefill", dec0="decode")


# ----- admission -----


def test_queue_limit_by_requests_rejects_exactly_the_excess() -> None:
    mesh = basic_mesh(max_queued_requests=3)
    outs = [mesh.generate() for _ in range(5)]
    assert [type(o[0].msg).__name__ for o in outs] == ["EncodeRequest"] * 3 + ["ErrorReply"] * 2
    refused = outs[3][0].msg
    assert (refused.code, refused.retry_after_s, refused.request_id) == ("overloaded", 1.0, "c4")
    assert mesh.core.metrics.rejected["overloaded"] == 2 and mesh.core.metrics.admitted == 3
    # Decoding requests leave the queue: room for one more.
    [job] = msgs(mesh.encoded(outs[0][0].msg), PrefillJob)
    mesh.done(job)
    assert mesh.core.queued_requests == 2
    assert isinstance(mesh.generate()[0].msg, EncodeRequest)
    assert isinstance(mesh.generate()[0].msg, ErrorReply)


def test_queue_limit_by_prompt_tokens() -> None:
    mesh = basic_mesh(max_queued_prompt_tokens=100)
    assert isinstance(mesh.generate(n=500)[0].msg, EncodeRequest)  # alone in the queue: never refused for size
    assert mesh.generate(n=1)[0].msg.code == "overloaded"
    mesh = basic_mesh(max_queued_prompt_tokens=100)
    results = [mesh.generate(n=40)[0].msg for _ in range(4)]
    assert [type(r).__name__ for r in results] == ["EncodeRequest", "EncodeRequest", "ErrorReply", "ErrorReply"]
    assert "80 prompt tokens" in results[2].message
    assert isinstance(mesh.generate(n=20)[0].msg, EncodeRequest)  # exactly at the limit is fine
    assert mesh.core.queued_tokens == 100


def test_text_prompts_are_estimated_then_counted_exactly() -> None:
    mesh = basic_mesh(max_queued_prompt_tokens=100)
    first = mesh.admit(prompt="x" * 160)  # about 40 tokens
    assert mesh.core.queued_tokens == 40
    second = mesh.admit(prompt="y" * 200)  # about 50
    mesh.encoded(first, n=30)
    assert mesh.core.queued_tokens == 80
    # The exact count breaks the limit while others are queued: refused before any prefill.
    out = mesh.encoded(second, n=90)
    [err] = msgs(out, ErrorReply)
    assert (err.code, err.request_id) == ("overloaded", "c2")
    assert dests(out, AbortRequest) == ["tok0"]
    assert mesh.core.queued_tokens == 30 and mesh.core.num_inflight == 1


def test_phase_counts_follow_requests() -> None:
    mesh = basic_mesh()
    first = mesh.admit(prompt="x" * 100)
    mesh.admit(prompt="y" * 100)
    assert mesh.core.phase_counts() == {"tokenizing": 2}
    mesh.encoded(first, n=30)
    counts = mesh.core.phase_counts()
    assert sum(counts.values()) == 2 and counts["tokenizing"] == 1


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"params": SamplingParamsWire(temperature=-1.0)}, "temperature"),
        ({"params": SamplingParamsWire(max_tokens=0)}, "max_tokens"),
        ({"params": SamplingParamsWire(stop=[""])}, "stop strings"),
        ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt": ""}, "empty"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"rid": ""}, "request_id"),
    ],
)
def test_invalid_requests_are_refused(kw: dict[str, Any], says: str) -> None:
    mesh = basic_mesh()
    [out] = mesh.generate(**kw)
    assert out.dest == C1 and out.msg.code == "invalid_request" and says in out.msg.message
    assert mesh.core.num_inflight == 0 and mesh.core.metrics.rejected["invalid_request"] == 1


def test_duplicate_id_from_the_same_client_is_refused_but_other_clients_may_use_it() -> None:
    mesh = basic_mesh()
    mesh.admit(rid="same")
    [dup] = mesh.generate(rid="same")
    assert dup.msg.code == "invalid_request" and "already in flight" in dup.msg.message
    assert isinstance(mesh.generate(C2, rid="same")[0].msg, EncodeRequest)
    assert mesh.core.num_inflight == 2


def test_tenant_salt_comes_from_the_api_key() -> None:
    mesh = basic_mesh(tenants={"key-a": "salt-a"}, default_cache_salt="public")
    assert mesh.admit(api_key="key-a").cache_salt == "salt-a"
    assert mesh.admit(api_key="unknown").cache_salt == "public"
    assert mesh.admit().cache_salt == "public"
    strict = basic_mesh(tenants={"key-a": "salt-a"}, require_api_key=True)
    assert strict.generate(api_key="nope")[0].msg.code == "unauthorized"
    assert strict.generate()[0].msg.code == "unauthorized"
    assert strict.core.metrics.rejected["unauthorized"] == 2
    enc = strict.admit(api_key="key-a", prompt="hi", params=SamplingParamsWire(stop=["\n\n"], max_tokens=77))
    assert enc.max_tokens == 77  # the tokenizer refuses a budget the context cannot hold
    assert (enc.cache_salt, enc.prompt, enc.stop) == ("salt-a", "hi", ["\n\n"])


def test_without_a_live_tokenizer_or_worker_requests_are_refused() -> None:
    no_tokenizer = Mesh(pre0="prefill", dec0="decode").generate()[0].msg
    assert (no_tokenizer.code, no_tokenizer.message, no_tokenizer.retry_after_s) == ("unavailable", "no live tokenizer",
                                                                                   1.0)
    no_worker = Mesh(tok0="tokenizer", pre0="prefill").generate()[0].msg
    assert no_worker.code == "unavailable" and "no live prefill/decode" in no_worker.message
    mesh = basic_mesh()
    mesh.core.draining = True
    assert mesh.generate()[0].msg.code == "overloaded"


def test_router_ids_are_unique_and_prefixed() -> None:
    mesh = basic_mesh(id_prefix="rt.abc.")
    ids = {mesh.admit(C1, rid="x").request_id, mesh.admit(C2, rid="x").request_id}
    assert ids == {"rt.abc.0", "rt.abc.1"}


# ----- placement -----


def test_tokenizers_are_chosen_round_robin() -> None:
    mesh = Mesh(tok0="tokenizer", tok1="tokenizer", tok2="tokenizer", pre0="prefill", dec0="decode")
    chosen = [mesh.core.request(mesh.admit().request_id).where.tokenizer for _ in range(6)]
    assert chosen == ["tok0", "tok1", "tok2"] * 2


def test_prefill_goes_to_the_least_queued_prompt_tokens() -> None:
    mesh = Mesh(tok0="tokenizer", dec0="decode")
    mesh.beat("pre0", "prefill", queued_prompt_tokens=500)
    mesh.beat("pre1", "prefill", queued_prompt_tokens=100)
    assert mesh.placed(n=1000).decode_worker == "dec0"
    assert mesh.core.request("0").where.prefill == "pre1"
    # Our own accounting is immediate: pre1 now has 1000 tokens queued from us, pre0 reports 500.
    mesh.placed(n=10)
    assert mesh.core.request("1").where.prefill == "pre0"
    assert mesh.core.table.get("pre1").prefill_tokens == 1000
    mesh.done(mesh_job(mesh, "0"))
    assert mesh.core.table.get("pre1").prefill_tokens == 0


def mesh_job(mesh: Mesh, rid: str) -> PrefillJob:
    st = mesh.core.request(rid)
    return PrefillJob(rid, st.prompt_ids, [], st.params, st.where.decode or "", st.where.tokenizer)


def test_decode_worker_by_free_blocks_then_batch() -> None:
    mesh = Mesh(tok0="tokenizer", pre0="prefill")
    mesh.beat("dec0", "decode", free_blocks=5, running=0)
    mesh.beat("dec1", "decode", free_blocks=800, running=30)
    mesh.beat("dec2", "decode", free_blocks=600, running=10)
    # 100 prompt + 16 output tokens = 8 blocks: dec0 cannot hold it; of the others, the smaller batch.
    assert mesh.placed(n=100).decode_worker == "dec2"
    assert mesh.core.table.get("dec2").pending_blocks == 7
    # 9500 + 16 tokens = 595 blocks: only dec1 has room (dec2: 600 - 7 pending).
    assert mesh.placed(n=9500).decode_worker == "dec1"
    # 20000 tokens fit nowhere: the most free blocks, counting what is on its way (dec1: 800 - 594).
    assert mesh.placed(n=20000).decode_worker == "dec2"


def test_co_located_worker_decodes_what_it_prefills() -> None:
    mesh = Mesh(tok0="tokenizer")
    mesh.beat("w0", "worker", queued_prompt_tokens=300)
    mesh.beat("w1", "worker", queued_prompt_tokens=0, free_blocks=2)  # too full for 100 tokens
    mesh.beat("w2", "worker", queued_prompt_tokens=50)
    job = mesh.placed(n=100)
    assert job.decode_worker == "w2" and mesh.core.request(job.request_id).where.prefill == "w2"
    assert (job.detokenizer, job.params, job.priority) == ("tok0", SamplingParamsWire(), 0)


def test_draining_workers_get_nothing_new() -> None:
    mesh = Mesh(tok0="tokenizer", dec0="decode")
    mesh.beat("pre0", "prefill")
    mesh.beat("pre1", "prefill", draining=True, queued_prompt_tokens=0)
    mesh.beat("pre0", "prefill", queued_prompt_tokens=10_000)
    mesh.placed()
    assert mesh.core.request("0").where.prefill == "pre0"


# ----- cache-aware placement and the prefix index -----

NS16 = CacheNamespace("model", "tok", "float32", "layers,kv,block_size,kv_heads,head_dim", block_size=16)


class KvMesh(Mesh):
    """A Mesh whose instances also publish KV events, numbered per publisher as real ones are."""

    def __init__(self, config: RouterConfig | None = None, **instances: str) -> None:
        super().__init__(config, **instances)
        self.kv_seq: dict[str, int] = {}

    def kv(self, publisher: str, tier: str, stored: list[bytes], *, seq: int | None = None, incarnation: str = "i0",
           snapshot: bool = False, sender: str | None = None, evicted: list[bytes] | None = None) -> list[Outbound]:
        seq = self.kv_seq.get(publisher, 0) if seq is None else seq
        self.kv_seq[publisher] = seq + 1
        ev = KvEvents(publisher, incarnation, seq, tier, stored, evicted or [], snapshot)
        return self.core.on_kv_events(sender or publisher, ev, self.now)

    def hello(self, name: str, role: str, **capabilities: str) -> list[Outbound]:
        caps = {"incarnation": self.inc.get(name, "i0"), **capabilities}
        return self.core.on_hello(Hello(2, role, name, capabilities=caps), self.now)

    def job(self, n: int, salt: str | None = None, **kw: Any) -> tuple[PrefillJob, str]:
        """A request of `n` prompt tokens (ids 0..n-1) placed: its job and where it went."""
        enc = self.admit(n=n, **kw)
        ids = list(range(n))
        hashes = hash_blocks(NS16, ids, HashKeys(salt))
        [out] = self.encoded(enc, n=n, hashes=hashes)
        assert isinstance(out.msg, PrefillJob), out
        return out.msg, str(out.dest)


def chain(n: int, salt: str | None = None) -> list[bytes]:
    return hash_blocks(NS16, list(range(n)), HashKeys(salt))


def two_prefills(config: RouterConfig | None = None, a_queue: int = 0, b_queue: int = 100) -> KvMesh:
    mesh = KvMesh(config or RouterConfig(heartbeat_timeout_s=3.0), tok0="tokenizer", dec0="decode")
    mesh.beat("preA", "prefill", queued_prompt_tokens=a_queue)
    mesh.beat("preB", "prefill", queued_prompt_tokens=b_queue)
    return mesh


def test_prefix_on_a_workers_device_wins_over_a_slightly_shorter_queue() -> None:
    mesh = two_prefills()
    assert mesh.kv("preB", "device", chain(640)) == []
    job, dest = mesh.job(640)
    assert dest == "preB" and job.expected_cached_blocks == 40
    # Charged by what it must compute: the whole prompt is cached but its last token.
    assert mesh.core.table.get("preB").prefill_tokens == 1


def test_a_long_enough_queue_outweighs_the_cached_prefix() -> None:
    mesh = two_prefills(b_queue=5000)  # 5000 tokens ahead on B ≈ 8 s; recomputing 640 on A ≈ 1 s
    mesh.kv("preB", "device", chain(640))
    job, dest = mesh.job(640)
    assert dest == "preA" and job.expected_cached_blocks == 0


def test_a_prefix_being_computed_on_a_worker_counts_as_cached_there_until_its_prefill_is_over() -> None:
    mesh = two_prefills()  # A idle, B 100 tokens queued
    first, dest = mesh.job(640)
    assert dest == "preA" and first.expected_cached_blocks == 0
    # The same prompt while A computes it: A's scheduler makes it wait for those blocks, so A's queue (the
    # first prompt) plus one token beats computing all 640 on B. Without the in-flight count B would win.
    second, dest = mesh.job(640)
    assert dest == "preA" and second.expected_cached_blocks == 40
    assert mesh.core.table.get("preA").computing[chain(640)[0]] == 2
    # A queue long enough still outweighs it: 10,000 tokens ahead on A, and B computes the prefix again.
    mesh.beat("preA", "prefill", queued_prompt_tokens=10_000)
    assert mesh.job(640)[1] == "preB"
    # Each prefill over (or ended any other way) takes its blocks off the worker's count.
    for job, worker in ((first, "preA"), (second, "preA")):
        mesh.done(job, worker)
    assert not +mesh.core.table.get("preA").computing
    assert +mesh.core.table.get("preB").computing


def test_least_loaded_placement_ignores_the_cache() -> None:
    mesh = two_prefills(RouterConfig(heartbeat_timeout_s=3.0, placement="least_loaded"))
    mesh.kv("preB", "device", chain(640))
    job, dest = mesh.job(640)
    assert dest == "preA"
    assert mesh.core.table.get("preA").prefill_tokens == 640  # the baseline charges whole prompts
    with pytest.raises(ValueError, match="placement"):
        RouterConfig(placement="random")


def test_daemon_tiers_count_for_the_workers_that_read_from_them() -> None:
    mesh = two_prefills(a_queue=100, b_queue=0)
    mesh.hello("preA", "prefill", kvcache="kv0")
    assert mesh.core.table.get("preA").kvcache == "kv0" and mesh.core.table.get("preB").kvcache is None
    mesh.kv("kv0", "host", chain(320))
    mesh.kv("kv0", "disk", chain(640)[20:])
    job, dest = mesh.job(640)  # preA: 20 blocks from DRAM and 20 from disk beat recomputing on preB
    assert dest == "preA" and job.expected_cached_blocks == 40
    # A daemon too slow to be worth reading from: recompute instead.
    slow = two_prefills(RouterConfig(heartbeat_timeout_s=3.0, prior_disk_fetch_s_per_token=1.0), 100, 0)
    slow.hello("preA", "prefill", kvcache="kv0")
    slow.kv("kv0", "disk", chain(640))
    assert slow.job(640)[1] == "preB"


def test_job_carries_the_tenant_salt_and_the_prediction_and_metrics_compare_it() -> None:
    mesh = two_prefills(RouterConfig(heartbeat_timeout_s=3.0, tenants={"key-a": "salt-a"}))
    mesh.kv("preB", "device", chain(640, "salt-a"))
    other, dest = mesh.job(640, salt="salt-b")  # another tenant's chain: no hit anywhere
    assert (other.cache_salt, other.expected_cached_blocks) == (None, 0)
    job, dest = mesh.job(640, salt="salt-a", api_key="key-a")
    assert (dest, job.cache_salt, job.expected_cached_blocks) == ("preB", "salt-a", 40)
    mesh.done(job, num_cached_tokens=624, cached_by_tier={"device": 624}, prefill_s=0.05)
    m = mesh.core.metrics
    assert (m.predicted_cached_tokens, m.actual_cached_tokens) == (640, 624)
    assert m.predicted_cached_by_tier == {"device": 640} and m.actual_cached_by_tier == {"device": 624}


def test_prefill_reports_move_the_rate_and_fetch_estimates() -> None:
    mesh = two_prefills(a_queue=0, b_queue=0)
    model = mesh.core.cache
    assert model.rate("preA") == 600.0
    job, _ = mesh.job(1000)
    assert mesh.core.request(job.request_id).where.prefill == "preA"  # a tie goes to the first name
    # 840 computed tokens in 0.5 - 0.08 s = 2000 tok/s; 160 tokens from DRAM in 0.08 s = 5e-4 s/token.
    mesh.done(job, num_cached_tokens=160, cached_by_tier={"host": 160}, prefill_s=0.5, fetch_s=0.08)
    assert model.rate("preA") == pytest.approx(600 + 0.2 * 1400)
    assert model.fetch_s_per_token["host"] == pytest.approx(2e-5 + 0.2 * (5e-4 - 2e-5))
    assert model.fetch_s_per_token["disk"] == pytest.approx(6e-5) and model.rate("preB") == 600.0
    # The faster worker now takes a prompt even with more queued ahead of it: (100 + 500) / 880 < 500 / 600.
    mesh.beat("preA", "prefill", queued_prompt_tokens=100)
    assert mesh.job(500)[1] == "preA"
    # Reports without timings teach nothing.
    before = dict(model.rates)
    job, _ = mesh.job(500)
    mesh.done(job, num_cached_tokens=0)
    assert model.rates == before


def test_a_gap_in_kv_events_asks_the_publisher_for_exactly_one_resync() -> None:
    mesh = two_prefills()
    assert mesh.kv("preB", "device", chain(320)) == []
    [resync] = mesh.kv("preB", "device", chain(640)[20:], seq=3)
    assert resync.dest == "preB" and isinstance(resync.msg, KvResync) and "events 1..2 were lost" in resync.msg.reason
    assert mesh.kv("preB", "device", []) == []
    assert mesh.kv("preB", "device", [], seq=7) == []  # a second gap while the snapshot is awaited
    assert mesh.core.metrics.resyncs == 1 and mesh.core.metrics.kv_events == 4
    # The blocks before the break are forgotten: only the ones announced since then count.
    assert mesh.core.cache.index.longest_prefix(chain(640), "preB", "device") == 0
    assert mesh.kv("preB", "device", chain(640), snapshot=True) == []
    assert mesh.job(640)[1] == "preB"


def test_kv_events_from_another_instance_than_the_publisher_are_stale() -> None:
    mesh = two_prefills()
    assert mesh.kv("preB", "device", chain(640), sender="preA") == []
    assert mesh.core.metrics.stale == 1 and mesh.core.metrics.kv_events == 0
    assert mesh.core.cache.index.size() == 0


def test_a_dead_workers_blocks_are_forgotten_and_resynced_when_it_returns() -> None:
    mesh = two_prefills()
    mesh.kv("preB", "device", chain(640))
    mesh.now = 2.0
    for name, role in (("tok0", "tokenizer"), ("dec0", "decode"), ("preA", "prefill")):
        mesh.beat(name, role)
    mesh.core.tick(3.5)  # preB fell silent
    assert not mesh.core.table.get("preB").alive and mesh.core.cache.index.size("preB") == 0
    mesh.now = 3.5
    mesh.beat("preB", "prefill")  # back, same process: it kept publishing, the router lost track
    [resync] = mesh.kv("preB", "device", [])
    assert isinstance(resync.msg, KvResync) and resync.dest == "preB"


def test_a_restarted_workers_blocks_are_forgotten_and_its_fresh_stream_needs_no_resync() -> None:
    mesh = two_prefills()
    mesh.kv("preB", "device", chain(640))
    mesh.beat("preB", "prefill", incarnation="i1", queued_prompt_tokens=100)
    assert mesh.core.cache.index.size("preB") == 0
    assert mesh.kv("preB", "device", chain(320), seq=0, incarnation="i1") == []
    assert mesh.job(640)[0].expected_cached_blocks == 20
    # The new process's events may come before the router sees the restart: they are kept.
    mesh.kv("preA", "device", chain(640))
    assert mesh.kv("preA", "device", chain(160), seq=0, incarnation="i1", snapshot=True) == []
    mesh.beat("preA", "prefill", incarnation="i1")
    assert mesh.core.cache.index.size("preA") == 10
    assert mesh.core.metrics.resyncs == 0


def test_mesh_pins_the_block_hash_scheme_from_the_first_service_that_names_one() -> None:
    pins = MeshPins()
    client = Hello(PROTOCOL_VERSION, "client", "cli")
    assert pins.check(client, "router-0").accepted and pins.scheme is None
    assert pins.check(Hello(PROTOCOL_VERSION, "tokenizer", "tok0", None, "sha:aa"), "router-0").accepted
    assert pins.check(Hello(PROTOCOL_VERSION, "prefill", "pre0", "f" * 64, "sha:aa"), "router-0").accepted
    assert (pins.scheme, pins.fingerprint) == ("sha:aa", "f" * 64)
    refused = pins.check(Hello(PROTOCOL_VERSION, "kvcache", "kv0", None, "sha:bb"), "router-0")
    assert not refused.accepted
    assert "block hash scheme 'sha:bb' != 'sha:aa'" in refused.reason and "tokenizer tok0" in refused.reason
    other_model = pins.check(Hello(PROTOCOL_VERSION, "decode", "dec0", "e" * 64, "sha:aa"), "router-0")
    assert not other_model.accepted and "fingerprint" in other_model.reason
    assert pins.check(client, "router-0").accepted and pins.scheme == "sha:aa"


# ----- the request's life -----


def test_streaming_request_deltas_usage_and_timings() -> None:
    mesh = basic_mesh()
    enc = mesh.admit(stream=True, n=20)
    mesh.now = 0.1
    [job_out] = mesh.encoded(enc)
    job = job_out.msg
    assert (job_out.dest, job.decode_worker, job.arrival_time) == ("pre0", "dec0", 0)
    assert job.token_ids == enc.prompt_token_ids
    mesh.now = 0.5
    assert mesh.done(job, num_cached_tokens=16, cached_by_tier={"host": 16}, prefill_s=0.3) == []
    assert mesh.core.request(job.request_id).phase is Phase.DECODING
    rid = job.request_id
    mesh.now = 0.6
    out1 = mesh.deltas(TextDeltaItem(rid, 0, "Hello", [7, 8]))
    mesh.now = 0.7
    out2 = mesh.deltas(TextDeltaItem(rid, 2, "", [9]))  # part of a character: tokens, no text yet
    mesh.now = 1.0
    out3 = mesh.deltas(TextDeltaItem(rid, 3, " 😀!", [10, 11], finished=True, finish_reason="length"))
    deltas = msgs(out1 + out2 + out3, StreamDelta)
    assert [(d.request_id, d.text, d.offset) for d in deltas] == [("c1", "Hello", 0), ("c1", "", 2), ("c1", " 😀!", 3)]
    assert all(o.dest == C1 for o in out1 + out2 + out3)
    [fin] = msgs(out3, RequestFinished)
    assert out3[-1].msg is fin  # the terminal comes after the last delta
    assert (fin.request_id, fin.text, fin.finish_reason) == ("c1", "Hello 😀!", "length")
    assert fin.token_ids == [7, 8, 9, 10, 11]
    assert (fin.usage.prompt_tokens, fin.usage.completion_tokens) == (20, 5)
    assert (fin.usage.cached_tokens, fin.usage.cached_by_tier) == (16, {"host": 16})
    t = fin.timings
    assert t.e2e_s == pytest.approx(1.0) and t.ttft_s == pytest.approx(0.6) and t.queue_s == pytest.approx(0.1)
    assert t.tpot_s == pytest.approx(0.4 / 4) and t.prefill_s == pytest.approx(0.3)
    assert list(mesh.core.metrics.ttft_s) == [pytest.approx(0.6)]
    assert mesh.core.metrics.finished["length"] == 1
    assert_clean(mesh.core)


def test_non_streaming_request_gets_only_the_result() -> None:
    mesh = basic_mesh()
    job = mesh.placed()
    mesh.done(job)
    out = mesh.deltas(TextDeltaItem(job.request_id, 0, "a", [1]))
    assert out == []
    out = mesh.deltas(TextDeltaItem(job.request_id, 1, "b", [2], finished=True, finish_reason="stop"))
    [fin] = msgs(out, RequestFinished)
    assert (fin.text, fin.finish_reason, fin.stop_string) == ("ab", "stop", None)
    assert len(out) == 1  # a normal finish needs no aborts: every service is done with it
    assert_clean(mesh.core)


def test_stop_string_aborts_the_decode_worker() -> None:
    mesh = basic_mesh()
    job = mesh.placed(stream=True)
    mesh.done(job)
    item = TextDeltaItem(job.request_id, 0, "The end", [1, 2], finished=True, finish_reason="stop", stop_string="##")
    out = mesh.deltas(item)
    assert [(o.dest, type(o.msg).__name__) for o in out] == [
        (C1, "StreamDelta"),
        ("dec0", "AbortRequest"),
        (C1, "RequestFinished"),
    ]
    assert out[1].msg.request_id == job.request_id
    assert (out[2].msg.stop_string, out[2].msg.finish_reason) == ("##", "stop")
    assert_clean(mesh.core)


def test_speculation_counts_reach_the_usage_and_the_metrics() -> None:
    mesh = basic_mesh()
    a, b = mesh.placed(), mesh.placed()
    mesh.done(a), mesh.done(b)
    # Items carry the request's totals so far; a worker whose engine reports them only at the end sends
    # zeros meanwhile, and a late duplicate never lowers them.
    mesh.deltas(TextDeltaItem(a.request_id, 0, "x", [1, 2, 3], spec_proposed_tokens=4, spec_accepted_tokens=2))
    mesh.deltas(TextDeltaItem(a.request_id, 3, "y", [4], spec_proposed_tokens=0, spec_accepted_tokens=0))
    out = mesh.deltas(TextDeltaItem(a.request_id, 4, "z", [5, 6], finished=True, finish_reason="length",
                                    spec_proposed_tokens=8, spec_accepted_tokens=3))
    [fin] = msgs(out, RequestFinished)
    assert (fin.usage.spec_proposed_tokens, fin.usage.spec_accepted_tokens) == (8, 3)
    assert fin.usage.completion_tokens == 6
    # A stop string ends the stream early: the counts of its last item still arrive.
    out = mesh.deltas(TextDeltaItem(b.request_id, 0, "ab", [7, 8], True, "stop", "##",
                                    spec_proposed_tokens=4, spec_accepted_tokens=1))
    [fin_b] = msgs(out, RequestFinished)
    assert (fin_b.usage.spec_proposed_tokens, fin_b.usage.spec_accepted_tokens) == (4, 1)
    m = mesh.core.metrics
    assert (m.spec_proposed_tokens, m.spec_accepted_tokens) == (12, 4)
    assert m.spec_acceptance_rate == pytest.approx(4 / 12)
    assert_clean(mesh.core)


def test_a_workers_latest_speculation_counters_are_kept_per_worker() -> None:
    mesh = basic_mesh()
    dec = mesh.core.table.get("dec0")
    assert dec.spec_acceptance_rate is None and mesh.core.metrics.spec_acceptance_rate is None
    mesh.beat("dec0", "decode", spec_proposed_tokens=40, spec_accepted_tokens=10)
    mesh.beat("dec0", "decode", spec_proposed_tokens=100, spec_accepted_tokens=60)
    assert (dec.load.spec_proposed_tokens, dec.load.spec_accepted_tokens) == (100, 60)
    assert dec.spec_acceptance_rate == pytest.approx(0.6)
    assert mesh.core.table.get("pre0").spec_acceptance_rate is None  # prefill workers do not speculate


def test_decode_finishing_before_prefill_done_waits_for_the_usage() -> None:
    mesh = basic_mesh()
    job = mesh.placed()
    fin_item = TextDeltaItem(job.request_id, 0, "x", [5], finished=True, finish_reason="length")
    assert mesh.deltas(fin_item) == []
    assert mesh.core.request(job.request_id).phase is Phase.FINISHING
    assert mesh.core.queued_requests == 0  # it no longer waits for compute
    [fin] = msgs(mesh.done(job, num_cached_tokens=8), RequestFinished)
    assert (fin.text, fin.usage.cached_tokens) == ("x", 8)
    assert_clean(mesh.core)


def test_finishing_request_is_delivered_if_its_prefill_worker_dies() -> None:
    mesh = basic_mesh()
    job = mesh.placed()
    mesh.deltas(TextDeltaItem(job.request_id, 0, "x", [5], finished=True, finish_reason="length"))
    mesh.now = 2.0
    for name, role in (("tok0", "tokenizer"), ("dec0", "decode")):
        mesh.beat(name, role)
    out = mesh.core.tick(5.5)
    [fin] = msgs(out, RequestFinished)
    assert fin.text == "x" and fin.usage.cached_tokens == 0
    assert_clean(mesh.core)


# ----- errors, aborts, deaths, timeouts -----


def test_service_error_is_forwarded_once_and_the_others_are_told() -> None:
    mesh = basic_mesh()
    job = mesh.placed()
    out = mesh.core.on_error("dec0", ErrorReply(job.request_id, "internal", "engine failed"), mesh.now)
    assert sorted(dests(out, AbortRequest)) == ["pre0", "tok0"]
    [err] = msgs(out, ErrorReply)
    assert (err.request_id, err.code, err.message) == ("c1", "internal", "engine failed")
    assert mesh.core.on_error("dec0", ErrorReply(job.request_id, "internal", "again"), mesh.now) == []
    assert mesh.core.metrics.errors["internal"] == 1 and mesh.core.metrics.stale == 1
    assert_clean(mesh.core)


def test_tokenizer_refusal_is_forwarded() -> None:
    mesh = basic_mesh()
    enc = mesh.admit()
    out = mesh.core.on_error("tok0", ErrorReply(enc.request_id, "invalid_request", "prompt too long"), 0)
    assert [(o.dest, o.msg.code) for o in out] == [(C1, "invalid_request")]
    assert_clean(mesh.core)


def test_refused_kv_reservation_is_placed_once_more_elsewhere() -> None:
    mesh = basic_mesh()
    mesh.beat("dec1", "decode", free_blocks=900)
    job = mesh.placed()
    assert job.decode_worker == "dec0"
    out = mesh.core.on_error("pre0", ErrorReply(job.request_id, "overloaded", "dec0: no room"), mesh.now)
    [retry] = msgs(out, PrefillJob)
    assert retry.decode_worker == "dec1" and retry.request_id == job.request_id
    assert mesh.core.metrics.retries == 1 and mesh.core.table.get("dec0").assigned == 0
    out = mesh.core.on_error("pre0", ErrorReply(job.request_id, "overloaded", "dec1: no room"), mesh.now)
    [err] = msgs(out, ErrorReply)
    assert err.code == "overloaded" and dests(out, AbortRequest) == ["dec1", "tok0"]
    assert_clean(mesh.core)


def test_client_abort_ends_with_the_partial_output() -> None:
    mesh = basic_mesh()
    job = mesh.placed()
    mesh.done(job)
    mesh.deltas(TextDeltaItem(job.request_id, 0, "par", [1]))
    out = mesh.core.on_abort(C1, AbortRequest("c1", "user hit stop"), mesh.now)
    assert sorted(dests(out, AbortRequest)) == ["dec0", "tok0"]
    assert all(a.reason == "user hit stop" for a in msgs(out, AbortRequest))
    [fin] = msgs(out, RequestFinished)
    assert (fin.finish_reason, fin.text, fin.usage.completion_tokens) == ("abort", "par", 1)
    assert mesh.core.on_abort(C1, AbortRequest("c1"), mesh.now) == []  # already ended: a no-op
    assert mesh.core.on_abort(C2, AbortRequest("c1"), mesh.now) == []
    assert_clean(mesh.core)


def test_gone_client_requests_are_aborted_silently() -> None:
    mesh = basic_mesh()
    mesh.admit(C1), mesh.placed(C1), mesh.placed(C2)
    out = mesh.core.on_client_gone(C1, mesh.now)
    assert not [o for o in out if o.to_client]
    assert sorted(dests(out, AbortRequest)) == ["dec0", "pre0", "tok0", "tok0"]
    assert mesh.core.num_inflight == 1 and mesh.core.metrics.finished["abort"] == 2


def test_missed_heartbeats_fail_the_workers_requests_and_stop_placement() -> None:
    mesh = basic_mesh(max_moves=0)  # (moving requests elsewhere: the tests further down)
    mesh.beat("pre1", "prefill", queued_prompt_tokens=10_000)
    job = mesh.placed()
    assert mesh.core.request(job.request_id).where.prefill == "pre0"
    mesh.now = 2.5
    for name, role in (("tok0", "tokenizer"), ("dec0", "decode"), ("pre1", "prefill")):
        mesh.beat(name, role, queued_prompt_tokens=10_000 if name == "pre1" else 0)
    assert mesh.core.tick(3.0) == []  # 3.0 s silent is still within the timeout
    out = mesh.core.tick(3.5)
    [err] = msgs(out, ErrorReply)
    assert (err.code, err.request_id) == ("worker_lost", "c1") and "pre0" in err.message
    assert sorted(dests(out, AbortRequest)) == ["dec0", "pre0", "tok0"]  # pre0 may only be wedged
    assert mesh.core.tick(4.0) == []  # reported once
    mesh.now = 4.0
    mesh.placed()
    assert mesh.core.request("1").where.prefill == "pre1"  # never pre0 again...
    mesh.beat("pre0", "prefill")  # ...until it heartbeats again
    assert mesh.core.table.get("pre0").placeable(mesh.now, 3.0)
    assert mesh.core.metrics.errors["worker_lost"] == 1


def test_new_incarnation_fails_the_old_requests_and_drops_stale_messages() -> None:
    mesh = basic_mesh(max_moves=0)
    job = mesh.placed()
    mesh.done(job)
    rid = job.request_id
    mesh.deltas(TextDeltaItem(rid, 0, "a", [1]))
    out = mesh.beat("dec0", "decode", incarnation="i1")
    [err] = msgs(out, ErrorReply)
    assert err.code == "worker_lost" and "restarted" in err.message
    assert dests(out, AbortRequest) == ["tok0"]  # the new dec0 never had it
    # Late messages about the old request, and the old incarnation's heartbeats, are dropped.
    assert mesh.deltas(TextDeltaItem(rid, 1, "b", [2], finished=True)) == []
    assert mesh.core.on_error("dec0", ErrorReply(rid, "internal", "x"), mesh.now) == []
    old = Heartbeat("decode", "dec0", "i0", 99, 99, free_blocks=1000)
    assert mesh.core.on_heartbeat(old, mesh.now) == []
    assert mesh.core.metrics.stale == 3
    assert mesh.core.table.get("dec0").incarnation == "i1"
    # The new incarnation takes new work.
    assert mesh.placed().decode_worker == "dec0"


def test_hello_with_a_new_incarnation_is_a_restart() -> None:
    mesh = basic_mesh(max_moves=0)
    job = mesh.placed()
    hello = Hello(1, "prefill", "pre0", capabilities={"incarnation": "i0"})
    assert mesh.core.on_hello(hello, mesh.now) == []  # a reconnect of the same process
    hello = Hello(1, "prefill", "pre0", capabilities={"incarnation": "i9"})
    out = mesh.core.on_hello(hello, mesh.now)
    assert msgs(out, ErrorReply)[0].code == "worker_lost"
    assert not mesh.core.table.get("pre0").placeable(mesh.now, 3.0)  # no load known until it heartbeats
    assert mesh.core.on_prefill_done(PrefillDone(job.request_id, "pre0", 10, 0), mesh.now) == []
    mesh.beat("pre0", "prefill", incarnation="i9")
    assert mesh.core.table.get("pre0").placeable(mesh.now, 3.0)
    assert mesh.core.on_hello(Hello(1, "client", "cli"), mesh.now) == []


def test_wedged_worker_is_declared_dead() -> None:
    mesh = basic_mesh(progress_timeout_s=10.0, max_moves=0)
    mesh.placed()
    for t in range(1, 13):
        mesh.now = float(t)
        mesh.beat("tok0", "tokenizer")
        mesh.beat("dec0", "decode")
        mesh.beat("pre0", "prefill", progress=5, waiting=1)  # heartbeats go on, its steps stopped at t=1
        out = mesh.core.tick(mesh.now)
        assert (out == []) == (t <= 11)
    [err] = msgs(out, ErrorReply)
    assert err.code == "worker_lost" and "pre0 made no progress for 11.0s" in err.message
    assert not mesh.core.table.get("pre0").alive
    mesh.beat("pre0", "prefill", progress=5, waiting=1)
    assert not mesh.core.table.get("pre0").alive  # still stuck: heartbeats alone do not revive it
    mesh.beat("pre0", "prefill", progress=6, waiting=1)
    assert mesh.core.table.get("pre0").alive
    mesh.now += 20
    mesh.beat("pre0", "prefill", progress=6, waiting=0)  # idle, progress unchanged: not wedged
    mesh.core.tick(mesh.now + 2)
    assert mesh.core.table.get("pre0").alive


# ----- tenant policy and slow clients -----


def test_priority_is_raised_to_the_tenants_floor() -> None:
    mesh = basic_mesh(tenants={"gold": "g", "free": "f"}, priority_floor={"gold": -10}, default_priority_floor=0)
    jobs = [mesh.placed(api_key=key, priority=p) for key, p in (("free", -9), ("gold", -9), ("gold", -20), (None, 3))]
    assert [j.priority for j in jobs] == [0, -9, -10, 3]


def test_tenant_in_flight_cap_refuses_only_that_tenant() -> None:
    mesh = basic_mesh(tenants={"a": "a", "b": "b"}, max_inflight_per_tenant={"a": 2},
                      default_max_inflight_per_tenant=3)

    def kinds(key: str, n: int) -> list[str]:
        return [type(mesh.generate(api_key=key)[0].msg).__name__ for _ in range(n)]

    assert kinds("a", 3) == ["EncodeRequest"] * 2 + ["ErrorReply"]
    refused = mesh.generate(api_key="a")[0].msg
    assert refused.code == "overloaded" and "2 requests in flight" in refused.message
    assert kinds("b", 4) == ["EncodeRequest"] * 3 + ["ErrorReply"]
    mesh.core.on_abort(C1, AbortRequest("c1"), mesh.now)  # one of a's ends: room for one more
    assert isinstance(mesh.generate(api_key="a")[0].msg, EncodeRequest)


def test_a_slow_client_gets_explicit_errors_and_others_go_on() -> None:
    mesh = basic_mesh()
    mesh.placed(C1), mesh.admit(C1), mesh.placed(C2)
    out = mesh.core.on_client_slow(C1, mesh.now)
    errs = msgs(out, ErrorReply)
    assert [(e.code, o.dest) for e, o in zip(errs, [o for o in out if o.to_client])] == [("overloaded", C1)] * 2
    assert "too slowly" in errs[0].message
    assert sorted(dests(out, AbortRequest)) == ["dec0", "pre0", "tok0", "tok0"]
    assert mesh.core.num_inflight == 1 and mesh.core.request_of(C2, "c3") is not None


def test_too_many_or_too_long_stop_strings_are_refused() -> None:
    mesh = basic_mesh()
    many = mesh.generate(params=SamplingParamsWire(stop=[f"s{i}" for i in range(17)]))[0].msg
    long = mesh.generate(params=SamplingParamsWire(stop=["x" * 257]))[0].msg
    assert many.code == long.code == "invalid_request"
    assert "at most 16 stop strings" in many.message and "at most 256 characters" in long.message
    assert isinstance(mesh.generate(params=SamplingParamsWire(stop=[f"s{i}" for i in range(16)]))[0].msg,
                      EncodeRequest)


# ----- moving requests off lost services -----


def pd_mesh(**kw: Any) -> Mesh:
    config = RouterConfig(**{"heartbeat_timeout_s": 3.0, **kw})
    return Mesh(config, tok0="tokenizer", tok1="tokenizer", pre0="prefill", dec0="decode", dec1="decode")


def decoding(mesh: Mesh, streamed: list[int], client: bytes = C1, **kw: Any) -> PrefillJob:
    """A request prefilled, decoding, with `streamed` tokens delivered to its (streaming) client."""
    job = mesh.placed(client, stream=True, **kw)
    mesh.done(job)
    tok = mesh.core.request(job.request_id).where.tokenizer
    out = mesh.deltas(TextDeltaItem(job.request_id, 0, "x" * len(streamed), streamed), tokenizer=tok)
    assert [d.token_ids for d in msgs(out, StreamDelta)] == [streamed]
    return job


def test_lost_decode_worker_moves_its_requests_and_the_stream_goes_on() -> None:
    mesh = pd_mesh()
    job = decoding(mesh, [7, 8, 9])
    assert job.decode_worker == "dec0" and job.num_output_tokens == 0
    mesh.now = 2.5
    for name, role in (("tok0", "tokenizer"), ("tok1", "tokenizer"), ("pre0", "prefill"), ("dec1", "decode")):
        mesh.beat(name, role)
    out = mesh.core.tick(3.5)  # dec0 fell silent
    assert not [o for o in out if o.to_client]  # the client sees nothing of it
    assert sorted(dests(out, AbortRequest)) == ["dec0", "tok0"]  # the old id, everywhere (dec0 may be wedged)
    [enc] = msgs(out, EncodeRequest)
    assert dests(out, EncodeRequest) == ["tok0"]  # its tokenizer is alive: it continues the text
    assert enc.request_id != job.request_id and enc.prompt_token_ids == job.token_ids
    assert enc.resume_output_ids == [7, 8, 9]
    assert enc.max_tokens == SamplingParamsWire().max_tokens  # the tokenizer checks prompt + budget again
    st_ = mesh.core.request_of(C1, "c1")
    assert st_.phase is Phase.TOKENIZING and st_.moves == 1 and mesh.core.request(job.request_id) is None
    # Late messages under the old id are stale.
    assert mesh.deltas(TextDeltaItem(job.request_id, 3, "late", [10])) == []
    [job2] = msgs(mesh.core.on_encode_result("tok0", EncodeResult(enc.request_id, enc.prompt_token_ids, []), 3.5),
                  PrefillJob)
    assert job2.token_ids == job.token_ids + [7, 8, 9] and job2.num_output_tokens == 3
    assert job2.decode_worker == "dec1" and job2.params == job.params
    mesh.done(job2, num_cached_tokens=8)
    out = mesh.deltas(TextDeltaItem(enc.request_id, 3, "yz", [10, 11], finished=True, finish_reason="length"))
    [delta] = msgs(out, StreamDelta)
    assert (delta.request_id, delta.offset, delta.token_ids) == ("c1", 3, [10, 11])
    [fin] = msgs(out, RequestFinished)
    assert fin.token_ids == [7, 8, 9, 10, 11] and fin.text == "xxxyz"
    assert fin.usage.prompt_tokens == len(job.token_ids) and fin.usage.completion_tokens == 5
    assert fin.usage.cached_tokens == 0  # the usage of the client's prompt: its first prefill
    assert mesh.core.metrics.moves == 1 and mesh.core.metrics.finished["length"] == 1
    assert_clean(mesh.core)


def test_supervisor_note_moves_requests_at_once_and_names_the_process() -> None:
    mesh = pd_mesh()
    mesh.core.on_hello(Hello(1, "decode", "dec0", capabilities={"incarnation": "i0", "pid": "4242"}), mesh.now)
    job = decoding(mesh, [5])
    assert mesh.core.on_service_exited(ServiceExited("dec0", 4141, -9), mesh.now) == []  # another process
    assert mesh.core.metrics.stale == 1
    out = mesh.core.on_service_exited(ServiceExited("dec0", 4242, -9), mesh.now)
    [enc] = msgs(out, EncodeRequest)
    assert enc.resume_output_ids == [5] and dests(out, AbortRequest) == ["tok0"]  # nothing to the dead dec0
    assert not mesh.core.table.get("dec0").alive
    assert mesh.beat("dec0", "decode") == [] and not mesh.core.table.get("dec0").alive  # its late heartbeat
    # Its successor says Hello and heartbeats: placeable again.
    mesh.core.on_hello(Hello(1, "decode", "dec0", capabilities={"incarnation": "i1", "pid": "4343"}), mesh.now)
    mesh.beat("dec0", "decode", incarnation="i1")
    assert mesh.core.table.get("dec0").placeable(mesh.now, 3.0)
    assert mesh.core.on_service_exited(ServiceExited("dec0", 4242, -9), mesh.now) == []  # a late note
    [job2] = msgs(mesh.core.on_encode_result("tok0", EncodeResult(enc.request_id, job.token_ids, []), mesh.now),
                  PrefillJob)
    assert job2.num_output_tokens == 1


def test_lost_tokenizer_moves_its_requests_to_another_tokenizer() -> None:
    mesh = pd_mesh()
    job = decoding(mesh, [3, 4])
    assert mesh.core.request(job.request_id).where.tokenizer == "tok0"
    encoding = [mesh.admit(C2) for _ in range(2)]  # round robin: one of them is encoding on tok0
    [on_tok0] = [e for e in encoding if mesh.core.request(e.request_id).where.tokenizer == "tok0"]
    mesh.core.on_hello(Hello(1, "tokenizer", "tok0", capabilities={"incarnation": "i0", "pid": "77"}), mesh.now)
    out = mesh.core.on_service_exited(ServiceExited("tok0", 77, 1), mesh.now)
    assert dests(out, EncodeRequest) == ["tok1", "tok1"]
    moved = {e.request_id.split("~")[0]: e for e in msgs(out, EncodeRequest)}
    assert moved[job.request_id].resume_output_ids == [3, 4]
    assert moved[on_tok0.request_id].resume_output_ids is None  # its encoding was lost: it starts over
    assert moved[on_tok0.request_id].prompt_token_ids == on_tok0.prompt_token_ids
    assert sorted(dests(out, AbortRequest)) == ["dec0"]  # pre0 was done with it; tok0 is gone


def test_a_restarted_single_tokenizer_takes_its_requests_back() -> None:
    mesh = basic_mesh()
    decoding(mesh, [1])
    out = mesh.beat("tok0", "tokenizer", incarnation="i1")
    [enc] = msgs(out, EncodeRequest)
    assert dests(out, EncodeRequest) == ["tok0"] and enc.resume_output_ids == [1]
    assert dests(out, AbortRequest) == ["dec0"]  # (the new tok0 never had the old id)
    assert mesh.core.request(enc.request_id).where.holders == {"tok0"}


def test_moves_are_bounded_then_worker_lost() -> None:
    mesh = pd_mesh(max_moves=1)
    decoding(mesh, [1])
    out = mesh.beat("dec0", "decode", incarnation="i1")  # restarted: move 1
    [enc] = msgs(out, EncodeRequest)
    [job2] = msgs(mesh.core.on_encode_result("tok0", EncodeResult(enc.request_id, list(range(100, 110)), []), 0.0),
                  PrefillJob)
    lost = job2.decode_worker
    out = mesh.beat(lost, "decode", incarnation="i2")
    [err] = msgs(out, ErrorReply)
    assert err.code == "worker_lost" and "moved 1 times already" in err.message and err.request_id == "c1"
    assert_clean(mesh.core)


def test_no_live_tokenizer_means_worker_lost() -> None:
    mesh = basic_mesh()
    mesh.core.on_hello(Hello(1, "tokenizer", "tok0", capabilities={"incarnation": "i0", "pid": "9"}), mesh.now)
    decoding(mesh, [1])
    out = mesh.core.on_service_exited(ServiceExited("tok0", 9, -9), mesh.now)
    [err] = msgs(out, ErrorReply)
    assert err.code == "worker_lost" and "no live tokenizer" in err.message
    assert_clean(mesh.core)


def test_deadline_ends_the_request_with_timeout() -> None:
    mesh = basic_mesh(request_timeout_s=100.0, heartbeat_timeout_s=1000.0)
    job = mesh.placed(timeout_s=5.0)
    enc = mesh.admit()
    assert mesh.core.tick(4.9) == []
    out = mesh.core.tick(5.0)
    [err] = msgs(out, ErrorReply)
    assert (err.code, err.request_id) == ("timeout", "c1")
    assert sorted(dests(out, AbortRequest)) == ["dec0", "pre0", "tok0"]
    assert mesh.core.request(job.request_id) is None and mesh.core.request(enc.request_id) is not None
    assert msgs(mesh.core.tick(100.0), ErrorReply)[0].code == "timeout"
    assert_clean(mesh.core)


def test_encoded_request_waits_for_a_worker_then_gives_up() -> None:
    mesh = basic_mesh(placement_timeout_s=4.0, default_priority_floor=-5)
    a, b = mesh.admit(), mesh.admit(priority=-1)
    mesh.now = 3.5  # pre0 and dec0 fall silent; tok0 keeps beating
    mesh.beat("tok0", "tokenizer")
    mesh.core.tick(mesh.now)
    assert mesh.encoded(a) == [] and mesh.encoded(b) == []
    assert mesh.core.request(a.request_id).phase is Phase.PARKED
    mesh.now = 5.0
    mesh.beat("tok0", "tokenizer")
    mesh.beat("dec0", "decode")
    out = mesh.beat("pre0", "prefill")  # back: the parked requests go, higher priority first
    assert [j.request_id for j in msgs(out, PrefillJob)] == [b.request_id, a.request_id]
    c = mesh.admit()
    mesh.now = 9.0
    mesh.beat("tok0", "tokenizer")
    mesh.core.tick(mesh.now)  # workers silent again
    assert mesh.encoded(c) == []
    mesh.now = 12.0
    mesh.beat("tok0", "tokenizer")
    assert mesh.core.tick(12.0) == []
    mesh.beat("tok0", "tokenizer")
    err = msgs(mesh.core.tick(13.5), ErrorReply)
    assert [(e.request_id, e.code) for e in err] == [("c3", "worker_lost")]


def test_stale_and_out_of_order_messages_are_dropped() -> None:
    mesh = Mesh(tok0="tokenizer", tok1="tokenizer", pre0="prefill", pre1="prefill", dec0="decode")
    enc = mesh.admit()
    rid = enc.request_id
    assert mesh.core.on_encode_result("tok1", EncodeResult(rid, [1, 2], []), 0) == []  # not its tokenizer
    assert mesh.core.on_encode_result("tok0", EncodeResult("nope", [1, 2], []), 0) == []
    assert mesh.core.on_prefill_done(PrefillDone(rid, "pre0", 2, 0), 0) == []  # not prefilling yet
    [job] = msgs(mesh.encoded(enc), PrefillJob)
    assert mesh.core.on_encode_result("tok0", EncodeResult(rid, [1, 2], []), 0) == []  # encoded already
    other = "pre1" if mesh.core.request(rid).where.prefill == "pre0" else "pre0"
    assert mesh.core.on_prefill_done(PrefillDone(rid, other, 2, 0), 0) == []
    assert mesh.core.on_error(other, ErrorReply(rid, "internal", "x"), 0) == []
    mesh.done(job)
    assert mesh.deltas(TextDeltaItem(rid, 0, "a", [1]), tokenizer="tok1") == []
    mesh.deltas(TextDeltaItem(rid, 0, "a", [1]))
    assert mesh.deltas(TextDeltaItem(rid, 0, "a", [1])) == []  # a duplicate
    assert mesh.core.metrics.stale == 8
    out = mesh.deltas(TextDeltaItem(rid, 3, "c", [3]))  # tokens 1..2 missing
    assert msgs(out, ErrorReply)[0].code == "internal"
    assert_clean(mesh.core)


def test_tokenizer_gap_item_fails_the_request() -> None:
    mesh = basic_mesh()
    job = mesh.placed()
    mesh.done(job)
    out = mesh.deltas(TextDeltaItem(job.request_id, 0, "", [], finished=True, finish_reason="error"))
    assert msgs(out, ErrorReply)[0].code == "internal"
    assert dests(out, AbortRequest) == ["dec0"]  # the tokenizer dropped it already
    assert_clean(mesh.core)


def test_old_deadline_entries_are_compacted() -> None:
    mesh = basic_mesh()
    for _ in range(200):
        mesh.admit()
        mesh.core.on_abort(C1, AbortRequest(f"c{mesh.n}"), mesh.now)
    mesh.core.tick(mesh.now)
    assert len(mesh.core._deadlines) <= 64
    assert_clean(mesh.core)


# ----- exactly once, under any ordering -----

INSTANCES = {
    "tok0": "tokenizer",
    "tok1": "tokenizer",
    "pre0": "prefill",
    "pre1": "prefill",
    "dec0": "decode",
    "dec1": "decode",
    "w0": "worker",
}
CLIENTS = (C1, C2, b"client-3")
KV_CHAIN = chain(120)
CODES = ("overloaded", "invalid_request", "worker_lost", "timeout", "internal", "unavailable", "unauthorized")


class Model:
    """Drives a router core with random, often wrong or late, events and checks after each one that
    every admitted request got at most one terminal message, and exactly one once its state is gone."""

    def __init__(self, data: Any) -> None:
        self.draw = data.draw
        config = RouterConfig(
            max_queued_requests=6,
            max_queued_prompt_tokens=200,
            heartbeat_timeout_s=3.0,
            progress_timeout_s=10.0,
            request_timeout_s=20.0,
            placement_timeout_s=4.0,
        )
        self.mesh = Mesh(config)
        self.live: dict[tuple[bytes, str], str] = {}  # (client, its id) → router id, admitted and not ended
        self.gone: set[bytes] = set()
        self.ended = 0
        self.kv_seq: dict[str, int] = {}
        self.kv_inc: dict[str, str] = {}
        for name, role in INSTANCES.items():
            self.mesh.beat(name, role)

    @property
    def core(self) -> RouterCore:
        return self.mesh.core

    def pick(self, *phases: Phase) -> Any:
        reqs = sorted((self.core.request_of(*key) for key in self.live), key=lambda r: r.seq)
        reqs = [r for r in reqs if not phases or r.phase in phases]
        return self.draw(st.sampled_from(reqs)) if reqs else None

    def instance(self) -> str:
        return self.draw(st.sampled_from(sorted(INSTANCES)))

    def step(self) -> None:
        kind = self.draw(
            st.sampled_from(
                ["generate"] * 2
                + ["progress"] * 6
                + ["encode", "prefill_done", "delta", "error", "abort", "gone", "slow", "restart", "exited"]
                + ["time", "time", "kv"]
            )
        )
        out = getattr(self, f"do_{kind}")()
        self.check(out)

    def do_generate(self) -> list[Outbound]:
        client = self.draw(st.sampled_from(CLIENTS))
        self.gone.discard(client)
        stream, n = self.draw(st.booleans()), self.draw(st.integers(1, 80))
        out = self.mesh.generate(client, n=n, stream=stream, timeout_s=self.draw(st.sampled_from([None, 2.0, 8.0])))
        if isinstance(out[0].msg, EncodeRequest):
            self.live[(client, f"c{self.mesh.n}")] = out[0].msg.request_id
            return []  # an admission is not a terminal
        assert isinstance(out[0].msg, ErrorReply) and len(out) == 1
        return []  # refusals are not terminals of admitted requests

    def do_progress(self) -> list[Outbound]:
        """The next thing that would happen to a request on a healthy mesh."""
        r, now = self.pick(), self.mesh.now
        if r is None:
            return []
        if r.phase is Phase.TOKENIZING:
            n = self.draw(st.integers(1, 120))
            return self.core.on_encode_result(r.where.tokenizer, EncodeResult(r.rid, list(range(n)), chain(n)), now)
        choice = self.draw(st.integers(0, 5))
        if r.phase is Phase.FINISHING or (r.phase is Phase.PREFILLING and choice < 2):
            return self.core.on_prefill_done(PrefillDone(r.rid, r.where.prefill, len(r.prompt_ids), 3), now)
        if r.phase is Phase.PREFILLING and choice == 2:
            return self.core.on_error(r.where.prefill, ErrorReply(r.rid, "overloaded", "no room"), now)
        if r.phase is Phase.PARKED:
            return self.do_time()
        finished = choice == 5
        reason = self.draw(st.sampled_from(["stop", "length"])) if finished else None
        stop = "##" if finished and choice % 2 else None
        item = TextDeltaItem(r.rid, len(r.output_ids), "t", [7, 8], finished, reason, stop)
        return self.mesh.deltas(item, tokenizer=r.where.tokenizer)

    def do_encode(self) -> list[Outbound]:
        r = self.pick(Phase.TOKENIZING)
        if r is None:
            return []
        sender = r.where.tokenizer if self.draw(st.booleans()) else self.instance()
        n = self.draw(st.integers(1, 120))
        return self.core.on_encode_result(sender, EncodeResult(r.rid, list(range(n)), chain(n)), self.mesh.now)

    def do_prefill_done(self) -> list[Outbound]:
        r = self.pick(Phase.PREFILLING, Phase.FINISHING, Phase.DECODING)
        if r is None:
            return []
        sender = r.where.prefill if r.where.prefill and self.draw(st.booleans()) else self.instance()
        done = PrefillDone(r.rid, sender, len(r.prompt_ids), self.draw(st.integers(0, 16)))
        return self.core.on_prefill_done(done, self.mesh.now)

    def do_delta(self) -> list[Outbound]:
        r = self.pick(Phase.PREFILLING, Phase.DECODING, Phase.FINISHING)
        if r is None:
            return []
        offset = len(r.output_ids) + self.draw(st.sampled_from([0, 0, 0, -1, 1]))
        finished = self.draw(st.booleans())
        reason = self.draw(st.sampled_from(["stop", "length", "error"])) if finished else None
        stop = "##" if reason == "stop" and self.draw(st.booleans()) else None
        item = TextDeltaItem(r.rid, offset, "t", [7] * self.draw(st.integers(0, 3)), finished, reason, stop)
        tokenizer = r.where.tokenizer if self.draw(st.integers(0, 4)) else self.instance()
        worker = self.draw(st.sampled_from([None, r.where.decode, r.where.decode, r.where.prefill, self.instance()]))
        return self.mesh.deltas(item, tokenizer=tokenizer, worker=worker)

    def do_error(self) -> list[Outbound]:
        r = self.pick()
        if r is None:
            return []
        holders = sorted(r.where.holders)
        sender = self.draw(st.sampled_from(holders)) if holders and self.draw(st.booleans()) else self.instance()
        err = ErrorReply(r.rid, self.draw(st.sampled_from(CODES)), "x")
        return self.core.on_error(sender, err, self.mesh.now)

    def do_abort(self) -> list[Outbound]:
        client = self.draw(st.sampled_from(CLIENTS))
        crid = f"c{self.draw(st.integers(1, max(1, self.mesh.n)))}"
        return self.core.on_abort(client, AbortRequest(crid), self.mesh.now)

    def do_gone(self) -> list[Outbound]:
        client = self.draw(st.sampled_from(CLIENTS))
        self.gone.add(client)
        out = self.core.on_client_gone(client, self.mesh.now)
        assert not [o for o in out if o.to_client]
        return out

    def do_slow(self) -> list[Outbound]:
        return self.core.on_client_slow(self.draw(st.sampled_from(CLIENTS)), self.mesh.now)

    def do_restart(self) -> list[Outbound]:
        name = self.instance()
        incarnation = f"i{self.draw(st.integers(0, 3))}"
        if self.draw(st.booleans()):
            pid = self.draw(st.integers(100, 103))
            hello = Hello(1, INSTANCES[name], name, capabilities={"incarnation": incarnation, "pid": str(pid)})
            return self.core.on_hello(hello, self.mesh.now)
        return self.mesh.beat(name, INSTANCES[name], incarnation=incarnation)

    def do_exited(self) -> list[Outbound]:
        """A supervisor's note: mostly about the process the router knows, sometimes a predecessor."""
        return self.core.on_service_exited(ServiceExited(self.instance(), self.draw(st.integers(100, 103)), -9),
                                           self.mesh.now)

    def do_kv(self) -> list[Outbound]:
        """KV events, mostly in order, sometimes skipping ahead, restarting or sent by the wrong instance."""
        publisher = self.instance()
        seq = self.kv_seq.get(publisher, 0) + self.draw(st.sampled_from([0, 0, 0, 1, 3]))
        incarnation = self.draw(st.sampled_from(["i0", "i0", "i0", "i1"]))
        if incarnation != self.kv_inc.setdefault(publisher, "i0"):
            self.kv_inc[publisher], seq = incarnation, self.draw(st.sampled_from([0, 2]))
        self.kv_seq[publisher] = seq + 1
        blocks = KV_CHAIN[: self.draw(st.integers(0, len(KV_CHAIN)))]
        ev = KvEvents(publisher, incarnation, seq, "device", blocks, [], self.draw(st.booleans()))
        sender = publisher if self.draw(st.integers(0, 4)) else self.instance()
        out = self.core.on_kv_events(sender, ev, self.mesh.now)
        assert all(o.dest == publisher == sender and isinstance(o.msg, KvResync) for o in out)
        return out

    def do_time(self) -> list[Outbound]:
        self.mesh.now += self.draw(st.sampled_from([0.5, 0.5, 1.0, 2.5, 4.0]))
        out: list[Outbound] = []
        for name, role in INSTANCES.items():
            if self.draw(st.integers(0, 9)):  # one in ten stays silent this round
                load = {
                    "free_blocks": self.draw(st.sampled_from([0, 5, 1000])),
                    "queued_prompt_tokens": self.draw(st.integers(0, 500)),
                    "running": self.draw(st.integers(0, 3)),
                    "draining": self.draw(st.integers(0, 9)) == 0,
                }
                out += self.mesh.beat(name, role, **load)
        return out + self.core.tick(self.mesh.now)

    def check(self, out: list[Outbound]) -> None:
        core = self.core
        for o in out:
            if o.to_client and isinstance(o.msg, (RequestFinished, ErrorReply)):
                key = (o.dest, o.msg.request_id)
                assert key in self.live, f"a second terminal message, or one for nothing: {o}"
                self.live.pop(key)
                assert core.request_of(*key) is None, "terminal sent but state kept"
                self.ended += 1
            elif o.to_client:
                assert isinstance(o.msg, StreamDelta) and (o.dest, o.msg.request_id) in self.live
        for key in list(self.live):
            if core.request_of(*key) is None:
                assert key[0] in self.gone, f"request {key} ended without a terminal message"
                del self.live[key]
                self.ended += 1
        reqs = [core.request_of(*key) for key in self.live]
        for inst in core.table.instances.values():
            assert inst.held == {r.rid for r in reqs if inst.name in r.where.holders}
            ws = [r.where for r in reqs]
            assert inst.prefill_tokens == sum(w.prefill_tokens for w in ws if w.prefill == inst.name)
            assert inst.pending_blocks == sum(w.pending_blocks for w in ws if w.decode == inst.name)
            assert inst.assigned == sum(w.assigned for w in ws if w.decode == inst.name)
            for w in ws:  # charges only on holders
                assert not w.prefill_tokens or w.prefill in w.holders
                assert not (w.pending_blocks or w.assigned) or w.decode in w.holders
        assert core.num_inflight == len(self.live)
        queued = [r for r in reqs if r.queued]
        assert core.queued_requests == len(queued) == sum(r.phase not in (Phase.DECODING, Phase.FINISHING)
                                                          for r in reqs)
        assert core.queued_tokens == sum(r.queued_charge for r in queued)
        assert core.unplaced_tokens == sum(r.queued_charge for r in queued if r.phase in UNPLACED)
        tenants = {t: sum(r.queued_charge for r in queued if r.tenant == t) for t in {r.tenant for r in queued}}
        assert core._queued_tokens_by_tenant == {t: n for t, n in tenants.items() if n}
        m = core.metrics
        assert m.admitted == sum(m.finished.values()) + sum(m.errors.values()) + core.num_inflight == self.ended + len(
            self.live
        )

    def drain(self) -> None:
        """Everything falls silent: every request must end, and nothing may be left behind."""
        self.mesh.now += 1000
        self.check(self.core.tick(self.mesh.now))
        assert not self.live
        assert_clean(self.core)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_admitted_request_ends_exactly_once(data: Any) -> None:
    model = Model(data)
    for _ in range(data.draw(st.integers(1, 60))):
        model.step()
    model.drain()


# ----- logprobs and prompt logprobs (protocol 8) -----


def _lp(token: int, value: float = -0.5) -> LogprobWire:
    return LogprobWire(token, value, [(token, value)])


def test_per_delta_logprobs_accumulate_and_prompt_logprobs_come_first() -> None:
    mesh = basic_mesh()
    params = SamplingParamsWire(logprobs=1, prompt_logprobs=1)
    job = mesh.placed(stream=True, params=params, n=3)
    assert job.params.prompt_logprobs == 1  # the worker computes them
    mesh.done(job)
    prompt_lps = [None, _lp(101), _lp(102)]
    rid = job.request_id
    out = mesh.deltas(TextDeltaItem(rid, 0, "", [7, 8], logprobs=[_lp(7), _lp(8)], prompt_logprobs=prompt_lps))
    out += mesh.deltas(TextDeltaItem(rid, 2, "ab", [9], logprobs=[_lp(9)]))
    out += mesh.deltas(TextDeltaItem(rid, 3, "c", [10], finished=True, finish_reason="length", logprobs=[_lp(10)]))
    first, *rest = msgs(out, StreamDelta)
    assert (first.prompt_token_ids, first.prompt_logprobs) == ([100, 101, 102], prompt_lps)
    assert all(d.prompt_token_ids is None and d.prompt_logprobs is None for d in rest)
    [fin] = msgs(out, RequestFinished)
    assert [lp for d in [first, *rest] for lp in d.logprobs] == fin.logprobs
    assert [lp.token_id for lp in fin.logprobs] == fin.token_ids == [7, 8, 9, 10]
    assert (fin.prompt_token_ids, fin.prompt_logprobs) == ([100, 101, 102], prompt_lps)
    assert_clean(mesh.core)


def test_without_prompt_logprobs_asked_none_are_sent() -> None:
    mesh = basic_mesh()
    job = mesh.placed(stream=True)
    mesh.done(job)
    out = mesh.deltas(TextDeltaItem(job.request_id, 0, "a", [7], finished=True, finish_reason="stop"))
    [delta] = msgs(out, StreamDelta)
    [fin] = msgs(out, RequestFinished)
    assert delta.prompt_token_ids is delta.prompt_logprobs is fin.prompt_token_ids is fin.prompt_logprobs is None


def test_a_moved_request_does_not_ask_for_prompt_logprobs_again() -> None:
    mesh = pd_mesh()
    params = SamplingParamsWire(logprobs=0, prompt_logprobs=0, max_tokens=10)
    job = mesh.placed(stream=True, params=params, n=2)
    mesh.done(job)
    prompt_lps = [None, _lp(101)]
    mesh.deltas(TextDeltaItem(job.request_id, 0, "x", [7], logprobs=[_lp(7)], prompt_logprobs=prompt_lps))
    mesh.now = 2.5
    for name, role in (("tok0", "tokenizer"), ("tok1", "tokenizer"), ("pre0", "prefill"), ("dec1", "decode")):
        mesh.beat(name, role)
    [enc] = msgs(mesh.core.tick(3.5), EncodeRequest)
    [job2] = msgs(mesh.core.on_encode_result("tok0", EncodeResult(enc.request_id, enc.prompt_token_ids, []), 3.5),
                  PrefillJob)
    assert job2.params.prompt_logprobs is None and job2.params.logprobs == 0  # only what is still owed
    mesh.done(job2)
    out = mesh.deltas(TextDeltaItem(enc.request_id, 1, "y", [8], True, "length", logprobs=[_lp(8)]))
    [delta] = msgs(out, StreamDelta)
    assert delta.prompt_logprobs is None  # the client had them on its first delta
    [fin] = msgs(out, RequestFinished)
    assert fin.prompt_logprobs == prompt_lps and [lp.token_id for lp in fin.logprobs] == [7, 8]
    assert_clean(mesh.core)


def test_unauthorized_and_unavailable_refusals_leave_nothing_behind() -> None:
    strict = basic_mesh(tenants={"k": "s"}, require_api_key=True)
    [out] = strict.generate(api_key="wrong")
    assert (out.msg.code, out.msg.retry_after_s) == ("unauthorized", None)
    empty = Mesh(RouterConfig(heartbeat_timeout_s=3.0))
    [out] = empty.generate()
    assert out.msg.code == "unavailable" and out.msg.retry_after_s == empty.core.config.retry_after_s
    assert_clean(strict.core)
    assert_clean(empty.core)
