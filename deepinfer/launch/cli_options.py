"""The option sets deepinfer-launch's commands share, and their values as the mesh's keyword arguments.

`engine_options` (every command that builds an engine: the model, the KV pool, batching, threads, speculation,
weights and KV precision), `sampling_options` (generate and chat), their checks (run while the command line is
parsed, before any model loads), and `mesh_options` / `speculation` / `numerics`, which turn the parsed values
into Topology.local / EmbeddedMesh keyword arguments.
"""

from __future__ import annotations

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
from deepinfer.launch.sections import DEFAULT_MODEL


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
                          "draft:PATH (a smaller model with the same tokenizer); ngram:tree[=N] and suffix:tree[=N] "
                          "propose draft trees of up to N (4) branches. Runs where decoding does: "
                          "on decode and co-located workers. Greedy output does not change. Default: off."),
        click.option("--num-speculative-tokens", type=click.IntRange(MIN_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS),
                     default=DEFAULT_NUM_SPECULATIVE_TOKENS, show_default=True,
                     help="The most draft tokens (a tree's nodes) verified per request per step."),
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


def check_listen(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse a HOST:PORT that does not parse while parsing (`up --http`, `metrics --listen`)."""
    from deepinfer.launch.sections import split_host_port

    if value is not None:
        try:
            split_host_port(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


INSECURE_HELP = ("Run even though the topology's tcp:// endpoints have no [security] (CURVE): anyone who can reach "
                 "them can submit work, join the mesh as a service and read prompts and outputs. Only on a network "
                 "where every host and user is trusted. (A topology file can say `insecure = true` instead.)")


def refuse_unsecured(topology: Any, insecure: bool, flag: str | None = "--insecure") -> None:
    """Fail closed before anything starts: a topology with tcp:// endpoints and no [security] is refused unless
    the operator said otherwise (`Topology.check_secured`), as a ClickException naming the endpoints."""
    from deepinfer.launch.topology import TopologyError

    try:
        topology.check_secured(insecure, flag=flag)
    except TopologyError as exc:
        raise click.ClickException(str(exc)) from None


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


def sampling_params(max_tokens: int, temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None,
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
