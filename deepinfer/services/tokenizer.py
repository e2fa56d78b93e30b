"""The tokenizer service: text ⇄ tokens. A thin shell around `TokenizerCore`.

Sockets: a DEALER to the router (EncodeRequest / AbortRequest in; EncodeResult, TextDeltas, ErrorReply
and heartbeats out) and a bound PULL where decode workers push their per-step DetokenizeBatch.
Stateless apart from in-flight detokenizer state, so several instances can run side by side.
"""

from __future__ import annotations

from typing import Any

import zmq.asyncio

from deepinfer.config.engine import DEFAULT_BLOCK_SIZE, DEFAULT_KV_CACHE_DTYPE
from deepinfer.loading.fetch import resolve_model
from deepinfer.loading.identity import model_identity
from deepinfer.protocol import messages as m
from deepinfer.protocol.sockets import arecv_msg, make_pull
from deepinfer.services.base import Handler, Service
from deepinfer.services.tokenizer_core import TokenizerCore
from deepinfer.text.tokenizer import Tokenizer


class TokenizerService(Service):
    role = "tokenizer"

    def __init__(self, instance: str, backend: str, detok_bind: str, ctx: zmq.asyncio.Context, model: str,
                 max_model_len: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE, **kw: Any) -> None:
        identity = model_identity(resolve_model(model), block_size, kv_cache_dtype)
        self.tokenizer = Tokenizer.load(identity.path)
        config, namespace = identity.config, identity.namespace
        super().__init__(instance, backend, ctx, block_hash_scheme=namespace.handshake_scheme, **kw)
        self.core = TokenizerCore(self.tokenizer, instance, max_model_len or config.max_position_embeddings,
                                  namespace=namespace)
        self.detok_bind = detok_bind
        self.pull: Any = None

    async def on_start(self) -> None:
        self.pull = self.socket(make_pull(self.ctx, bind=self.detok_bind,
                                          auth=self.auth.for_bind(self.detok_bind, "detok")))

    def tasks(self) -> list[Any]:
        # The workers' PULL takes token batches only: a peer that can reach it controls nothing else.
        return [self.dispatch_forever(self.pull, arecv_msg, {m.DetokenizeBatch: self._detokenize})]

    def handlers(self) -> dict[type, Handler]:
        return {m.EncodeRequest: self._encode, m.AbortRequest: self._abort}

    def idle(self) -> bool:
        return self.core.num_inflight == 0

    async def _encode(self, req: m.EncodeRequest) -> None:
        self.progress += 1
        await self.send_router(self.core.on_encode(req))

    async def _detokenize(self, batch: m.DetokenizeBatch) -> None:
        self.progress += 1
        deltas = self.core.on_detokenize(batch)
        if deltas.items:
            await self.send_router(deltas)

    async def on_router_restart(self) -> None:
        self.log.info("dropped the old router's requests", count=self.core.drop_all())

    async def _abort(self, req: m.AbortRequest) -> None:
        self.core.on_abort(req.request_id)
