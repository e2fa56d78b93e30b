"""The engine as the services drive it: `ServingEngine`, the calls a worker, its engine thread and its
cache client make of an engine. Two classes implement it: `LLMEngine` (one engine) and a worker group's
leader, `deepinfer.services.group.engine.GroupEngine` (N ranks seen as one engine). Both match it member
for member, with the same parameter names; tests/unit/test_engine_interface.py checks that, so a call
added to one engine and not the other fails there.

What only a group has (its idle `keepalive`, its load summed over ranks, the expert placement calls) is
not part of it: the worker holds a group as such and passes the engine thread its keepalive.

Every call is made on the engine's own thread (`deepinfer.services.engine_thread`), between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from deepinfer.cache.hashing import BlockHash, CacheNamespace
    from deepinfer.config.engine import EngineConfig
    from deepinfer.config.kv import KvSpec
    from deepinfer.engine.engine import EngineStats
    from deepinfer.engine.request import Logprob, RequestOutput, SamplingParams

__all__ = ["CachedNames", "PrefixTarget", "ServingEngine"]


class PrefixTarget(Protocol):
    """Where one request's cached-prefix lookup and import go (`ServingEngine.cache_route`): the engine
    itself, or the one rank of a group the request is placed on."""

    def cached_prefix_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` are device-resident now (nothing is taken: a step may evict them)."""
        ...

    def import_cached_blocks(self, hashes: Sequence[BlockHash], kv: torch.Tensor | Sequence[torch.Tensor],
                             tier: str, keep_resident: Sequence[BlockHash] = ()) -> int:
        """Name free blocks hashes[i] holding block i of `kv`, fetched from `tier`, holding the chain's
        `keep_resident` head meanwhile; how many were imported (0 if a head block is gone)."""
        ...


class CachedNames(Protocol):
    """The device tier's block names (`ServingEngine.pool`), which the worker publishes to the router."""

    def cached_hashes(self) -> list[BlockHash]:
        """Every name now cached (a snapshot)."""
        ...

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(names added, names removed) since the last drain: the net change from the last snapshot."""
        ...


class ServingEngine(Protocol):
    """An engine a worker serves: requests in, `step()` outputs out, KV handoff and prefix-cache calls."""

    # -- what the engine is ----------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (a group's: every rank's)."""
        ...

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint, which the worker announces to the router."""
        ...

    @property
    def kv_spec(self) -> KvSpec:
        """The layout of one KV block, as `export_kv` gives it and `add_prefilled_request` takes it."""
        ...

    @property
    def cache_namespace(self) -> CacheNamespace:
        """The namespace block names live in (model, KV layout, tokenizer)."""
        ...

    @property
    def stats(self) -> EngineStats:
        """Monotonic counters since start (a group's summed over its ranks)."""
        ...

    @property
    def pool(self) -> CachedNames:
        """The device tier's block names, for the router's prefix index."""
        ...

    # -- requests and the loop -----------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0, *, prefill_only: bool = False, cache_salt: str | None = None,
                    resume_output_ids: Sequence[int] = ()) -> str:
        """Queue a request; its id. Raises InvalidRequestError, leaving the engine untouched."""
        ...

    def abort(self, request_id: str) -> bool:
        """End whatever is live under `request_id` (request, held request, reservation); False if nothing."""
        ...

    def has_unfinished(self) -> bool:
        """Whether `step()` has work: a request is waiting, running or owes its terminal output."""
        ...

    def step(self) -> list[RequestOutput]:
        """Advance every scheduled request by one forward; the outputs produced, each request's last with
        `finished` (or `handoff`) set."""
        ...

    # -- prefill side of a handoff ---------------------------------------------------------------

    @property
    def num_held(self) -> int:
        """Requests held after prefill, their KV waiting for `export_kv` and `release`."""
        ...

    def export_kv(self, request_id: str) -> torch.Tensor:
        """A copy of a held request's KV, block by block (HandoffError if it is not held)."""
        ...

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks; False if it is not held."""
        ...

    # -- decode side of a handoff ----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """KV blocks free now (a group's summed over its ranks)."""
        ...

    @property
    def num_reserved_blocks(self) -> int:
        """KV blocks set aside by reservations."""
        ...

    def reserve(self, reservation_id: str, num_blocks: int, lease_s: float, now: float | None = None) -> bool:
        """Set `num_blocks` free blocks aside for a handoff, for `lease_s`; False, changing nothing, if short."""
        ...

    def expire_reservations(self, now: float | None = None) -> list[str]:
        """Free the reservations whose lease has run out; their ids."""
        ...

    def cancel_reservation(self, reservation_id: str) -> bool:
        """Free a reservation now; False if it is unknown."""
        ...

    def add_prefilled_request(self, request_id: str, prompt_token_ids: Sequence[int], first_token: int,
                              params: SamplingParams, kv: torch.Tensor, reservation_id: str | None = None,
                              priority: int = 0, first_logprob: Logprob | None = None,
                              cache_salt: str | None = None, resume_output_ids: Sequence[int] = ()) -> str:
        """Continue a request prefilled elsewhere from its exported `kv` and `first_token`, in the blocks of
        `reservation_id` (or free ones); its id. Raises InvalidRequestError, HandoffError or NoFreeBlocksError."""
        ...

    # -- prefix cache, between steps -------------------------------------------------------------

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        """The chain hashes of the full blocks of `token_ids`, as a request with this salt names them."""
        ...

    def cache_route(self, request_id: str, hashes: Sequence[BlockHash]) -> PrefixTarget:
        """Where request `request_id`'s cached-prefix lookup and import go; its `add_request` goes there too."""
        ...

    def export_cached_blocks(self, hashes: Sequence[BlockHash]) -> tuple[list[BlockHash], torch.Tensor | None]:
        """Those of `hashes` that are cached, in order, and a copy of their KV (None when none is)."""
        ...
