"""Draft-model guessers: a smaller model sharing the target's tokenizer (`draft:PATH`), or the target's
own first L layers with its final norm and LM head (`self:L`, no extra weights).

Both run over the target's block tables: the draft's KV for position p of a request lives in the same
block id and slot as the target's. Proposing k tokens for a batch is k forwards of the draft: the
first feeds every token the draft has not seen yet (the last committed one, and after a fresh start
or a preemption the whole context), each later one feeds the previous draft token.

* `self:L` keeps no KV of its own: its layers are the target's first L, and the target's KV of those
  layers at committed positions is exactly what the draft would compute, so the draft reads it in
  place. Its writes for draft positions land past the request's committed tokens, in slots the
  target's verification overwrites in the same step before reading them.
* `draft:PATH` has its own KV tensor with the target's block count, indexed by the target's block
  ids. It tracks, per request, how far its KV is valid: up to the positions whose input tokens were
  committed (a rejected draft invalidates what followed it), reset when the request's KV epoch
  changes (a preemption rebuilt its blocks). Blocks shared through the prefix cache are rewritten by
  each request that starts (with the same values: same tokens, same draft weights).

Both run on their own attention backend, chosen once from the engine's config as the target's runner
chooses its own (`attention_backend.select_backend`).

Greedy requests get the draft's argmax (a point-mass proposal); sampled requests get a draw from the
draft's distribution under the request's own penalties, temperature and filters, with that
distribution attached for the rejection rule (verify.py). Draft draws use the request's seeded
stream at each position under their own purpose, so they never shift the target's draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.config.engine import EngineConfig
from deepinfer.config.kv import KvSpec, kv_dtype_name
from deepinfer.config.model import ConfigError
from deepinfer.engine.attention import Segment, layout
from deepinfer.engine.attention_backend import AttentionBackend, select_backend
from deepinfer.engine.models import CausalLM, build_model
from deepinfer.engine.models.llama import LlamaModel
from deepinfer.engine.sampler import DRAFT, Sampler, SamplingRow, exponential_noise, make_generator
from deepinfer.engine.speculative.base import Proposal, Proposer, SpecContext
from deepinfer.engine.speculative.registry import register_proposer


class DraftProposer(Proposer):
    cheap = False

    def __init__(self, model: CausalLM, kv: torch.Tensor, block_size: int, shares_target_kv: bool,
                 backend: AttentionBackend) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.shares_target_kv = shares_target_kv
        # Chosen once, like a model runner's: every draft forward runs on it. `bind` switches the draft model's
        # own layer loop off where the backend does not take it (a self-draft's model is its own truncated copy).
        self.backend = backend
        backend.bind(model)
        self.sampler = Sampler()
        # request id -> (kv epoch, its token count when the draft last proposed, the drafts it proposed)
        self._seen: dict[str, tuple[int, int, list[int]]] = {}

    @classmethod
    def self_draft(cls, target: object, kv: torch.Tensor | None, num_layers: int,
                   config: EngineConfig) -> DraftProposer:
        if kv is None:
            raise ConfigError("a self-draft needs the engine's model and KV tensor")
        # A Llama-family decoder, dense or mixture-of-experts: its first layers are a model of their own.
        if not isinstance(target, LlamaModel):
            arch = getattr(getattr(target, "config", None), "architecture", type(target).__name__)
            raise ConfigError(f"self:{num_layers}: a self-draft takes the first layers of a Llama-family model "
                              f"(dense or Mixtral/Qwen2-MoE); {arch!r} is not one")
        if not 1 <= num_layers < target.config.num_layers:
            raise ConfigError(f"self:{num_layers}: the model has {target.config.num_layers} layers; "
                              f"a self-draft takes 1 to {target.config.num_layers - 1} of them")
        draft = target.truncated(num_layers)
        return cls(draft, kv, config.block_size, shares_target_kv=True, backend=select_backend(config))

    @classmethod
    def from_path(cls, path: str, target: object, kv: torch.Tensor | None, config: EngineConfig) -> DraftProposer:
        from deepinfer.loading.fetch import resolve_model
        from deepinfer.loading.weights import load_model_weights

        if not isinstance(target, CausalLM) or kv is None:
            raise ConfigError("a draft model needs the engine's model and KV tensor")
        loaded = load_model_weights(resolve_model(path), config.weights, config.device)
        c = loaded.config
        if c.vocab_size != target.config.vocab_size:
            raise ConfigError(f"draft model {path!r} has a vocabulary of {c.vocab_size}; the target's is "
                              f"{target.config.vocab_size} (a draft must share the target's tokenizer)")
        model = build_model(c, loaded.state_dict, target.max_positions, config.device)
        # The draft's own pool: as many blocks as the target's (it follows the same block tables), in the
        # target's KV dtype, shaped by the draft model's spec.
        draft_spec = KvSpec.for_model(c, config.block_size, kv_dtype_name(kv.dtype))
        draft_kv = draft_spec.allocate(kv.shape[0], kv.device)
        return cls(model, draft_kv, config.block_size, shares_target_kv=False, backend=select_backend(config))

    def propose(self, batch: Sequence[SpecContext], ks: Sequence[int]) -> list[Proposal]:
        active = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        generators = {i: make_generator(batch[i].params.seed) for i in active}
        # The first forward feeds each request what its draft KV lacks, through its last committed token.
        feeds = {i: self._unseen(batch[i]) for i in active}
        for step in range(max((ks[i] for i in active), default=0)):
            live = [i for i in active if ks[i] > step]
            if step > 0:
                feeds = {i: (len(batch[i].token_ids) + step - 1, [drafts[i][-1]]) for i in live}
            logits = self._forward([(feeds[i][1], feeds[i][0], batch[i].block_ids) for i in live])
            rows = [SamplingRow(batch[i].params, batch[i].token_ids[: batch[i].num_prompt_tokens],
                                list(batch[i].token_ids[batch[i].num_prompt_tokens :]) + drafts[i], generators[i])
                    for i in live]
            with torch.inference_mode():
                q = self.sampler.probs(self.sampler.penalise(logits, rows), rows)
                for j, i in enumerate(live):
                    drafts[i].append(self._pick(q[j], rows[j]))
                    probs[i].append(q[j])
        for i in active:
            ctx = batch[i]
            self._seen[ctx.request_id] = (ctx.kv_epoch, len(ctx.token_ids), drafts[i])
        return [Proposal(drafts[i], None if batch[i].params.greedy or not drafts[i] else torch.stack(probs[i]))
                for i in range(len(batch))]

    def finished(self, ctx: SpecContext) -> None:
        self._seen.pop(ctx.request_id, None)

    def _unseen(self, ctx: SpecContext) -> tuple[int, list[int]]:
        """(first position, tokens) the draft must be fed before it can propose for `ctx`."""
        n = len(ctx.token_ids)
        if self.shares_target_kv:
            return n - 1, [ctx.token_ids[-1]]
        valid = 0
        seen = self._seen.get(ctx.request_id)
        if seen is not None and seen[0] == ctx.kv_epoch:
            _, then, proposed = seen
            # Positions up to then - 1 were fed committed tokens; position then - 1 + j was fed draft j
            # (j < len(proposed): the last draft was never fed), whose KV stands only if drafts 1..j were
            # committed.
            agree = 0
            while agree < len(proposed) - 1 and then + agree < n and ctx.token_ids[then + agree] == proposed[agree]:
                agree += 1
            valid = min(then + agree, n - 1)
        return valid, list(ctx.token_ids[valid:])

    def _pick(self, q: torch.Tensor, row: SamplingRow) -> int:
        if row.params.greedy:
            return int(q.argmax())
        noise = exponential_noise([row], q.shape[0], q.device, DRAFT)[0]
        return int((q / noise).argmax())

    def _forward(self, segments: list[tuple[list[int], int, Sequence[int]]]) -> torch.Tensor:
        """Run the draft over (tokens, first position, block ids) segments; logits [len(segments),
        vocab] at each segment's last token. A catch-up of several tokens is a prefill chunk."""
        step = layout([Segment(tokens, start, blocks, num_logits=1) for tokens, start, blocks in segments],
                      self.block_size, self.backend)
        return self.model.forward(step.input_ids, step.positions, self.kv, step.meta, step.logits_rows)


register_proposer("self", DraftProposer,
                  lambda a: DraftProposer.self_draft(a.target, a.kv, a.spec.num_layers or 1, a.config))
register_proposer("draft", DraftProposer,
                  lambda a: DraftProposer.from_path(a.spec.path or "", a.target, a.kv, a.config))
