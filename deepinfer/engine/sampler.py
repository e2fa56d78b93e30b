"""Token selection for one engine step: logit bias, penalties, greedy or filtered random sampling, logprobs.

Order of operations on a row's logits: its `logit_bias` is added, then penalties, then temperature and the
filters. Reported logprobs are taken before all of them: the model's raw log-softmax (vLLM's default), so
they describe the model, not the sampling policy.

Determinism contract: a row's token depends only on its own logits, its `SamplingParams` and, for a
seeded row, the state of its own `torch.Generator`. Two rules keep it so:

* every tensor op is row-wise (reductions, sorts and scans run along the vocabulary only, never
  across rows), and a filter is applied to exactly the rows that enable it, so neighbours in the
  batch and the row's index cannot change what a row sees;
* a seeded row's randomness is keyed by position: the noise for output token i is drawn from the
  row's generator freshly seeded with `stream_seed(seed, i, purpose)`. A token therefore depends only
  on its logits and (seed, i) — never on how many tokens earlier steps drew, how many tokens a step
  produces (speculative decoding commits several at once), or on which engine drew the ones before
  (a prefill engine samples token 0, a decode engine continues at token 1 with nothing to replay).

Random choice is an exponential race: argmax_i(p_i / E_i) with E_i ~ Exp(1) i.i.d. picks i with
probability p_i / sum(p). Unlike `torch.multinomial` over a batch it lets every row draw its noise
from a different generator while the arithmetic stays one batched op.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer.engine.request import Logprob, SamplingParams
from deepinfer.grammar import apply_bitmask_

_NEG_INF = float("-inf")
# Lower bound for the exponential noise: a draw of exactly 0 would turn a masked token's 0 / 0 into
# NaN, which argmax would pick. With q >= tiny a masked token scores exactly 0 while the most likely
# kept token scores > 0, so a masked token can never win.
_TINY = torch.finfo(torch.float32).tiny


# Purposes of a seeded row's streams at one position: sampling the target's token, the two draws
# of the speculative rejection rule (see deepinfer.engine.speculative.verify), and a draft model's own draw.
NOISE, ACCEPT, RESIDUAL, DRAFT = 0, 1, 2, 3
_MASK64 = (1 << 64) - 1


def stream_seed(seed: int, position: int, purpose: int = NOISE) -> int:
    """The generator seed for one draw of a seeded request: SplitMix64 over (seed, position, purpose),
    so neighbouring positions and purposes get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + purpose * 0x8CB92BA72F3D8DD7) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class SamplingRow:
    """One sequence to pick a token for in this step: the token at output position
    `len(output_token_ids)`, given the tokens before it.

    `generator` is the request's scratch generator (create it once with `make_generator(params.seed)`);
    it is re-seeded per draw from (seed, position), so its prior state never matters. It is None exactly
    when `params.seed` is None, and then the row samples from torch's global RNG.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None
    # An output constraint's allowed tokens at this position (deepinfer.grammar's int32 bitmask row), or
    # None: every token. Applied last, after bias and penalties, so nothing can bring a forbidden token back.
    mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Falling back to the global RNG would silently break the seed's reproducibility promise.
        if self.params.seed is not None and self.generator is None:
            raise ValueError("a seeded request needs its own generator: make_generator(params.seed)")

    @property
    def position(self) -> int:
        return len(self.output_token_ids)

    def seeded(self, purpose: int) -> torch.Generator:
        """The row's generator, seeded for `purpose` at its position (seeded rows only)."""
        assert self.generator is not None and self.params.seed is not None
        self.generator.manual_seed(stream_seed(self.params.seed, self.position, purpose))
        return self.generator


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for `seed`, or None for an unseeded request.

    Generator streams differ between device types, so a seed reproduces its tokens on the same kind
    of device. A generator on the logits' device saves a host-to-device copy of the noise each step;
    any device works.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Picks one token per row. Stateless: per-request RNG state lives in the rows' generators."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[tuple[int, Logprob | None]]:
        """`logits` is [len(rows), vocab] and may be modified in place (penalties are written into
        it). Returns (token_id, Logprob or None) per row, in row order."""
        n = len(rows)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {n} rows")
        if n == 0:
            return []
        if all(_is_plain_greedy(row.params) for row in rows):
            # Fast path, taken every decode step of a greedy batch: one kernel and one sync. A constrained row
            # keeps its argmax when the constraint allows it (then it is also the first maximum among the allowed
            # tokens: every earlier token is below it); only a row whose argmax is forbidden is masked and redone.
            tokens = first_max(logits).tolist()
            redo = [i for i, row in enumerate(rows) if row.mask is not None and not _allowed(row.mask, tokens[i])]
            for i in redo:
                row_logits = logits[i : i + 1].float()
                apply_bitmask_(row_logits, rows[i].mask.view(1, -1), [0])  # type: ignore[union-attr]
                tokens[i] = int(first_max(row_logits)[0])
            return [(token, None) for token in tokens]

        params = [row.params for row in rows]
        raw = self.raw_logprobs(logits, rows)  # before penalise writes into `logits`
        logits = self.penalise(logits, rows)
        # From here on `logits` holds the biased, penalised logits and is only read: sampling works on
        # its own copy.

        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            tokens = first_max(logits)
        elif len(sampled) == n:
            tokens = _sample(logits, rows)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=logits.device)
            greedy_idx = _index([i for i, p in enumerate(params) if p.greedy], logits.device)
            tokens[greedy_idx] = first_max(logits.index_select(0, greedy_idx))
            sampled_idx = _index(sampled, logits.device)
            tokens[sampled_idx] = _sample(logits.index_select(0, sampled_idx), [rows[i] for i in sampled])

        token_ids: list[int] = tokens.tolist()
        return list(zip(token_ids, self.logprobs(raw, rows, token_ids), strict=True))

    def raw_logprobs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
        """[n, vocab] fp32 log-softmax of the raw logits (before bias and penalties) in the rows that ask for
        logprobs (the other rows are left unset: nobody reads them), or None when no row asks. Take it
        before `penalise`, which writes into fp32 logits."""
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if not wanted:
            return None
        if len(wanted) == len(rows):
            return logits.float().log_softmax(dim=-1)
        raw = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        idx = _index(wanted, logits.device)
        raw[idx] = logits.index_select(0, idx).float().log_softmax(dim=-1)
        return raw

    def penalise(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """`logits` with each row's logit bias added, then its penalties applied (in place), as fp32."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
        if biased:
            _apply_bias(logits, [rows[i] for i in biased], biased)
        penalised = [i for i, row in enumerate(rows) if _has_penalty(row.params)]
        if penalised:
            _apply_penalties(logits, [rows[i] for i in penalised], penalised)
        masked = [i for i, row in enumerate(rows) if row.mask is not None]
        if masked:
            bitmask = torch.empty((len(rows), rows[masked[0]].mask.shape[-1]), dtype=torch.int32)  # type: ignore[union-attr]
            for i in masked:
                bitmask[i] = rows[i].mask
            apply_bitmask_(logits, bitmask, masked)
        return logits

    def probs(self, penalised: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[n, vocab] the distribution each row samples from: softmax of the penalised logits over
        temperature, after the top-k, top-p and min-p filters; a greedy row is one-hot at its argmax."""
        out = torch.zeros_like(penalised)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if greedy:
            idx = _index(greedy, penalised.device)
            top = first_max(penalised.index_select(0, idx))
            out[idx, top] = 1.0
        sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
        if sampled:
            idx = _index(sampled, penalised.device)
            out.index_copy_(0, idx, _filtered_probs(penalised.index_select(0, idx), [rows[i] for i in sampled]))
        return out

    def logprobs(self, raw: torch.Tensor | None, rows: list[SamplingRow], token_ids: list[int]) -> list[Logprob | None]:
        """Per row, the Logprob of `token_ids[i]` (and the top alternatives) under `raw` (`raw_logprobs` of
        the same rows) when the row asks for logprobs, else None."""
        results: list[Logprob | None] = [None] * len(rows)
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if wanted:
            assert raw is not None and raw.shape[0] == len(rows)
            idx = _index(wanted, raw.device)
            logprobs = token_logprobs(raw.index_select(0, idx), [token_ids[i] for i in wanted],
                                      [rows[i].params.logprobs or 0 for i in wanted])
            for i, logprob in zip(wanted, logprobs, strict=True):
                results[i] = logprob
        return results


def _allowed(mask: torch.Tensor, token: int) -> bool:
    """Whether bit `token` of a bitmask row (deepinfer.grammar's layout) is set."""
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _is_plain_greedy(p: SamplingParams) -> bool:
    return p.temperature == 0.0 and p.logprobs is None and not _has_penalty(p) and not p.logit_bias


def _apply_bias(logits: torch.Tensor, rows: list[SamplingRow], positions: list[int]) -> None:
    """Add each row's logit_bias to its logits (at `positions`), in place: one scatter for all rows. Ids are
    unique per row (a mapping), so no two additions meet; ids outside the logits are skipped (validation
    refuses them against the model's vocabulary before any request runs)."""
    vocab = logits.shape[1]
    at_rows: list[int] = []
    at_ids: list[int] = []
    values: list[float] = []
    for pos, row in zip(positions, rows, strict=True):
        for token_id, bias in row.params.logit_bias.items():
            if 0 <= token_id < vocab:
                at_rows.append(pos)
                at_ids.append(token_id)
                values.append(float(bias))
    if values:
        device = logits.device
        logits.index_put_((_index(at_rows, device), _index(at_ids, device)),
                          torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def _index(positions: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=device)


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """[len(values), 1] fp32, to broadcast one value per row across the vocabulary."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] fp32 occurrence counts, from one scatter_add over a padded id tensor.

    Padding uses id `vocab`, which lands in a spare last column that is dropped. fp32 counts are
    exact up to 2**24 occurrences.
    """
    lengths = [len(s) for s in seqs]
    width = max(lengths)
    counts = torch.zeros((len(seqs), vocab + 1), dtype=torch.float32, device=device)
    if width == 0:
        return counts[:, :vocab]
    flat = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long)
    if int(flat.min()) < 0 or int(flat.max()) >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}) to be penalised")
    # Padding is built on the host with one masked assignment: a boolean mask enumerates positions
    # in row-major order, which is exactly the order of `flat`.
    padded = torch.full((len(seqs), width), vocab, dtype=torch.long)
    padded[torch.arange(width) < torch.tensor(lengths).unsqueeze(1)] = flat
    padded = padded.to(device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], positions: list[int]) -> None:
    """Write penalised logits for `rows` (at `positions` of `logits`) in place.

    repetition_penalty (HF): over prompt and output tokens, positive logits are divided by it and
    negative ones multiplied. presence/frequency (OpenAI): over output tokens only,
    logit -= presence * [count > 0] + frequency * count. A disabled penalty (1 or 0) is an exact
    identity in floating point, so rows with different penalty kinds can share the same ops.
    """
    device = logits.device
    vocab = logits.shape[1]
    whole = len(positions) == logits.shape[0]
    idx = None if whole else _index(positions, device)
    x = logits if idx is None else logits.index_select(0, idx)

    output_counts = _token_counts([row.output_token_ids for row in rows], vocab, device)
    repetition = [row.params.repetition_penalty for row in rows]
    if any(r != 1.0 for r in repetition):
        # A row without repetition penalty gets an empty prompt here: its prompt is never read, and
        # long prompts are the expensive part of building counts.
        prompts = [row.prompt_token_ids if r != 1.0 else () for row, r in zip(rows, repetition, strict=True)]
        seen = (_token_counts(prompts, vocab, device) + output_counts) > 0
        rep = _column(repetition, device)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    presence = _column([row.params.presence_penalty for row in rows], device)
    frequency = _column([row.params.frequency_penalty for row in rows], device)
    x = x - presence * (output_counts > 0) - frequency * output_counts

    if idx is None:
        logits.copy_(x)
    else:
        logits.index_copy_(0, idx, x)


def first_max(x: torch.Tensor) -> torch.Tensor:
    """Per row of x [n, vocab] the index of its largest value, the lowest on a tie (a NaN counts as the
    largest). What `argmax(dim=-1)` returns, but torch 2.13's CPU argmax over a 49152-token vocabulary
    takes 2-3x as long as `max(dim=-1)` (65 against 30 us for one row, 1.0 against 0.41 ms for 32),
    every greedy step."""
    return x.max(dim=-1).indices


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Sampled token ids [len(rows)] for rows with temperature > 0. Never writes to `logits`."""
    probs = _filtered_probs(logits, rows)
    return first_max(probs.div_(exponential_noise(rows, logits.shape[1], logits.device)))


def _filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[len(rows), vocab] fresh fp32 probabilities for rows with temperature > 0: softmax of logits over
    temperature after the filters (masked tokens exactly 0). Never writes to `logits`."""
    device = logits.device
    vocab = logits.shape[1]
    params = [row.params for row in rows]
    temperature = _column([p.temperature for p in params], device)
    # Shift each row so its max is exactly 0 before scaling (softmax is shift-invariant): x / t then
    # cannot overflow to +inf for a tiny t, so t -> 0 degrades to argmax among the top logits instead
    # of NaN. This also makes `x` a fresh tensor that the filters may mask in place.
    x = (logits - logits.amax(dim=-1, keepdim=True)) / temperature

    # Filters in order top-k, top-p, min-p; each sees the survivors of the previous ones, and each
    # runs only on the rows that enable it.
    top_k = [(j, p.top_k) for j, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k:
        _mask_rows(x, top_k, _top_k_mask)
    top_p = [(j, p.top_p) for j, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        _mask_rows(x, top_p, _top_p_mask)
    min_p = [(j, p.min_p) for j, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        _mask_rows(x, min_p, _min_p_mask)

    return x.softmax(dim=-1)  # masked tokens have probability exactly 0


_MaskFn = Callable[[torch.Tensor, Sequence[float]], torch.Tensor]


def _mask_rows(x: torch.Tensor, selected: Sequence[tuple[int, float]], mask_fn: _MaskFn) -> None:
    """Set to -inf, in place, the entries of the selected rows of `x` that `mask_fn` marks.
    `selected` holds (row position, that row's filter value)."""
    positions = [j for j, _ in selected]
    values = [v for _, v in selected]
    if len(positions) == x.shape[0]:
        x.masked_fill_(mask_fn(x, values), _NEG_INF)
        return
    idx = _index(positions, x.device)
    sub = x.index_select(0, idx)
    x.index_copy_(0, idx, sub.masked_fill_(mask_fn(sub, values), _NEG_INF))


def _top_k_mask(x: torch.Tensor, ks: Sequence[float]) -> torch.Tensor:
    """Drop everything below each row's k-th largest value. Ties with the k-th value are kept, so
    the kept set depends only on the values, never on an arbitrary tie order."""
    k = torch.tensor(ks, dtype=torch.long, device=x.device).unsqueeze(1)
    kth = x.topk(int(max(ks)), dim=-1).values.gather(1, k - 1)
    return x < kth


def _top_p_mask(x: torch.Tensor, ps: Sequence[float]) -> torch.Tensor:
    """Keep the smallest most-likely prefix whose probability reaches top_p (at least one token).
    Ties with the last kept value are kept too, as in top-k."""
    top_p = _column(ps, x.device)
    desc = x.sort(dim=-1, descending=True).values
    cum = desc.softmax(dim=-1).cumsum(dim=-1)
    # Sorted position j + 1 is kept iff the mass before it, cum[j], is still short of top_p; position
    # 0 always is. cum never decreases (non-negative terms), so the kept positions form a prefix and
    # counting them gives its length.
    kept = 1 + (cum[:, :-1] < top_p).sum(dim=-1, keepdim=True)
    return x < desc.gather(1, kept - 1)


def _min_p_mask(x: torch.Tensor, ps: Sequence[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's largest probability (the most
    likely token always survives since min_p <= 1)."""
    probs = x.softmax(dim=-1)
    return probs < _column(ps, x.device) * probs.amax(dim=-1, keepdim=True)


def exponential_noise(rows: list[SamplingRow], vocab: int, device: torch.device,
                      purpose: int = NOISE) -> torch.Tensor:
    """[len(rows), vocab] i.i.d. Exp(1) noise: seeded rows from their own streams at their positions
    (for `purpose`), unseeded rows from the global RNG."""
    noise = torch.empty((len(rows), vocab), dtype=torch.float32, device=device)
    unseeded = [j for j, row in enumerate(rows) if row.generator is None]
    if len(unseeded) == len(rows):
        noise.exponential_()
    else:
        if unseeded:
            global_noise = torch.empty((len(unseeded), vocab), dtype=torch.float32, device=device)
            noise.index_copy_(0, _index(unseeded, device), global_noise.exponential_())
        for j, row in enumerate(rows):
            if row.generator is None:
                continue
            generator = row.seeded(purpose)
            if generator.device == noise.device:
                noise[j].exponential_(generator=generator)
            else:
                # Draw on the generator's own device (its stream is defined there), then move.
                drawn = torch.empty(vocab, dtype=torch.float32, device=generator.device)
                noise[j].copy_(drawn.exponential_(generator=generator))
    return noise.clamp_min_(_TINY)


def token_logprobs(logp: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]) -> list[Logprob]:
    """Per row of `logp` ([m, vocab] log-probabilities), the Logprob of token_ids[r] with its num_top[r]
    best alternatives (best first; equal values among them come in whatever order topk gives)."""
    if not token_ids:
        return []
    tokens = torch.tensor(list(token_ids), dtype=torch.long, device=logp.device)
    chosen: list[float] = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    counts = [min(n, logp.shape[1]) for n in num_top]
    top_values: list[list[float]] = [[] for _ in counts]
    top_ids: list[list[int]] = [[] for _ in counts]
    if max(counts) > 0:
        values, ids = logp.topk(max(counts), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        Logprob(int(token_ids[r]), chosen[r], list(zip(top_ids[r][:count], top_values[r][:count], strict=True)))
        for r, count in enumerate(counts)
    ]
