"""deepinfer-launch: the command line.

    deepinfer-launch fetch smollm2
    deepinfer-launch fetch smollm2-moe --experts 16 --top-k 12 --report
    deepinfer-launch generate --model smollm2 --prompt "Hello" --chat --max-tokens 64
    deepinfer-launch generate --model smollm2 --prompts-file prompts.txt --json
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from deepinfer.config.engine import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_CACHE_MB,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_WEIGHTS,
    KV_CACHE_DTYPES,
    MAX_SPECULATIVE_TOKENS,
    MIN_SPECULATIVE_TOKENS,
    WEIGHTS_MODES,
)

# Every option default below is a named constant defined once (config.engine, launch.sections), the one the
# topology and the services use too; the light specs module keeps `--help` from importing the mesh.
from deepinfer.launch.sections import DEFAULT_DISK_CACHE_MB, DEFAULT_HOST_CACHE_MB, DEFAULT_MODEL
from deepinfer.services.balancer_config import BALANCER_DEFAULTS


def configure_logging(as_json: bool, level: str) -> None:
    """structlog to stderr (stdout carries results): JSON lines in production, readable on a terminal."""
    import logging

    import structlog

    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


@click.group()
@click.option("--log-json", is_flag=True, envvar="DEEPINFER_LOG_JSON", help="Log JSON lines (for production).")
@click.option("--log-level", default="warning", envvar="DEEPINFER_LOG_LEVEL", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(log_json: bool, log_level: str) -> None:
    """DeepInfer: serve LLMs with a paged KV cache and continuous batching."""
    configure_logging(log_json, log_level)


@main.command()
@click.argument("name", default="smollm2")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None, help="Where to keep the model.")
@click.option("--experts", type=int, default=None,
              help="smollm2-moe: experts per layer, dividing SmolLM2's 1536 MLP neurons. Default: 16.")
@click.option("--top-k", type=int, default=None, help="smollm2-moe: experts chosen per token. Default: 12.")
@click.option("--report", is_flag=True,
              help="smollm2-moe: also print its perplexity against dense SmolLM2 on a fixed text and the "
                   "per-layer expert-load histogram (a minute or two on a CPU).")
def fetch(name: str, cache_dir: Path | None, experts: int | None, top_k: int | None, report: bool) -> None:
    """Fetch the reference model and print its local path (last line).

    smollm2 is SmolLM2-135M-Instruct (a GGUF file). smollm2-moe is a Mixtral-format Hugging Face directory
    derived from it, not trained: each layer's MLP split into experts by neurons, with a router fitted to
    them (deepinfer/loading/derive_moe.py); built on first use, then reused."""
    from deepinfer.loading.fetch import check_moe_shape, fetch_smollm2, fetch_smollm2_moe

    if name == "smollm2":
        if experts is not None or top_k is not None or report:
            raise click.UsageError("--experts, --top-k and --report apply to smollm2-moe only")
        click.echo(str(fetch_smollm2(cache_dir=cache_dir, progress=True)))
    elif name == "smollm2-moe":
        from deepinfer.loading.derive_moe import DEFAULT_NUM_EXPERTS, DEFAULT_TOP_K, moe_report

        experts = DEFAULT_NUM_EXPERTS if experts is None else experts
        top_k = DEFAULT_TOP_K if top_k is None else top_k
        try:
            check_moe_shape(experts, top_k)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        path = fetch_smollm2_moe(experts, top_k, cache_dir=cache_dir, progress=True)
        if report:
            click.echo(moe_report(fetch_smollm2(cache_dir=cache_dir, progress=False), path).format())
        click.echo(str(path))
    else:
        raise click.BadParameter(f"unknown model {name!r}; the fetchable models are 'smollm2' and 'smollm2-moe'")


def _check_speculative(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse an unknown method while parsing, before any model loads."""
    from deepinfer.launch.sections import speculative_problem

    problem = None if value is None else speculative_problem(value)
    if problem is not None:
        raise click.BadParameter(problem)
    return value


def speculation_options(f):  # type: ignore[no-untyped-def]
    """Speculative decoding: the decoding side (decode and co-located workers) proposes and verifies."""
    opts = [
        click.option("--speculative", metavar="METHOD", default=None, callback=_check_speculative,
                     help="Speculative decoding: ngram, suffix, self:L (the model's first L layers as the draft) or "
                          "draft:PATH (a smaller model with the same tokenizer). Runs where decoding does: "
                          "on decode and co-located workers. Greedy output does not change. Default: off."),
        click.option("--num-speculative-tokens", type=click.IntRange(MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS),
                     default=DEFAULT_NUM_SPECULATIVE_TOKENS, show_default=True,
                     help="The most draft tokens proposed per request per step."),
        click.option("--no-adaptive-speculation", is_flag=True,
                     help="Always propose up to --num-speculative-tokens instead of letting the controller "
                          "choose each step's count from measured costs and acceptance."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def speculation(speculative: str | None, num_speculative_tokens: int, no_adaptive_speculation: bool) -> dict[str, Any]:
    """The speculation options as Topology.local / EmbeddedMesh keyword arguments."""
    return dict(speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                adaptive_speculation=not no_adaptive_speculation)


def numerics_options(f):  # type: ignore[no-untyped-def]
    """How the workers hold weights and KV (`up` takes them too; a topology file sets them per worker and at
    its top level). None: the default (`up` tells a given option from a default by it)."""
    opts = [
        click.option("--weights", type=click.Choice(WEIGHTS_MODES), default=None,
                     help="native: compute from a GGUF file's Q8_0/Q4_0/Q4_1 blocks (a quarter to an eighth of "
                          "fp32's bytes per step); fp32: dequantise at load; q8_0: quantise a Hugging Face "
                          f"checkpoint on load. Default: {DEFAULT_WEIGHTS} (native for a GGUF file on CPU)."),
        click.option("--kv-cache-dtype", type=click.Choice(list(KV_CACHE_DTYPES)), default=None,
                     help="KV cache element type: fp16 halves the KV bytes in the pool, the cache tiers and on the "
                          "wire (attention still computes in fp32). Default: fp32."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def check_weights_for_model(model: str, weights: str | None) -> None:
    """Refuse `--weights native` for a model that is not a GGUF file before any service starts (a worker
    would refuse it at load, and under `up` the supervisor would restart it in vain)."""
    if weights != "native":
        return
    from deepinfer.loading.fetch import resolve_model

    try:
        path = resolve_model(model)
    except FileNotFoundError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None
    if path.suffix != ".gguf":
        raise click.BadParameter(f"native weights are a GGUF file's packed blocks, and {model!r} is a Hugging Face "
                                 "checkpoint: use --weights q8_0 (quantise on load) or fp32",
                                 param_hint="--weights")


def numerics(weights: str | None, kv_cache_dtype: str | None) -> dict[str, str]:
    """The given `numerics_options` as Topology.local / EmbeddedMesh keyword arguments."""
    given = dict(weights=weights, kv_cache_dtype=kv_cache_dtype)
    return {k: v for k, v in given.items() if v is not None}


def engine_options(f):  # type: ignore[no-untyped-def]
    """Options shared by every command that builds an engine."""
    f = speculation_options(f)
    f = numerics_options(f)
    opts = [
        click.option("--model", default=DEFAULT_MODEL, show_default=True,
                     help="'smollm2' (fetched on first use), a Hugging Face directory or a .gguf file."),
        click.option("--kv-cache-mb", type=int, default=DEFAULT_KV_CACHE_MB, show_default=True,
                     help="KV cache memory budget."),
        click.option("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, show_default=True),
        click.option("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, show_default=True),
        click.option("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS, show_default=True,
                     help="Token budget of one step (longer prompts are prefilled in chunks)."),
        click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)."),
        click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True, callback=_check_embedded_ep,
                     help="Expert-parallel ranks: the embedded mesh runs in this one process, so only 1; for "
                          "more, start `deepinfer-launch up --ep N` and pass its --endpoint."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _check_embedded_ep(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """Refuse --ep N > 1 while parsing: the embedded mesh runs every service as a task of this process, and
    an expert-parallel group needs a process per rank; a mesh at --endpoint has its own groups."""
    if value > 1:
        raise click.BadParameter(f"{value} ranks need a process each, and the embedded mesh is this one "
                                 f"process: start `deepinfer-launch up --ep {value}` and pass its --endpoint")
    return value


def _check_listen(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from deepinfer.launch.sections import split_host_port

    if value is not None:
        try:
            split_host_port(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return value

def sampling_options(f):  # type: ignore[no-untyped-def]
    opts = [
        click.option("--chat", is_flag=True, help="Wrap each prompt as a user message in the model's chat template."),
        click.option("--max-tokens", type=int, default=128, show_default=True),
        click.option("--temperature", type=float, default=0.0, show_default=True),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--top-k", type=int, default=0, show_default=True),
        click.option("--min-p", type=float, default=0.0, show_default=True),
        click.option("--seed", type=int, default=None),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--endpoint", default=None,
                     help="A running mesh's client endpoint; without it an embedded mesh is started."),
        click.option("--api-key", default=None, help="Tenant key (selects the tenant's cache namespace)."),
        click.option("--keys", "keys_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
                     default=None, help="A `deepinfer-launch keys` directory: CURVE to a secured --endpoint, as the "
                                        "tenant key clients/NAME.key_secret (see --client-key)."),
        click.option("--client-key", default="client", show_default=True,
                     help="Which tenant key pair of --keys to use."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _params(max_tokens: int, temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None,
            stop: tuple[str, ...]) -> dict[str, Any]:
    from deepinfer.engine.request import SamplingParams

    params = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                  seed=seed, stop=list(stop))
    try:
        SamplingParams(**params).validate()  # fail fast, before any model loads
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    return params


def mesh_options(threads: int | None, kv_cache_mb: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, speculative: str | None, num_speculative_tokens: int,
                 no_adaptive_speculation: bool, weights: str | None = None,
                 kv_cache_dtype: str | None = None) -> dict[str, Any]:
    """`engine_options` as Topology.local / EmbeddedMesh keyword arguments (the embedded mesh's workers)."""
    return dict(threads=threads, kv_cache_mb=kv_cache_mb, block_size=block_size, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                **speculation(speculative, num_speculative_tokens, no_adaptive_speculation),
                **numerics(weights, kv_cache_dtype))


def _check_keys(endpoint: str | None, keys_dir: Path | None) -> None:
    if keys_dir is not None and not (endpoint or "").startswith("tcp://"):
        raise click.UsageError("--keys secures a tcp:// --endpoint of a running mesh (ipc and embedded need none)")


def _client(endpoint: str, api_key: str | None, keys_dir: Path | None, client_key: str) -> Any:
    """A Client for `endpoint`; with `keys_dir`, CURVE as that directory's tenant key `client_key`."""
    from deepinfer.protocol.auth import load_client_keys
    from deepinfer.protocol.client import Client, MeshError

    keys: dict[str, Any] = {}
    if keys_dir is not None:
        try:
            pair, router_key = load_client_keys(keys_dir, client_key)
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"--keys {keys_dir}: {exc}") from exc
        keys = dict(curve_keys=pair, server_key=router_key)
    try:
        return Client(endpoint, api_key=api_key, **keys)
    except MeshError as exc:  # a secured front never completes a keyless handshake: it looks like no router
        hint = " (if the mesh is secured, give --keys)" if keys_dir is None and endpoint.startswith("tcp://") else ""
        raise click.ClickException(f"{exc}{hint}") from exc


@contextlib.contextmanager
def _mesh_endpoint(endpoint: str | None, model: str, options: dict[str, Any]) -> Iterator[str]:
    """`endpoint`, else the endpoint of an embedded mesh built with `options` (see `mesh_options`)."""
    if endpoint:
        yield endpoint
        return
    from deepinfer.launch.mesh import EmbeddedMesh

    try:
        mesh = EmbeddedMesh(model, **options)
        with mesh as ep:
            yield ep
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc


@main.command()
@engine_options
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeatable).")
@click.option("--prompts-file", type=click.File("r"), default=None,
              help="One prompt per line; all are submitted at once.")
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt per line, in input order.")
def generate(model: str, kv_cache_mb: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
             threads: int | None, ep: int, weights: str | None, kv_cache_dtype: str | None,
             speculative: str | None, num_speculative_tokens: int, no_adaptive_speculation: bool,
             prompts: tuple[str, ...], prompts_file, chat: bool, max_tokens: int,
             temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None,
             stop: tuple[str, ...], endpoint: str | None, api_key: str | None, keys_dir: Path | None, client_key: str,
             as_json: bool) -> None:
    """Generate completions through the mesh (a running one, or an embedded one)."""
    from deepinfer.protocol.client import MeshError

    _check_keys(endpoint, keys_dir)
    if endpoint is None:
        check_weights_for_model(model, weights)
    texts = list(prompts)
    if prompts_file is not None:
        texts += [line.rstrip("\n") for line in prompts_file if line.strip()]
    if not texts:
        raise click.UsageError("give --prompt TEXT or --prompts-file FILE")
    params = _params(max_tokens, temperature, top_p, top_k, min_p, seed, stop)
    specs = [dict(messages=[{"role": "user", "content": t}]) if chat else dict(prompt=t) for t in texts]
    options = mesh_options(threads, kv_cache_mb, block_size, max_num_seqs, max_num_batched_tokens, speculative,
                           num_speculative_tokens, no_adaptive_speculation, weights, kv_cache_dtype)
    with _mesh_endpoint(endpoint, model, options) as ep, _client(ep, api_key, keys_dir, client_key) as client:
        results = client.generate_many([{**spec, **params} for spec in specs])
    failed = False
    for r in results:
        if isinstance(r, MeshError):
            failed = True
            click.echo(f"error: {r}", err=True)
            if as_json:
                click.echo(json.dumps({"error": {"code": r.code, "message": str(r)}}))
            continue
        if as_json:
            click.echo(json.dumps({
                "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                "usage": dataclasses.asdict(r.usage),  # every UsageWire field: cache tiers, speculation
                "timings": {"ttft_s": r.timings.ttft_s, "e2e_s": r.timings.e2e_s},
            }, ensure_ascii=False))
        else:
            click.echo(r.text)
            if len(results) > 1:
                click.echo("-" * 40)
    sys.stdout.flush()
    if failed:
        sys.exit(1)


@main.command()
@engine_options
@sampling_options
@click.option("--system", default=None, help="A system message.")
def chat(model: str, kv_cache_mb: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
         threads: int | None, ep: int, weights: str | None, kv_cache_dtype: str | None, speculative: str | None,
         num_speculative_tokens: int, no_adaptive_speculation: bool, chat: bool, max_tokens: int,
         temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None, stop: tuple[str, ...],
         endpoint: str | None, api_key: str | None, keys_dir: Path | None, client_key: str,
         system: str | None) -> None:
    """Chat interactively (answers stream as they are generated; an empty line or Ctrl-D quits)."""
    from deepinfer.protocol import messages as m
    from deepinfer.protocol.client import MeshError

    _check_keys(endpoint, keys_dir)
    if endpoint is None:
        check_weights_for_model(model, weights)
    params = _params(max_tokens, temperature, top_p, top_k, min_p, seed, stop)
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    options = mesh_options(threads, kv_cache_mb, block_size, max_num_seqs, max_num_batched_tokens, speculative,
                           num_speculative_tokens, no_adaptive_speculation, weights, kv_cache_dtype)
    with _mesh_endpoint(endpoint, model, options) as ep, _client(ep, api_key, keys_dir, client_key) as client:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            try:
                for msg in client.stream(messages=history, **params):
                    if isinstance(msg, m.StreamDelta):
                        click.echo(msg.text, nl=False)
                    else:
                        click.echo()
                        history.append({"role": "assistant", "content": msg.text})
            except MeshError as exc:
                click.echo(f"\nerror: {exc}", err=True)
                history.pop()


@main.command()
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--topology", type=click.Path(exists=True, path_type=Path), default=None,
              help="A topology file; otherwise one of each service on this host.")
@click.option("--inproc", is_flag=True, help="Run every service as a task in this process.")
@click.option("--colocated", is_flag=True, help="One worker doing prefill and decode instead of a P/D pair.")
@click.option("--prefill", "num_prefill", type=int, default=1, show_default=True)
@click.option("--decode", "num_decode", type=int, default=1, show_default=True)
@click.option("--tokenizers", "num_tokenizers", type=int, default=1, show_default=True)
@click.option("--threads", type=int, default=None,
              help="torch threads per worker, shared by the ranks of an --ep group (default: a share of the cores, "
                   "a share per rank).")
@click.option("--ep", type=click.IntRange(min=1), default=None,
              help="Expert parallelism: every worker is a group of N ranks, a process each (on CUDA rank R uses "
                   "cuda:R), rendezvousing on a free 127.0.0.1 port; a rank that dies restarts its group. "
                   "Default: 1.")
@click.option("--kv-cache-mb", type=int, default=DEFAULT_KV_CACHE_MB, show_default=True)
@click.option("--run-dir", type=click.Path(path_type=Path), default=None,
              help="Where ipc sockets, the topology and logs go (default: a new temporary directory, removed "
                   "at exit; in a directory given here only the sockets and generated topology are removed).")
@click.option("--log-dir", type=click.Path(path_type=Path), default=None,
              help="Where each service's log goes, kept after exit (default: the run directory).")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="The disk tier of the KV cache (default: $DEEPINFER_KVCACHE_DIR or ~/.cache/deepinfer/kvcache).")
@click.option("--host-cache-mb", type=int, default=DEFAULT_HOST_CACHE_MB, show_default=True,
              help="DRAM tier of the KV cache.")
@click.option("--disk-cache-mb", type=int, default=DEFAULT_DISK_CACHE_MB, show_default=True,
              help="Disk tier of the KV cache.")
@click.option("--no-kvcache", is_flag=True, help="Run without a cache daemon (workers still reuse their own pool).")
@click.option("--no-prefix-caching", is_flag=True, help="No KV reuse at all: every prompt is computed in full.")
@click.option("--redundant-experts", type=click.IntRange(min=0), default=None,
              help="MoE with --ep: extra expert replicas per layer in each group's starting placement, the room the "
                   "expert balancer moves hot experts into. Default: max(1, experts // 8); 0: none.")
@click.option("--no-balancer", is_flag=True,
              help="No expert balancer. By default one runs when the workers are --ep groups of an MoE model.")
@click.option("--balancer-interval", type=click.FloatRange(min=0, min_open=True), default=None,
              help=f"Seconds between the expert balancer's looks at each group. "
                   f"Default: {BALANCER_DEFAULTS.interval_s}.")
@click.option("--balancer-window", type=click.FloatRange(min=0, min_open=True), default=None,
              help=f"Seconds of expert-load reports it weighs. Default: {BALANCER_DEFAULTS.window_s}.")
@click.option("--http", metavar="HOST:PORT", default=None, callback=_check_listen,
              help="Also run an OpenAI-compatible HTTP gateway listening there (/v1/completions, "
                   "/v1/chat/completions, ...); its URL is printed when the mesh is ready. With --topology, "
                   "add a [[gateway]] table instead.")
@speculation_options
@numerics_options
def up(model: str, topology: Path | None, inproc: bool, colocated: bool, num_prefill: int, num_decode: int,
       num_tokenizers: int, threads: int | None, ep: int | None, kv_cache_mb: int, run_dir: Path | None,
       log_dir: Path | None, cache_dir: Path | None, host_cache_mb: int, disk_cache_mb: int, no_kvcache: bool,
       no_prefix_caching: bool, redundant_experts: int | None, no_balancer: bool, balancer_interval: float | None,
       balancer_window: float | None, http: str | None, speculative: str | None, num_speculative_tokens: int,
       no_adaptive_speculation: bool, weights: str | None, kv_cache_dtype: str | None) -> None:
    """Start the mesh on this host, print the client endpoint, and serve until SIGINT/SIGTERM.
    With --topology, every worker option (speculation, --ep and the expert balancer's too) comes from the
    file, per worker (and its [balancer] table)."""
    from deepinfer.launch.topology import Topology

    balancing = (redundant_experts, "--redundant-experts", "`redundant_experts`"), \
        (balancer_interval, "--balancer-interval", "[balancer] interval_s"), \
        (balancer_window, "--balancer-window", "[balancer] window_s"), \
        (no_balancer or None, "--no-balancer", "a [balancer] table, or none")
    for given, option, key in ((speculative, "--speculative", "`speculative`"), (ep, "--ep", "`ep` and `ep_master`"),
                               (weights, "--weights", "`weights`"), (kv_cache_dtype, "--kv-cache-dtype",
                                                                     "`kv_cache_dtype` at the top level"),
                               *balancing):
        if topology is not None and given is not None:  # it would be silently ignored
            raise click.UsageError(f"{option} configures the workers `up` builds; with --topology, set {key} "
                                   f"per worker in the file")
    if topology is not None and http is not None:
        raise click.UsageError("--http adds a gateway to the topology `up` builds; with --topology, add a "
                               "[[gateway]] table (name, listen) to the file")
    if inproc and http is not None:
        raise click.UsageError("--http runs the gateway as a process of its own under the supervisor: drop --inproc")
    if inproc and (ep or 1) > 1:
        raise click.UsageError("--inproc runs every service in this process, and an --ep group needs a process "
                               "per rank: drop --inproc")
    if topology is None:
        check_weights_for_model(model, weights)
    temporary = run_dir is None  # made here: removed whole at exit
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="deepinfer-run-"))  # (mode 0700)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    from deepinfer.launch.supervisor import UnsafeRunDir, check_ipc_dirs, check_private_dir

    try:  # an existing --run-dir is reused only if private (it is not silently repaired)
        check_private_dir(run_dir)
        if topology is not None:
            check_ipc_dirs(Topology.load(topology))
    except UnsafeRunDir as e:
        raise click.ClickException(str(e)) from None
    cache = dict(kvcache=not (no_kvcache or no_prefix_caching), cache_dir=cache_dir, host_cache_mb=host_cache_mb,
                 disk_cache_mb=disk_cache_mb, prefix_caching=not no_prefix_caching)
    spec_kw = speculation(speculative, num_speculative_tokens, no_adaptive_speculation)
    local = dict(disaggregated=not colocated, num_prefill=num_prefill, num_decode=num_decode,
                 num_tokenizers=num_tokenizers, threads=threads, kv_cache_mb=kv_cache_mb, **cache, **spec_kw,
                 **numerics(weights, kv_cache_dtype))
    made: list[Path] = []  # what this run put in a run directory the user gave (removed at exit; logs stay)
    try:
        if inproc:
            from deepinfer.launch.mesh import serve_inproc

            topo = Topology.local(model, "inproc", **local)
            topo = dataclasses.replace(topo, frontend=f"ipc://{run_dir}/router-frontend.sock")
            made += _ipc_paths(topo, run_dir)
            serve_inproc(topo, on_ready=lambda: _announce(topo.frontend))
            return
        if topology is None:
            topology = run_dir / "topology.toml"
            made.append(topology)
            balancer = expert_balancer(model, ep or 1, no_balancer, balancer_interval, balancer_window)
            topology.write_text(Topology.local(model, "ipc", run_dir, ep=ep or 1, redundant_experts=redundant_experts,
                                               balancer=balancer, http=http, **local).to_toml())
        made += _ipc_paths(Topology.load(topology), run_dir)
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        logs = f"logs in {log_dir or run_dir}" + (" until exit" if temporary and log_dir is None else "")
        _share_metrics_dir(run_dir / "metrics")
        _supervise(topology, log_dir or run_dir, logs)
    finally:
        _remove_run_files(run_dir, temporary, made)


def expert_balancer(model: str, ep: int, off: bool, interval_s: float | None,
                    window_s: float | None) -> Any:
    """The `[balancer]` settings `up` gives its topology: a BalancerConfig when the workers are expert-parallel
    groups (ep > 1) of an MoE model (its config says so) and `off` is not set, else None."""
    if off or ep <= 1:
        return None
    from deepinfer.loading.fetch import resolve_model
    from deepinfer.loading.identity import model_config_at

    if model_config_at(resolve_model(model)).moe is None:
        return None  # a dense model has no experts to balance
    given = {k: v for k, v in (("interval_s", interval_s), ("window_s", window_s)) if v is not None}
    return dataclasses.replace(BALANCER_DEFAULTS, **given)


def _share_metrics_dir(metrics_dir: Path) -> None:
    """Every child `up` starts writes its metrics samples to `metrics_dir` (in the run directory: emptied now;
    a temporary run directory goes at exit with it, one the user gave keeps it), which gateways export."""
    import os

    from deepinfer.metrics import MULTIPROC_ENV, prepare_dir

    prepare_dir(metrics_dir)
    os.environ[MULTIPROC_ENV] = str(metrics_dir)  # the children inherit it; process_exited reads it here


def _supervise(topology: Path, log_dir: Path, logs: str) -> None:
    """Start the supervisor's children and keep them up until SIGINT/SIGTERM, then drain and stop them."""
    from deepinfer.launch.exit_notes import ExitNotifier
    from deepinfer.launch.keys import supervisor_auth
    from deepinfer.launch.supervisor import Supervisor, gateway_url

    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sup = Supervisor(topology, log_dir=log_dir)
    sup.on_exit = notes = ExitNotifier(sup.topology.backend, supervisor_auth(sup.topology))
    sup.start()
    try:
        sup.wait_ready(lambda: stopping)
        if not stopping:
            _announce(sup.topology.frontend, logs, [gateway_url(g.listen) for g in sup.topology.gateways])
        while not stopping:
            sup.poll()
            time.sleep(0.2)
    finally:
        sup.stop()
        notes.close()


def _ipc_paths(topology: Any, run_dir: Path) -> list[Path]:
    """The ipc:// socket files of a topology that lie in `run_dir`."""
    endpoints = [topology.frontend, topology.backend, *(t.detok for t in topology.tokenizers),
                 *(w.kv for w in topology.workers), *(k.endpoint for k in topology.kvcaches)]
    paths = [Path(e.removeprefix("ipc://")) for e in endpoints if e.startswith("ipc://")]
    return [p for p in paths if p.parent.resolve() == run_dir.resolve()]


def _remove_run_files(run_dir: Path, temporary: bool, made: list[Path]) -> None:
    """`up` leaves nothing behind: a temporary run directory goes whole (its logs too: --log-dir keeps
    them); from a directory the user gave, only the sockets and topology this run made (its logs stay).
    A launcher killed with SIGKILL cannot do this; its directory stays."""
    if temporary:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for path in made:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _announce(endpoint: str, extra: str = "", urls: list[str] | None = None) -> None:
    """Two lines (what scripts read: the second is the endpoint), then one per HTTP gateway: its base URL."""
    click.echo(f"deepinfer mesh ready; client endpoint: {endpoint}" + (f" ({extra})" if extra else ""))
    click.echo(endpoint)
    for url in urls or []:
        click.echo(f"OpenAI-compatible HTTP API: {url}/v1")
    sys.stdout.flush()


@main.command()
@click.argument("role", type=click.Choice(["router", "tokenizer", "worker", "kvcache", "balancer", "gateway"]))
@click.option("--topology", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--name", default=None, help="The service's name in the topology.")
@click.option("--index", type=int, default=None, help="Or its position among the topology's services of ROLE.")
@click.option("--rank", type=int, default=0, show_default=True,
              help="An expert-parallel worker's rank in [0, ep): 0 speaks for the group to the mesh, 1..ep-1 "
                   "follow it (engine only).")
def service(role: str, topology: Path, name: str | None, index: int | None, rank: int) -> None:
    """Run one service of a topology (what a systemd unit runs)."""
    from deepinfer.launch.supervisor import UnsafeRunDir, check_ipc_dirs
    from deepinfer.launch.topology import Topology, TopologyError

    topo = Topology.load(topology)
    try:
        check_ipc_dirs(topo)  # as up does: a unit or a hand-started service binds only where others cannot reach
    except UnsafeRunDir as exc:
        raise click.ClickException(str(exc)) from None
    if name is None:
        names = {"router": ["router"], "tokenizer": [t.name for t in topo.tokenizers],
                 "worker": [w.name for w in topo.workers], "kvcache": [k.name for k in topo.kvcaches],
                 "balancer": ["balancer"] if topo.balancer is not None else [],
                 "gateway": [g.name for g in topo.gateways]}[role]
        if index is None or not 0 <= index < len(names):
            raise click.UsageError(f"give --name or --index in [0, {len(names)}) for {role}")
        name = names[index]
    if rank != 0:
        if role != "worker":
            raise click.UsageError("--rank names a rank of an expert-parallel worker; a " + role + " has none")
        try:
            ep = topo.worker(name).ep
        except TopologyError as exc:
            raise click.UsageError(str(exc)) from None
        if not 0 < rank < ep:
            raise click.UsageError(f"--rank {rank}: worker {name} has ep = {ep}, so its ranks are 0..{ep - 1}")
        from deepinfer.launch.mesh import engine_config
        from deepinfer.services.group.follower import run_follower  # torch.distributed: only in a follower

        config = engine_config(topo.worker(name), topo.block_size, rank, topo.kv_cache_dtype)
        sys.exit(run_follower(topo, name, rank, config))
    if role == "gateway":
        from deepinfer.launch.gateway_process import run_gateway

        try:
            topo.gateway(name)
        except TopologyError as exc:
            raise click.UsageError(str(exc)) from None
        run_gateway(topo, name)
        return
    from deepinfer.launch.mesh import run_service

    run_service(topo, role, name)


@main.command()
@click.option("--topology", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Directory for the unit files.")
@click.option("--user", default="deepinfer", show_default=True,
              help="The (existing, unprivileged) user every unit runs as.")
def systemd(topology: Path, out: Path, user: str) -> None:
    """Write systemd units for a topology (templates per role, a target that starts every instance)."""
    from deepinfer.launch.systemd import write_units

    for path in write_units(topology, out, user=user):
        click.echo(str(path))


@main.command()
@click.option("--listen", default="0.0.0.0:9400", show_default=True, callback=_check_listen, metavar="HOST:PORT")
@click.option("--dir", "directory", type=click.Path(path_type=Path), default=None,
              help="The host's metrics directory, where the services write their samples (default: "
                   "$PROMETHEUS_MULTIPROC_DIR; systemd units use /run/deepinfer/metrics).")
def metrics(listen: str, directory: Path | None) -> None:
    """Serve GET /metrics for a host that runs services but no HTTP gateway (a gateway serves the same text),
    until SIGINT/SIGTERM."""
    import os
    import threading

    from deepinfer.launch.sections import split_host_port
    from deepinfer.metrics import MULTIPROC_ENV, serve

    if directory is not None:
        os.environ[MULTIPROC_ENV] = str(directory)
    if not os.environ.get(MULTIPROC_ENV):
        raise click.UsageError(f"give --dir (or set {MULTIPROC_ENV}): the directory the services write to")
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with serve(*split_host_port(listen)) as server:
        click.echo(f"metrics on http://{listen.rpartition(':')[0]}:{server.port}/metrics")
        sys.stdout.flush()
        stop.wait()


@main.command()
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--topology", type=click.Path(exists=True, path_type=Path), required=True)
def keys(directory: Path, topology: Path) -> None:
    """Make CURVE key pairs for a topology's services, the supervisor and a first client, in DIRECTORY (0700;
    existing keys are kept). Name it in the topology's [security] table: keys_dir = "DIRECTORY"."""
    from deepinfer.launch.keys import make_keys
    from deepinfer.launch.topology import Topology

    for path in make_keys(directory, Topology.load(topology)):
        click.echo(str(path))


if __name__ == "__main__":
    main()
