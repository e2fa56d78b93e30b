"""deepinfer-launch: the command line.

    deepinfer-launch fetch smollm2
    deepinfer-launch generate --model smollm2 --prompt "Hello" --chat --max-tokens 64
    deepinfer-launch generate --model smollm2 --prompts-file prompts.txt --json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from deepinfer.engine.config import EngineConfig


@click.group()
def main() -> None:
    """DeepInfer: serve LLMs with a paged KV cache and continuous batching."""


@main.command()
@click.argument("name", default="smollm2")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None, help="Where to keep the model.")
def fetch(name: str, cache_dir: Path | None) -> None:
    """Fetch the reference model and print its local path (last line)."""
    from deepinfer.engine.fetch import fetch_smollm2

    if name != "smollm2":
        raise click.BadParameter(f"unknown model {name!r}; the fetchable reference model is 'smollm2'")
    click.echo(str(fetch_smollm2(cache_dir=cache_dir, progress=True)))


def engine_options(f):  # type: ignore[no-untyped-def]
    """Options shared by every command that builds an engine."""
    opts = [
        click.option("--model", default="smollm2", show_default=True,
                     help="'smollm2' (fetched on first use), a Hugging Face directory or a .gguf file."),
        click.option("--kv-cache-mb", type=int, default=512, show_default=True, help="KV cache memory budget."),
        click.option("--block-size", type=int, default=16, show_default=True),
        click.option("--max-num-seqs", type=int, default=128, show_default=True),
        click.option("--max-num-batched-tokens", type=int, default=2048, show_default=True,
                     help="Token budget of one step (longer prompts are prefilled in chunks)."),
        click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def build_engine_config(kv_cache_mb: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                        threads: int | None) -> EngineConfig:
    return EngineConfig(
        block_size=block_size,
        kv_cache_bytes=kv_cache_mb * 1024 * 1024,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_threads=threads,
    )


@main.command()
@engine_options
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeatable).")
@click.option("--prompts-file", type=click.File("r"), default=None,
              help="One prompt per line; all are submitted at once.")
@click.option("--chat", is_flag=True, help="Wrap each prompt as a user message in the model's chat template.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt per line, in input order.")
def generate(model: str, kv_cache_mb: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
             threads: int | None, prompts: tuple[str, ...], prompts_file, chat: bool, max_tokens: int,
             temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None,
             stop: tuple[str, ...], as_json: bool) -> None:
    """Generate completions with an in-process engine."""
    from deepinfer.engine.engine import LLMEngine
    from deepinfer.engine.request import InvalidRequestError, SamplingParams

    texts = list(prompts)
    if prompts_file is not None:
        texts += [line.rstrip("\n") for line in prompts_file if line.strip()]
    if not texts:
        raise click.UsageError("give --prompt TEXT or --prompts-file FILE")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            min_p=min_p, seed=seed, stop=list(stop))
    try:
        params.validate()
        config = build_engine_config(kv_cache_mb, block_size, max_num_seqs, max_num_batched_tokens, threads)
        engine = LLMEngine.load(model, config)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    tok = engine.tokenizer
    assert tok is not None
    inputs = [tok.encode_chat([{"role": "user", "content": t}]) if chat else tok.encode(t) for t in texts]
    try:
        outputs = engine.generate(inputs, params)
    except InvalidRequestError as exc:
        raise click.ClickException(str(exc)) from exc
    for out in outputs:
        if as_json:
            click.echo(json.dumps({
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason.value if out.finish_reason else None,
                "usage": out.usage.to_dict(),
            }, ensure_ascii=False))
        else:
            click.echo(out.text)
            if len(outputs) > 1:
                click.echo("-" * 40)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
