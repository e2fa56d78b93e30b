"""deepinfer-launch fetch: download (or derive) a model and print its local path."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
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
        from deepinfer.loading.derive_moe import DEFAULT_NUM_EXPERTS, DEFAULT_TOP_K
        from deepinfer.loading.moe_report import moe_report

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
