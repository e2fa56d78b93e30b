"""deepinfer-launch: the command line's click group, which wires in each command group's module.

    deepinfer-launch fetch smollm2
    deepinfer-launch fetch smollm2-moe --experts 16 --top-k 12 --report
    deepinfer-launch generate --model smollm2 --prompt "Hello" --chat --max-tokens 64
    deepinfer-launch generate --model smollm2 --prompts-file prompts.txt --json

The commands live by job: cli_fetch (fetch), cli_generate (generate, chat), cli_up (up), cli_drain (drain),
cli_status (status), cli_deploy (service, systemd, metrics, keys); cli_options holds the option sets they share,
operator_link the operator commands' line to the router.
"""

from __future__ import annotations

import sys

import click

from deepinfer.launch.cli_deploy import keys, metrics, service, systemd
from deepinfer.launch.cli_drain import drain
from deepinfer.launch.cli_fetch import fetch
from deepinfer.launch.cli_generate import chat, generate
from deepinfer.launch.cli_options import mesh_options
from deepinfer.launch.cli_status import status
from deepinfer.launch.cli_up import up

__all__ = ["chat", "configure_logging", "drain", "fetch", "generate", "keys", "main", "mesh_options", "metrics",
           "service", "status", "systemd", "up"]


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


for _command in (fetch, generate, chat, up, drain, status, service, systemd, metrics, keys):
    main.add_command(_command)


if __name__ == "__main__":
    main()
