"""A Gateway for a model: its tokenizer and context length read from the model files, in front of the router.
The gateway as a process (uvicorn, signals, the supervisor's lifeline) is `deepinfer.launch.gateway_process`."""

from __future__ import annotations

from typing import Any

from deepinfer.gateway.app import Gateway
from deepinfer.gateway.limits import HttpLimits
from deepinfer.loading.fetch import resolve_model
from deepinfer.loading.identity import model_config_at
from deepinfer.text.tokenizer import Tokenizer


def load_gateway(model: str, endpoint: str, served_name: str | None = None,
                 client_options: dict[str, Any] | None = None, *, limits: HttpLimits | None = None,
                 tenant_keys: frozenset[str] | None = None, require_api_key: bool = False) -> Gateway:
    """A Gateway for `model` (a name the launcher knows, e.g. `smollm2`, or a path) in front of the router
    at `endpoint`: its tokenizer and context length read from the model, as the tokenizer service does.
    `tenant_keys` / `require_api_key`: the mesh's API keys and whether it requires one (the topology's
    router config), so the gateway can check keys on every route itself."""
    path = resolve_model(model)
    return Gateway(endpoint, served_name or model, Tokenizer.load(path), model_config_at(path).max_position_embeddings,
                   client_options=client_options or {}, limits=limits or HttpLimits(), tenant_keys=tenant_keys,
                   require_api_key=require_api_key)
