"""The topology tree: defaults defined once, every table checked when read, a file written by `to_toml`
read back to an equal tree."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from deepinfer.launch.cli import mesh_options
from deepinfer.launch.keys import make_keys, service_auth
from deepinfer.launch.topology import (
    ROUTER_DERIVED,
    BalancerConfig,
    GatewaySpec,
    KvCacheSpec,
    RouterConfig,
    SecuritySpec,
    TokenizerSpec,
    Topology,
    TopologyError,
    WorkerSpec,
)

MINIMAL = """
[router]
frontend = "tcp://10.0.0.1:5550"
backend = "tcp://10.0.0.1:5551"
[[tokenizer]]
name = "tok"
detok = "tcp://10.0.0.1:5560"
[[worker]]
name = "w"
role = "worker"
kv = "tcp://10.0.0.2:5570"
"""


def load(tmp_path: Path, text: str) -> Topology:
    path = tmp_path / "t.toml"
    path.write_text(text)
    return Topology.load(path)


# -- defaults, defined once ---------------------------------------------------------------------------------

# Run in a fresh interpreter: deepinfer.config.engine is executed from its source with new constants before
# anything imports it; every layer must then default to the new values, EngineConfig's fields included.
CHANGED_DEFAULTS = textwrap.dedent("""
    import importlib.util, inspect, re, sys, tempfile, pathlib
    import deepinfer.config

    CHANGED = dict(DEFAULT_BLOCK_SIZE=24, DEFAULT_KV_CACHE_MB=100, DEFAULT_MAX_NUM_SEQS=7,
                   DEFAULT_MAX_NUM_BATCHED_TOKENS=999, DEFAULT_NUM_SPECULATIVE_TOKENS=5, DEFAULT_DEVICE="meta")
    path = pathlib.Path(deepinfer.config.__file__).with_name("engine.py")
    source = path.read_text()
    for name, value in CHANGED.items():
        source, n = re.subn(rf"^{name} = .*$", f"{name} = {value!r}", source, flags=re.M)
        assert n == 1, name
    spec = importlib.util.spec_from_loader("deepinfer.config.engine", loader=None, origin=str(path))
    config = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = config
    exec(compile(source, str(path), "exec"), config.__dict__)
    deepinfer.config.engine = config

    from deepinfer.launch import cli
    from deepinfer.launch.mesh import engine_config
    from deepinfer.launch.topology import RouterConfig, Topology, WorkerSpec
    from deepinfer.services.kvcache import KvCacheService
    from deepinfer.services.tokenizer import TokenizerService

    def worker_view(w):
        return (w.kv_cache_mb, w.max_num_seqs, w.max_num_batched_tokens, w.num_speculative_tokens, w.device)

    expected = (100, 7, 999, 5, "meta")
    e = config.EngineConfig()
    assert (e.block_size, e.kv_cache_bytes >> 20, e.max_num_seqs, e.max_num_batched_tokens,
            e.num_speculative_tokens, e.device) == (24, *expected[:2], 999, 5, "meta"), e
    assert worker_view(WorkerSpec("w", "worker", "k")) == expected
    local = Topology.local("m", "inproc")
    assert local.block_size == local.router.block_size == RouterConfig().block_size == 24
    assert worker_view(local.workers[0]) == expected
    f = pathlib.Path(tempfile.mkdtemp()) / "t.toml"
    f.write_text(sys.argv[1])
    loaded = Topology.load(f)
    assert loaded.block_size == loaded.router.block_size == 24 and worker_view(loaded.workers[0]) == expected
    built = engine_config(loaded.workers[0])
    assert (built.block_size, built.kv_cache_bytes >> 20, built.max_num_seqs) == (24, 100, 7)
    for command in (cli.generate, cli.chat):
        options = {p.name: p.default for p in command.params}
        assert (options["block_size"], options["kv_cache_mb"], options["max_num_seqs"],
                options["max_num_batched_tokens"], options["num_speculative_tokens"]) == (24, 100, 7, 999, 5)
    options = {p.name: p.default for p in cli.up.params}
    assert (options["kv_cache_mb"], options["num_speculative_tokens"]) == (100, 5)
    for service in (TokenizerService, KvCacheService):
        assert inspect.signature(service.__init__).parameters["block_size"].default == 24, service
    print("every layer follows")
""")


def test_changing_one_default_constant_changes_every_layer():
    out = subprocess.run([sys.executable, "-c", CHANGED_DEFAULTS, MINIMAL], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "every layer follows" in out.stdout, out.stderr


def test_router_block_size_is_derived_from_the_topology(tmp_path):
    topo = load(tmp_path, "block_size = 32\n" + MINIMAL)
    assert topo.block_size == topo.router.block_size == 32
    python_built = Topology("m", "a", "b", topo.tokenizers, topo.workers, RouterConfig(max_moves=1), block_size=8)
    assert python_built.router.block_size == 8 and python_built.router.max_moves == 1


def test_cli_engine_options_reach_the_embedded_mesh_topology():
    options = mesh_options(threads=2, kv_cache_mb=64, block_size=32, max_num_seqs=4, max_num_batched_tokens=512,
                           speculative=None, num_speculative_tokens=3, no_adaptive_speculation=True)
    topo = Topology.local("m", "inproc", disaggregated=False, **options)
    w = topo.workers[0]
    assert topo.block_size == topo.router.block_size == 32
    assert (w.threads, w.kv_cache_mb, w.max_num_seqs, w.max_num_batched_tokens) == (2, 64, 4, 512)
    assert (w.num_speculative_tokens, w.adaptive_speculation) == (3, False)
    assert (w.weights, topo.kv_cache_dtype) == ("auto", "float32")  # the defaults when not given
    options = mesh_options(threads=2, kv_cache_mb=64, block_size=32, max_num_seqs=4, max_num_batched_tokens=512,
                           speculative=None, num_speculative_tokens=3, no_adaptive_speculation=True,
                           weights="fp32", kv_cache_dtype="fp16")
    topo = Topology.local("m", "inproc", disaggregated=False, **options)
    assert (topo.workers[0].weights, topo.kv_cache_dtype) == ("fp32", "float16")


def test_weights_and_kv_dtype_reach_every_service_and_read_back(tmp_path):
    """`kv_cache_dtype` is set once, at the top level (it is part of the KV namespace, like block_size);
    `weights` per worker. Both read back from the file and reach the engine's config."""
    from deepinfer.launch.mesh import engine_config

    topo = load(tmp_path, 'kv_cache_dtype = "fp16"\n' + MINIMAL + 'weights = "native"\n')
    assert topo.kv_cache_dtype == "float16" and topo.workers[0].weights == "native"
    assert load(tmp_path, topo.to_toml()) == topo
    config = engine_config(topo.workers[0], topo.block_size, kv_cache_dtype=topo.kv_cache_dtype)
    assert (config.weights, config.kv_cache_dtype) == ("native", "float16")
    with pytest.raises(TopologyError, match="kv_cache_dtype must be one of fp32, fp16, got 'int8'"):
        load(tmp_path, 'kv_cache_dtype = "int8"\n' + MINIMAL)
    with pytest.raises(TopologyError, match="weights = 'int4': must be one of"):
        load(tmp_path, MINIMAL + 'weights = "int4"\n')


def test_stream_interval_reads_back_and_is_checked(tmp_path):
    topo = load(tmp_path, MINIMAL + "stream_interval_ms = 0\n")
    assert topo.workers[0].stream_interval_ms == 0.0 and load(tmp_path, topo.to_toml()) == topo
    assert load(tmp_path, MINIMAL).workers[0].stream_interval_ms == 50.0  # the default
    for bad in ("-1", "20000"):
        with pytest.raises(TopologyError, match="stream_interval_ms = .*milliseconds"):
            load(tmp_path, MINIMAL + f"stream_interval_ms = {bad}\n")


def test_lookup_ahead_reads_back_and_is_checked(tmp_path):
    assert load(tmp_path, MINIMAL).workers[0].lookup_ahead_steps == 2  # the default
    topo = load(tmp_path, MINIMAL + "lookup_ahead_steps = 0\n")  # looked up as a job arrives
    assert topo.workers[0].lookup_ahead_steps == 0 and load(tmp_path, topo.to_toml()) == topo
    for bad in ("-1", "65"):
        with pytest.raises(TopologyError, match="lookup_ahead_steps = .*integer"):
            load(tmp_path, MINIMAL + f"lookup_ahead_steps = {bad}\n")


def test_fetch_policy_reads_back_and_is_checked(tmp_path):
    assert load(tmp_path, MINIMAL).workers[0].fetch_policy == "plan"  # the default
    topo = load(tmp_path, MINIMAL + 'fetch_policy = "always"\n')
    assert topo.workers[0].fetch_policy == "always" and load(tmp_path, topo.to_toml()) == topo
    with pytest.raises(TopologyError, match="fetch_policy = 'sometimes': must be one of 'plan', 'always'"):
        load(tmp_path, MINIMAL + 'fetch_policy = "sometimes"\n')


def test_swap_space_reads_back_reaches_the_engine_and_is_checked(tmp_path):
    from deepinfer.launch.mesh import engine_config

    assert load(tmp_path, MINIMAL).workers[0].swap_space_mb == 256  # the default
    topo = load(tmp_path, MINIMAL + "swap_space_mb = 0\n")  # preempted requests always recompute
    assert topo.workers[0].swap_space_mb == 0 and load(tmp_path, topo.to_toml()) == topo
    assert engine_config(topo.workers[0]).swap_space_bytes == 0
    assert engine_config(load(tmp_path, MINIMAL + "swap_space_mb = 3\n").workers[0]).swap_space_bytes == 3 << 20
    with pytest.raises(TopologyError, match="swap_space_mb = -1: must not be negative"):
        load(tmp_path, MINIMAL + "swap_space_mb = -1\n")


# -- every table checked when read ---------------------------------------------------------------------------

@pytest.mark.parametrize("extra, match", [
    ("heartbeat_timeout = 3.0", "router: unknown key 'heartbeat_timeout'"),
    ("block_size = 32", "router: block_size: set block_size at the top level"),
    ('id_prefix = "x-"', "router: id_prefix: the router chooses it"),
])
def test_unknown_or_derived_router_keys_are_refused_naming_the_key_and_file(tmp_path, extra, match):
    text = MINIMAL.replace('backend = "tcp://10.0.0.1:5551"\n', f'backend = "tcp://10.0.0.1:5551"\n{extra}\n')
    with pytest.raises(TopologyError, match=match) as info:
        load(tmp_path, text)
    assert str(info.value).startswith(f"{tmp_path / 't.toml'}: ")


@pytest.mark.parametrize("text, match", [
    ("block_sise = 32\n" + MINIMAL, "unknown top-level key 'block_sise'"),
    (MINIMAL + "kv_cache_gb = 1\n", "worker w: unknown key 'kv_cache_gb'"),
    (MINIMAL.replace('detok = "tcp://10.0.0.1:5560"', 'detok = "x"\nport = 1'), "tokenizer tok: unknown key 'port'"),
    (MINIMAL + '[[kvcache]]\nname = "kv"\nendpoint = "e"\nhost = 1\n', "kvcache kv: unknown key 'host'"),
    (MINIMAL + '[security]\nkeys = "k"\n', "security: unknown key 'keys'"),
    (MINIMAL.replace('role = "worker"\n', ""), "worker w: missing key 'role'"),
])
def test_unknown_keys_anywhere_are_refused(tmp_path, text, match):
    with pytest.raises(TopologyError, match=match):
        load(tmp_path, text)


@pytest.mark.parametrize("top, router, worker, match", [
    ('block_size = "16"', "", "", "block_size = '16': must be an integer"),
    ("model = 3", "", "", "model = 3: must be a string"),
    ("", "max_moves = 1.5", "", "router: max_moves = 1.5: must be an integer"),
    ("", "require_api_key = 1", "", "router: require_api_key = 1: must be true or false"),
    ("", 'heartbeat_timeout_s = "5"', "", "router: heartbeat_timeout_s = '5': must be a number"),
    ("", 'tenants = {"a" = 1}', "", "router: tenants = {'a': 1}: must be a table with a string as each value"),
    ("", 'priority_floor = {"a" = "high"}', "", "router: priority_floor = .*: must be a table with an integer"),
    ("", 'tenants = "a"', "", "router: tenants = 'a': must be a table"),
    ("", 'placement = "random"', "", "router: placement must be one of"),  # RouterConfig's own check
    ("", "", "threads = 1.5", "worker w: threads = 1.5: must be an integer"),
    ("", "", 'kv_cache_mb = "1G"', "worker w: kv_cache_mb = '1G': must be an integer"),
    ("", "", "prefix_caching = 0", "worker w: prefix_caching = 0: must be true or false"),
])
def test_a_value_of_the_wrong_type_is_refused_at_load(tmp_path, top, router, worker, match):
    text = top + "\n" + MINIMAL.replace('backend = "tcp://10.0.0.1:5551"\n',
                                        f'backend = "tcp://10.0.0.1:5551"\n{router}\n') + worker + "\n"
    with pytest.raises(TopologyError, match=match):
        load(tmp_path, text)


def test_an_integer_where_a_number_is_wanted_is_taken_as_a_float(tmp_path):
    topo = load(tmp_path, MINIMAL.replace('5551"\n', '5551"\nheartbeat_timeout_s = 3\n', 1))
    assert topo.router.heartbeat_timeout_s == 3.0 and isinstance(topo.router.heartbeat_timeout_s, float)


def test_a_tree_built_in_python_is_checked_too(tmp_path):
    base = load(tmp_path, MINIMAL)
    with pytest.raises(TopologyError, match="block_size = '16': must be an integer"):
        dataclasses.replace(base, block_size="16")
    bad_worker = dataclasses.replace(base.workers[0], kv_cache_mb="512")
    with pytest.raises(TopologyError, match="worker w: kv_cache_mb = '512'"):
        dataclasses.replace(base, workers=(bad_worker,))
    with pytest.raises(TopologyError, match="router: id_prefix"):
        dataclasses.replace(base, router=RouterConfig(id_prefix="x-"))


def test_the_tree_is_frozen_all_the_way_down(tmp_path):
    topo = load(tmp_path, MINIMAL.replace('5551"\n', '5551"\ntenants = {"key-a" = "salt-a"}\n', 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.block_size = 32  # type: ignore[misc]
    with pytest.raises(TypeError):
        topo.router.tenants["key-b"] = "salt-b"  # type: ignore[index]
    assert dict(topo.router.tenants) == {"key-a": "salt-a"}


# -- round trip ------------------------------------------------------------------------------------------------

def every_field(tmp_path: Path) -> Topology:
    """A topology where every field of every section differs from its default (checked), so `to_toml`
    has to write each one: a field added without a TOML form fails the round trip."""
    router: dict[str, Any] = dict(
        max_queued_requests=17, max_queued_prompt_tokens=1000, heartbeat_timeout_s=2.5, progress_timeout_s=30.0,
        request_timeout_s=99.5, placement_timeout_s=3.25, max_moves=1,
        tenants={"key-a": "salt-a", "key with spaces/ü": 'salt "quoted" \\ and\ttab'}, default_cache_salt="public",
        require_api_key=True, priority_floor={"key-a": -10, "": 5}, default_priority_floor=2,
        max_inflight_per_tenant={"key-a": 64, "": 1}, default_max_inflight_per_tenant=8, retry_after_s=0.5,
        max_ttft_samples=10, placement="least_loaded", prior_prefill_tokens_per_s=1e3,
        prior_host_fetch_s_per_token=1e-6, prior_disk_fetch_s_per_token=3e-5, estimate_alpha=0.5,
        kv_resync_interval_s=1.0, max_queue_wait_s=12.5,
        max_queued_prompt_tokens_per_tenant={"key-a": 500, "": 100}, default_max_queued_prompt_tokens_per_tenant=300,
        ttft_slo_s={"key-a": 2.5, "": 7.0}, default_ttft_slo_s=4.0, tpot_slo_s={"key-a": 0.05}, default_tpot_slo_s=0.2,
        local_prefill_max_tokens=256, prefill_site="local",
        prior_handoff_s_per_block=1e-3)
    worker: dict[str, Any] = dict(device="cuda", threads=3, kv_cache_mb=64, max_num_seqs=8,
                                  max_num_batched_tokens=256, prefix_caching=False,
                                  speculative="ngram", num_speculative_tokens=6, adaptive_speculation=False,
                                  ep=2, ep_master="10.0.0.3:29500", rank_hosts=("10.0.0.3", "10.0.0.4"),
                                  ep_timeout_s=42.0, redundant_experts=3,
                                  weights="q8_0", stream_interval_ms=12.5, lookup_ahead_steps=5,
                                  fetch_policy="always", swap_space_mb=7)
    kvcache: dict[str, Any] = dict(dir=str(tmp_path / "kv dir"), host_mb=64, disk_mb=128, pool_mb=512)
    security = dict(client_keys=str(tmp_path / "clients.allowed"))
    balancer: dict[str, Any] = dict(interval_s=5.5, window_s=45.0, threshold=0.125, max_moves=3, max_moves_total=7,
                                    move_timeout_s=9.0)
    gateway: dict[str, Any] = dict(served_model_name="my model", limits={"max_body_bytes": 1024,
                                                                         "header_timeout_s": 2.5})
    # (kvcache is given below: on prefill-0, and on decode-0, a worker group whose rank 0 talks to the daemon)
    sections = ((RouterConfig, router, set(ROUTER_DERIVED)), (WorkerSpec, worker, {"name", "role", "kv", "kvcache"}),
                (KvCacheSpec, kvcache, {"name", "endpoint"}), (SecuritySpec, security, {"keys_dir"}),
                (BalancerConfig, balancer, set()), (GatewaySpec, gateway, {"name", "listen"}))
    for cls, values, elsewhere in sections:  # `elsewhere`: required (given below) or derived
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert set(values) == set(fields) - elsewhere, cls  # every other field is exercised
        assert all(values[k] != fields[k].default for k in values if fields[k].default is not dataclasses.MISSING)
    return Topology(
        model='/models/a "quoted" model', frontend="tcp://10.0.0.1:5550", backend="tcp://10.0.0.1:5551",
        tokenizers=(TokenizerSpec("tok-0", "tcp://10.0.0.1:5560"), TokenizerSpec("tok-1", "tcp://10.0.0.1:5561")),
        workers=(WorkerSpec("prefill-0", "prefill", "tcp://10.0.0.2:5570", kvcache="kv-0"),
                 WorkerSpec("decode-0", "decode", "tcp://10.0.0.3:5570", kvcache="kv-0", **worker)),
        router=RouterConfig(**router),
        kvcaches=(KvCacheSpec("kv-0", "tcp://10.0.0.2:5580", **kvcache),),
        block_size=32, kv_cache_dtype="float16",
        security=SecuritySpec(str(tmp_path / "keys"), **security),
        balancer=BalancerConfig(**balancer),
        gateways=(GatewaySpec("gw-0", "10.0.0.8:8000", **gateway), GatewaySpec("gw-1", "10.0.0.9:8000")),
    )


def test_every_field_round_trips_through_toml(tmp_path):
    topo = every_field(tmp_path)
    again = load(tmp_path, topo.to_toml())
    assert again == topo
    assert again.router.tenants["key with spaces/ü"] == 'salt "quoted" \\ and\ttab'
    assert load(tmp_path, again.to_toml()) == topo  # and the written form is stable
    assert "[router.tenants]" in topo.to_toml() and "[router.max_inflight_per_tenant]" in topo.to_toml()


def test_the_older_inline_table_form_still_reads(tmp_path):
    text = MINIMAL.replace('5551"\n', '5551"\ntenants = {"key-a" = "salt-a"}\npriority_floor = {"key-a" = -10}\n', 1)
    topo = load(tmp_path, text)
    assert dict(topo.router.tenants) == {"key-a": "salt-a"} and dict(topo.router.priority_floor) == {"key-a": -10}
    assert load(tmp_path, topo.to_toml()) == topo


def test_defaults_round_trip_and_a_value_toml_cannot_hold_is_refused(tmp_path):
    topo = Topology.local("smollm2", "ipc", tmp_path)
    assert load(tmp_path, topo.to_toml()) == topo
    with pytest.raises(TopologyError, match="progress_timeout_s = None cannot be written"):
        dataclasses.replace(topo, router=RouterConfig(progress_timeout_s=None)).to_toml()


# -- expert-parallel groups -------------------------------------------------------------------------------------

def group(tmp_path: Path, keys: str, extra: str = "") -> Topology:
    """MINIMAL with `keys` added to its worker and `extra` tables after it."""
    return load(tmp_path, MINIMAL + keys + "\n" + extra)


def test_a_group_reads_back_with_its_ranks_on_their_devices(tmp_path):
    topo = group(tmp_path, 'ep = 4\nep_master = "10.0.0.2:29500"\ndevice = "cuda"')
    w = topo.worker("w")
    assert (w.ep, w.ep_master) == (4, "10.0.0.2:29500")
    assert [w.rank_device(r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert load(tmp_path, topo.to_toml()) == topo
    cpu = group(tmp_path, 'ep = 2\nep_master = "10.0.0.2:29500"').worker("w")
    assert [cpu.rank_device(r) for r in range(2)] == ["cpu", "cpu"]
    single = group(tmp_path, 'device = "cuda:3"').worker("w")  # one rank: the device as given
    assert single.ep == 1 and single.rank_device(0) == "cuda:3"
    with pytest.raises(ValueError, match="rank 2 is not in"):
        cpu.rank_device(2)


@pytest.mark.parametrize("keys, match", [
    ("ep = 0", "worker w: ep = 0: must be an integer >= 1"),
    ('ep = "2"', "worker w: ep = '2': must be an integer"),
    ("ep = 2", 'worker w: ep = 2: needs ep_master = "host:port"'),
    ('ep = 2\nep_master = "10.0.0.2:29500"\ndevice = "cuda:1"', "worker w: device = 'cuda:1': the ranks of an"),
    ('ep = 2\nep_master = "10.0.0.2:29500"\ndevice = "mps"', "worker w: device = 'mps'"),
    ('ep = 2\nep_master = "tcp://10.0.0.2:29500"', "ep_master = 'tcp://10.0.0.2:29500': must be host:port, without"),
    ('ep = 2\nep_master = "10.0.0.2"', "ep_master = '10.0.0.2': must be host:port, with a port in 1..65535"),
    ('ep = 2\nep_master = ":29500"', "must be host:port"),
    ('ep = 2\nep_master = "10.0.0.2:0"', "must be host:port"),
    ('ep = 2\nep_master = "10.0.0.2:65536"', "must be host:port"),
    ('ep = 2\nep_master = "10.0.0.2:29500"\nrank_hosts = ["10.0.0.2"]',
     r"rank_hosts = \['10.0.0.2'\]: must name the host of each of the 2 ranks"),
    ('ep = 2\nep_master = "10.0.0.2:29500"\nrank_hosts = ["10.0.0.3", "10.0.0.2"]',
     "rank 0 binds kv = 'tcp://10.0.0.2:5570', so its host must be that endpoint's address"),
    ('ep = 2\nep_master = "10.0.0.2:29500"\nrank_hosts = ["10.0.0.2", 3]',
     "rank_hosts = .*: must be a list of a string"),
    ('rank_hosts = ["10.0.0.2", "10.0.0.3"]', "must name the host of each of the 1 ranks"),
])
def test_bad_parallel_keys_are_refused_naming_the_key(tmp_path, keys, match):
    with pytest.raises(TopologyError, match=match):
        group(tmp_path, keys)


def test_a_group_spread_over_hosts_gets_each_hosts_rank_units_bound_on_that_host_only(tmp_path):
    from deepinfer.launch.systemd import unit_files

    topo = group(tmp_path, 'ep = 3\nep_master = "10.0.0.2:29500"\nrank_hosts = ["10.0.0.2", "10.0.0.2", "10.0.0.4"]')
    w = topo.worker("w")
    assert w.rank_hosts == ("10.0.0.2", "10.0.0.2", "10.0.0.4")
    assert load(tmp_path, topo.to_toml()) == topo
    assert [w.ranks_on(h) for h in ("10.0.0.2", "10.0.0.4", "10.0.0.9")] == [[0, 1], [2], []]
    assert topo.instances_on("10.0.0.4") == ["w"]  # a rank's host runs part of the worker
    path = tmp_path / "t.toml"

    def units(host: str | None) -> dict[str, str]:
        return {n: t for n, t in unit_files(path, topo, launcher="/usr/bin/deepinfer-launch", host=host).items()
                if "-rank" in n}

    here, there, every = units("10.0.0.2"), units("10.0.0.4"), units(None)
    assert sorted(here) == ["deepinfer-worker-w-rank0.service", "deepinfer-worker-w-rank1.service"]
    assert sorted(there) == ["deepinfer-worker-w-rank2.service"] and sorted(every) == sorted(here | there)
    rank0, rank1, rank2 = here["deepinfer-worker-w-rank0.service"], here["deepinfer-worker-w-rank1.service"], \
        there["deepinfer-worker-w-rank2.service"]
    # systemd binds units of one machine: rank 0 and rank 1 to each other, rank 2 to nothing...
    assert "BindsTo=deepinfer-worker-w-rank1.service\n" in rank0
    assert "BindsTo=deepinfer-worker-w-rank0.service\n" in rank1
    assert "BindsTo" not in rank2 and "--rank 2" in rank2
    # ...and rank 2 comes back after its leader's restart ends it cleanly.
    assert "Restart=always" in rank2 and "Restart=on-failure" in rank0 and "Restart=on-failure" in rank1
    # Without rank_hosts every rank is on the worker's host, bound as one.
    local = group(tmp_path, 'ep = 3\nep_master = "10.0.0.2:29500"')
    one = unit_files(path, local, launcher="/usr/bin/deepinfer-launch", host="10.0.0.2")
    assert "BindsTo=deepinfer-worker-w-rank1.service deepinfer-worker-w-rank2.service\n" in \
        one["deepinfer-worker-w-rank0.service"]
    assert local.worker("w").ranks_on("10.0.0.2") == [0, 1, 2] and local.instances_on("10.0.0.4") == []


def test_a_group_may_use_a_cache_daemon(tmp_path):
    topo = group(tmp_path, 'ep = 2\nep_master = "10.0.0.2:29500"\nkvcache = "kv"',
                 '[[kvcache]]\nname = "kv"\nendpoint = "tcp://10.0.0.2:5580"\n')
    w = topo.worker("w")
    assert (w.ep, w.kvcache) == (2, "kv") and topo.kvcache("kv").endpoint == "tcp://10.0.0.2:5580"
    assert load(tmp_path, topo.to_toml()) == topo
    # Secured: the daemon lets in the group's rank 0, under the worker's own key (its followers connect nowhere).
    make_keys(tmp_path / "keys", topo)
    secured = dataclasses.replace(topo, security=SecuritySpec(str(tmp_path / "keys")))
    worker_key = service_auth(secured, "worker", "w").keypair
    assert worker_key is not None and "kv" in service_auth(secured, "worker", "w").server_keys
    assert service_auth(secured, "kvcache", "kv").allow["cache"].rule_for(worker_key.public) == "w"


SECOND_GROUP = '[[worker]]\nname = "w2"\nrole = "worker"\nkv = "tcp://10.0.0.2:5571"\nep = 2\nep_master = "{}"\n'


@pytest.mark.parametrize("master, extra, what", [
    ("10.0.0.1:5560", "", "tokenizer tok detok"),
    ("10.0.0.2:5570", "", "worker w kv"),
    ("10.0.0.1:5551", "", "router backend"),
    ("10.0.0.2:29500", SECOND_GROUP.format("10.0.0.2:29500"), "worker w ep_master"),
    ("0.0.0.0:5570", "", "worker w kv"),  # a wildcard binds the port on every address
    ("localhost:29500", SECOND_GROUP.format("127.0.0.1:29500"), "worker w ep_master"),
])
def test_an_ep_master_no_other_endpoint_uses(tmp_path, master, extra, what):
    with pytest.raises(TopologyError, match=f"ep_master = '[^']*' is also the {what}"):
        group(tmp_path, f'ep = 2\nep_master = "{master}"', extra)


def test_an_ep_master_may_share_a_host_or_a_port_but_not_both(tmp_path):
    topo = group(tmp_path, 'ep = 2\nep_master = "10.0.0.2:5560"', SECOND_GROUP.format("10.0.0.3:5560"))
    assert [w.ep_master for w in topo.workers] == ["10.0.0.2:5560", "10.0.0.3:5560"]
    assert group(tmp_path, 'ep_master = "10.0.0.2:5570"').worker("w").ep == 1  # unused with one rank


def test_local_topologies_give_each_group_a_free_loopback_port(tmp_path):
    topo = Topology.local("smollm2", "ipc", tmp_path, ep=3)
    masters = [w.ep_master for w in topo.workers]
    assert [w.ep for w in topo.workers] == [3, 3] and len(set(masters)) == 2
    assert [k.name for k in topo.kvcaches] == ["kvcache-0"] and all(w.kvcache == "kvcache-0" for w in topo.workers)
    assert all(m.startswith("127.0.0.1:") for m in masters)
    assert load(tmp_path, topo.to_toml()) == topo
    assert all(w.ep == 1 and w.ep_master == "" for w in Topology.local("smollm2", "ipc", tmp_path).workers)
    with pytest.raises(TopologyError, match="needs a process per rank"):
        Topology.local("smollm2", "inproc", ep=2)


# -- HTTP gateways ---------------------------------------------------------------------------------------------

GATEWAY = '\n[[gateway]]\nname = "gw"\nlisten = "0.0.0.0:8000"\n'


def test_a_gateway_table_reads_back_and_local_topologies_add_one(tmp_path):
    topo = load(tmp_path, MINIMAL + GATEWAY)
    assert topo.gateway("gw") == GatewaySpec("gw", "0.0.0.0:8000") and topo.gateway("gw").served_model_name is None
    assert load(tmp_path, topo.to_toml()) == topo
    local = Topology.local("smollm2", "ipc", tmp_path, http="127.0.0.1:8080")
    assert local.gateways == (GatewaySpec("gateway-0", "127.0.0.1:8080"),)
    assert load(tmp_path, local.to_toml()) == local
    assert Topology.local("smollm2", "ipc", tmp_path).gateways == ()
    with pytest.raises(TopologyError, match="no gateway named 'nope'"):
        topo.gateway("nope")


@pytest.mark.parametrize("extra, match", [
    ('\n[[gateway]]\nname = "gw"\nlisten = "http://0.0.0.0:8000"\n', "gateway gw: listen = 'http://0.0.0.0:8000': "
                                                                         "must be host:port, without a scheme"),
    ('\n[[gateway]]\nname = "gw"\nlisten = "0.0.0.0"\n', "gateway gw: listen = '0.0.0.0': must be host:port"),
    ('\n[[gateway]]\nname = "gw"\n', "gateway gw: missing key 'listen'"),
    ('\n[[gateway]]\nname = "gw"\nlisten = "h:1"\nport = 3\n', "gateway gw: unknown key 'port'"),
    (GATEWAY.replace('"gw"', '"w"'), "service names must be unique"),
    (GATEWAY + GATEWAY.replace('"gw"', '"gw2"'), "gateway gw2: listen = '0.0.0.0:8000' is also the gateway gw listen"),
    (GATEWAY.replace("0.0.0.0:8000", "10.0.0.1:5550"), "gateway gw: listen = '10.0.0.1:5550' is also the router "
                                                      "frontend"),
])
def test_bad_gateway_tables_are_refused_naming_the_key(tmp_path, extra, match):
    with pytest.raises(TopologyError, match=match):
        load(tmp_path, MINIMAL + extra)


def test_two_gateways_may_share_a_port_on_different_hosts(tmp_path):
    topo = load(tmp_path, MINIMAL + GATEWAY.replace("0.0.0.0", "10.0.0.5")
                + GATEWAY.replace('"gw"', '"gw2"').replace("0.0.0.0", "10.0.0.6"))
    assert [g.name for g in topo.gateways] == ["gw", "gw2"]


CLUSTER = """
model = "smollm2"
insecure = true
[router]
frontend = "tcp://10.0.0.1:5550"
backend = "tcp://10.0.0.1:5551"
[[tokenizer]]
name = "tokenizer-0"
detok = "tcp://10.0.0.1:5560"
[[worker]]
name = "prefill-0"
role = "prefill"
kv = "tcp://10.0.0.2:5570"
kvcache = "kvcache-p1"
[[worker]]
name = "decode-0"
role = "decode"
kv = "tcp://10.0.0.3:5570"
kvcache = "kvcache-d1"
[[kvcache]]
name = "kvcache-p1"
endpoint = "tcp://10.0.0.2:5580"
[[kvcache]]
name = "kvcache-d1"
endpoint = "tcp://10.0.0.3:5580"
[balancer]
[[gateway]]
name = "gateway-0"
listen = "10.0.0.1:8000"
"""


def test_each_host_of_a_cluster_gets_a_target_of_its_own_services(tmp_path: Path) -> None:
    from deepinfer.launch.systemd import unit_files

    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER)
    topo = Topology.load(path)
    assert topo.instances_on("10.0.0.1") == ["router", "tokenizer-0", "balancer", "gateway-0"]
    assert topo.instances_on("10.0.0.2") == ["prefill-0", "kvcache-p1"]
    assert topo.instances_on("10.0.0.3") == ["decode-0", "kvcache-d1"]
    assert topo.instances_on("10.0.0.9") == []

    def wants(host: str | None) -> set[str]:
        target = unit_files(path, topo, launcher="/usr/bin/deepinfer-launch", host=host)["deepinfer.target"]
        return set(next(line for line in target.splitlines() if line.startswith("Wants=")).split("=", 1)[1].split())

    assert wants("10.0.0.3") == {"deepinfer-worker@decode-0.service", "deepinfer-kvcache@kvcache-d1.service"}
    assert wants("10.0.0.1") == {"deepinfer-router@router.service", "deepinfer-tokenizer@tokenizer-0.service",
                                 "deepinfer-balancer@balancer.service", "deepinfer-gateway@gateway-0.service"}
    assert wants(None) == wants("10.0.0.1") | wants("10.0.0.2") | wants("10.0.0.3")  # every host's, together
    with pytest.raises(TopologyError, match="no service of the topology binds on 10.0.0.9"):
        unit_files(path, topo, host="10.0.0.9")
