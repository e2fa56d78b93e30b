"""deepinfer-launch generate and chat: the commands that send requests to a mesh, a running one (--endpoint)
or an embedded one they start in this process.

A mesh that cannot serve yet (a fresh `up` whose router is not bound, or whose workers still load) is waited
for, up to --wait seconds: the client tries its handshake that long (a connect timeout at a time), and
a request the router refuses as "unavailable" (no live tokenizer or workers; refused before admission, so
nothing ran) is sent again once the router's retry hint has passed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from deepinfer.launch.cli_options import (
    check_weights_for_model,
    engine_options,
    mesh_options,
    sampling_options,
    sampling_params,
)

DEFAULT_WAIT_S = 300.0  # how long a request waits for a mesh that cannot serve yet
RETRY_S = 1.0  # between tries when the router gave no retry hint
CONNECT_TRY_S = 10.0  # one try at a router's handshake (the client's own connect timeout)


def wait_option(f):  # type: ignore[no-untyped-def]
    return click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=DEFAULT_WAIT_S, show_default=True,
                        help="Seconds a request waits for a mesh that cannot serve yet (a fresh `up`: its router "
                             "not bound, its workers loading) before it fails.")(f)


def _check_keys(endpoint: str | None, keys_dir: Path | None) -> None:
    if keys_dir is not None and not (endpoint or "").startswith("tcp://"):
        raise click.UsageError("--keys secures a tcp:// --endpoint of a running mesh (ipc and embedded need none)")


def _client(endpoint: str, api_key: str | None, keys_dir: Path | None, client_key: str, wait_s: float) -> Any:
    """A Client for `endpoint`, waiting up to `wait_s` for a router to answer its handshake (saying so on stderr
    once it has waited a connect timeout); with `keys_dir`, CURVE as that directory's tenant key `client_key`."""
    from deepinfer.protocol.auth import load_client_keys
    from deepinfer.protocol.client import Client, MeshError, RouterLostError

    keys: dict[str, Any] = {}
    if keys_dir is not None:
        try:
            pair, router_key = load_client_keys(keys_dir, client_key)
        except (OSError, ValueError) as exc:
            raise click.ClickException(f"--keys {keys_dir}: {exc}") from exc
        keys = dict(curve_keys=pair, server_key=router_key)
    deadline, said = time.monotonic() + wait_s, False
    try:
        while True:
            try:
                return Client(endpoint, api_key=api_key,
                              connect_timeout_s=max(0.1, min(CONNECT_TRY_S, deadline - time.monotonic())), **keys)
            except RouterLostError:  # no router answered within the try: a fresh `up` may not have bound it yet
                if time.monotonic() >= deadline:
                    raise
                if not said:
                    click.echo(f"waiting up to {wait_s:g}s for a router at {endpoint}", err=True)
                    said = True
    except MeshError as exc:  # a secured front never completes a keyless handshake: it looks like no router
        hint = " (if the mesh is secured, give --keys)" if keys_dir is None and endpoint.startswith("tcp://") else ""
        raise click.ClickException(f"{exc}{hint}") from exc


def when_servable(send: Callable[[], Any], wait_s: float, endpoint: str) -> Any:
    """`send()`'s result, sending again while it raises UnavailableError (the mesh cannot serve yet) for up to
    `wait_s`, at the router's retry hint; says once on stderr that it waits."""
    from deepinfer.protocol.client import UnavailableError

    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            return send()
        except UnavailableError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            if not said:
                click.echo(f"waiting up to {wait_s:g}s for the mesh at {endpoint} to serve ({exc})", err=True)
                said = True
            time.sleep(min(left, exc.retry_after_s or RETRY_S))


def generate_all(client: Any, requests: list[dict[str, Any]], wait_s: float, endpoint: str) -> list[Any]:
    """`client.generate_many(requests)`, the requests the router refused as "unavailable" sent again (see
    `when_servable`): each in its place, a result or a MeshError."""
    from deepinfer.protocol.client import UnavailableError

    results: list[Any] = [None] * len(requests)
    pending = list(range(len(requests)))

    def send() -> None:
        nonlocal pending
        got = client.generate_many([requests[i] for i in pending])
        for i, r in zip(pending, got):
            results[i] = r
        refused = [(i, r) for i, r in zip(pending, got) if isinstance(r, UnavailableError)]
        if refused:
            pending = [i for i, _ in refused]
            raise refused[0][1]

    with contextlib.suppress(UnavailableError):  # past the wait: the refusals stay in their places
        when_servable(send, wait_s, endpoint)
    return results


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


@click.command()
@engine_options
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeatable).")
@click.option("--prompts-file", type=click.File("r"), default=None,
              help="One prompt per line; all are submitted at once.")
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt per line, in input order.")
@click.option("--json-schema", "json_schema", type=click.File("r"), default=None,
              help="Structured output: every answer is JSON valid against the schema in this file.")
@click.option("--regex", default=None, help="Structured output: every answer matches this regular expression.")
@wait_option
def generate(model: str, kv_cache_mb: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
             threads: int | None, ep: int, weights: str | None, kv_cache_dtype: str | None,
             speculative: str | None, num_speculative_tokens: int, no_adaptive_speculation: bool,
             prompts: tuple[str, ...], prompts_file, chat: bool, max_tokens: int,
             temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None,
             stop: tuple[str, ...], endpoint: str | None, api_key: str | None, keys_dir: Path | None, client_key: str,
             as_json: bool, json_schema, regex: str | None, wait_s: float) -> None:
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
    params = sampling_params(max_tokens, temperature, top_p, top_k, min_p, seed, stop)
    if json_schema is not None and regex is not None:
        raise click.UsageError("give at most one of --json-schema and --regex")
    if json_schema is not None:
        try:
            params["json_schema"] = json.load(json_schema)
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--json-schema") from None
    elif regex is not None:
        params["regex"] = regex
    specs = [dict(messages=[{"role": "user", "content": t}]) if chat else dict(prompt=t) for t in texts]
    options = mesh_options(threads, kv_cache_mb, block_size, max_num_seqs, max_num_batched_tokens, speculative,
                           num_speculative_tokens, no_adaptive_speculation, weights, kv_cache_dtype)
    with _mesh_endpoint(endpoint, model, options) as ep, \
            _client(ep, api_key, keys_dir, client_key, wait_s) as client:
        results = generate_all(client, [{**spec, **params} for spec in specs], wait_s, ep)
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


@click.command()
@engine_options
@sampling_options
@click.option("--system", default=None, help="A system message.")
@wait_option
def chat(model: str, kv_cache_mb: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
         threads: int | None, ep: int, weights: str | None, kv_cache_dtype: str | None, speculative: str | None,
         num_speculative_tokens: int, no_adaptive_speculation: bool, chat: bool, max_tokens: int,
         temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None, stop: tuple[str, ...],
         endpoint: str | None, api_key: str | None, keys_dir: Path | None, client_key: str,
         system: str | None, wait_s: float) -> None:
    """Chat interactively (answers stream as they are generated; an empty line or Ctrl-D quits)."""
    from deepinfer.protocol import messages as m
    from deepinfer.protocol.client import MeshError

    _check_keys(endpoint, keys_dir)
    if endpoint is None:
        check_weights_for_model(model, weights)
    params = sampling_params(max_tokens, temperature, top_p, top_k, min_p, seed, stop)
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    options = mesh_options(threads, kv_cache_mb, block_size, max_num_seqs, max_num_batched_tokens, speculative,
                           num_speculative_tokens, no_adaptive_speculation, weights, kv_cache_dtype)
    with _mesh_endpoint(endpoint, model, options) as ep, \
            _client(ep, api_key, keys_dir, client_key, wait_s) as client:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            try:
                for msg in when_servable(lambda: _started(client.stream(messages=history, **params)), wait_s, ep):
                    if isinstance(msg, m.StreamDelta):
                        click.echo(msg.text, nl=False)
                    else:
                        click.echo()
                        history.append({"role": "assistant", "content": msg.text})
            except MeshError as exc:
                click.echo(f"\nerror: {exc}", err=True)
                history.pop()


def _started(stream: Iterator[Any]) -> Iterator[Any]:
    """`stream` with its first message already received: a refusal (the router answers it first) raises here,
    before anything is printed, so the request can be sent again."""
    first = next(stream)

    def rest() -> Iterator[Any]:
        yield first
        yield from stream

    return rest()
