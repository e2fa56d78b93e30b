"""Expert parallelism, engine side: `LLMEngine`'s expert-parallel setup, expert load counters and placement
moves (`ExpertParallelMixin`).

With `ep_group` (see `deepinfer.engine.ep`), an `LLMEngine` is one rank of a group that
splits every MoE layer's experts between ranks. Each rank has its own requests, KV and scheduler, but
the ranks' forwards meet at every MoE layer, so `step()` is a collective: every rank calls it the same
number of times, and each call runs exactly one forward — of zero tokens when this rank has nothing
scheduled. Who decides that the group steps (while any rank has work) is the caller's business:
`has_unfinished()` stays local. A failure inside the forward (a peer died, a collective timed out)
raises `ExpertParallelError` from `step()`, carrying the terminal outputs of the step's requests; the
engine refuses to step again. Between steps the group can move the engine to a new expert placement
(`stage_placement` in the background, then `switch_placement` at a step the whole group agrees on; see
`deepinfer.engine.ep.move`). Not available under expert parallelism: a draft-model speculator (its
forwards would not be collective; n-gram and suffix guessers are fine), `prompt_logits` and
`generate` (they run forwards on this rank's schedule alone).

What `step()` itself does as a collective (the zero-token forward, refusing to step after a failure) is
the step loop's, in engine.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer.config.engine import EngineConfig, parse_speculative
from deepinfer.config.model import ConfigError
from deepinfer.engine.ep.experts import EpStats
from deepinfer.engine.ep.group import EpGroup, ExpertParallelError
from deepinfer.engine.ep.move import PlacementRefused, PlacementStager, shard_movable
from deepinfer.engine.ep.placement import ExpertPlacement
from deepinfer.engine.models.moe import moe_blocks
from deepinfer.engine.speculative.registry import registration

if TYPE_CHECKING:
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.engine.models.base import CausalLM
    from deepinfer.loading.weights import LoadedModel


class ExpertParallelMixin:
    """The expert-parallel part of `LLMEngine` (module docstring)."""

    # The engine's state this part uses, set by `LLMEngine.__init__` (the ep_ ones by `_init_expert_parallel`).
    config: EngineConfig
    runner: ModelRunner
    ep_group: EpGroup | None
    ep_placement: ExpertPlacement | None
    _ep_stats: EpStats | None
    _ep_failure: ExpertParallelError | None
    _ep_moves: PlacementStager | None

    def _init_expert_parallel(self, model: CausalLM, loaded: LoadedModel, ep_group: EpGroup | None,
                              ep_placement: ExpertPlacement | None) -> None:
        """Make the engine one rank of `ep_group` (when given): shard `model`'s experts per `ep_placement`
        (default: `ExpertPlacement.static`), before the runner is built around it."""
        self.ep_group = ep_group
        self.ep_placement = None
        self._ep_stats = None
        self._ep_failure = None  # set by the first failed forward: the engine then refuses to step
        self._ep_moves = None
        if ep_group is not None:
            self.ep_placement, self._ep_stats, self._ep_moves = shard_movable(
                model, loaded, ep_group, ep_placement, self.config.redundant_experts)

    def expert_counts(self) -> torch.Tensor:
        """Assignments per logical expert of every MoE layer since the last call, [num_moe_layers,
        num_experts] int64 on the host (a token counts once for each expert it chose), then zero. Under
        expert parallelism a rank counts its own tokens: the group's histogram is the sum over ranks.
        Forwards a self-draft runs through the shared layers count too. [0, 0] for a dense model."""
        blocks = moe_blocks(self.runner.model)
        if not blocks:
            return torch.zeros(0, 0, dtype=torch.int64)
        return torch.stack([b.experts.take_counts() for b in blocks])  # type: ignore[attr-defined]

    def expert_computed(self) -> list[int]:
        """Under expert parallelism, per MoE layer the assignments this rank's experts computed since the
        last call (for any rank's tokens: the rank's measured expert load), then zero; [] otherwise."""
        if self.ep_group is None:
            return []
        return [b.experts.take_computed() for b in moe_blocks(self.runner.model)]  # type: ignore[attr-defined]

    def ep_stats(self) -> EpStats | None:
        """Expert-parallel dispatch/compute/combine times and bytes since the last call (then zero);
        None without an expert-parallel group."""
        return self._ep_stats.take() if self._ep_stats is not None else None

    # -- placement moves (deepinfer.engine.ep.move; the group decides when to switch) ----------------

    def stage_placement(self, placement: ExpertPlacement) -> None:
        """Start loading this rank's experts of `placement` in the background; the current placement
        keeps serving. PlacementRefused without expert parallelism or for a table that cannot follow
        the current one."""
        self._placement_stager().stage(placement)

    def staged_placement(self) -> tuple[int | None, str | None]:
        """(the version staged and ready to switch to, or None; why the staging failed, or None)."""
        return self._ep_moves.status() if self._ep_moves is not None else (None, None)

    def switch_placement(self, version: int) -> None:
        """Between steps: serve from the staged placement `version` from the next step on (every rank of
        the group must switch before the same step)."""
        self.ep_placement = self._placement_stager().switch(version)

    def drop_staged_placement(self) -> None:
        if self._ep_moves is not None:
            self._ep_moves.drop()

    def stop_staging(self) -> None:
        """Drop any staging and wait for its loading thread to end: before the process exits."""
        if self._ep_moves is not None:
            self._ep_moves.close()

    def _placement_stager(self) -> PlacementStager:
        if self._ep_moves is None:
            raise PlacementRefused("this engine is not a rank of an expert-parallel group")
        return self._ep_moves


def check_ep_config(config: EngineConfig, group: EpGroup) -> None:
    """What expert parallelism needs of the engine's configuration (ConfigError otherwise)."""
    if torch.device(config.device).type != group.device.type:
        raise ConfigError(f"the engine's device {config.device!r} is not the expert-parallel group's "
                          f"{str(group.device)!r}")
    if config.speculative is not None and not registration(parse_speculative(config.speculative).kind).cls.cheap:
        raise ConfigError(f"speculative {config.speculative!r} runs a draft model's forwards beside the step's, "
                          "which the expert-parallel group cannot join; use ngram or suffix speculation")
