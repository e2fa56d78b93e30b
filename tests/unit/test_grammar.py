"""deepinfer.grammar against real llguidance and SmolLM2's real tokenizer: constrained walks give outputs that parse
and validate, bad constraints are GrammarErrors with a reason, the compile cache shares and evicts, a constraint
steps, drafts, rolls back and replays consistently, and the logits masking matches a bit-by-bit reference.

The "model" in the walks is seeded noise with a liking for closing characters: at each step it takes the allowed
token with the highest score, the score being a fresh uniform draw plus 1 for a token holding `"`, `}` or `]`.
Fresh draws, not one fixed score vector: a fixed vector makes the same choice every time a state repeats (inside
a string, say) and may never end; the liking for closers makes strings and containers end within tens of steps.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from deepinfer.grammar import (
    CompiledGrammar,
    Constraint,
    ConstraintSpec,
    GrammarCache,
    GrammarError,
    GrammarVocab,
    apply_bitmask_,
    fill_bitmask_rows,
    grammar_vocab,
    new_bitmask,
)
from deepinfer.text.tokenizer import Tokenizer

pytestmark = pytest.mark.smollm2

MAX_STEPS = 400


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def vocab(tokenizer: Tokenizer) -> GrammarVocab:
    return grammar_vocab(tokenizer, n_vocab=tokenizer.vocab_size)


@pytest.fixture(scope="module")
def cache(vocab: GrammarVocab) -> GrammarCache:
    return GrammarCache(vocab)


@pytest.fixture(scope="module")
def closer_bonus(tokenizer: Tokenizer, vocab: GrammarVocab) -> torch.Tensor:
    # Byte-level BPE spells printable ASCII as itself, so the token strings show the quote and brackets.
    bonus = torch.zeros(vocab.n_vocab)
    for token, i in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if any(ch in token for ch in '"}]'):
            bonus[i] = 1.0
    return bonus


def allowed(row: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """A bitmask row as a bool per token (bit j of byte b is token 8b + j on a little-endian machine)."""
    bits = (row.contiguous().view(torch.uint8).unsqueeze(-1).long() >> torch.arange(8)) & 1
    return bits.flatten()[:n_vocab].bool()


def mask_of(c: Constraint) -> torch.Tensor:
    row = torch.zeros(c.compiled.vocab.mask_words, dtype=torch.int32)
    c.allowed_mask(row)
    return row


def walk(c: Constraint, bonus: torch.Tensor, seed: int, max_steps: int = MAX_STEPS) -> list[int]:
    """Drive `c` with the noise model until it accepts an EOS; the output ids without the EOS."""
    vocab = c.compiled.vocab
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_steps):
        ok = allowed(mask_of(c), vocab.n_vocab)
        assert ok.any(), f"no token allowed after {out}"
        scores = (torch.rand(vocab.n_vocab, generator=g) + bonus).masked_fill(~ok, -1.0)
        token = int(scores.argmax())
        assert c.accept(token), f"the mask allowed {token}, accept refused it"
        if token in vocab.eos_token_ids:
            assert c.is_finished
            return out
        out.append(token)
    raise AssertionError(f"no EOS within {max_steps} steps: {out}")


SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "role", "active"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "placed": {"type": "string", "format": "date"},
            "email": {"type": "string", "format": "email", "maxLength": 24},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "placed", "email", "items"],
        "additionalProperties": False,
    },
    "shape": {
        "anyOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}},
             "required": ["kind", "r"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "rect"},
                                              "wh": {"type": "array", "items": {"type": "integer"},
                                                     "minItems": 2, "maxItems": 2}},
             "required": ["kind", "wh"], "additionalProperties": False},
        ]
    },
    "tree": {
        "$defs": {"node": {"type": "object",
                           "properties": {"v": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                   "maxItems": 2}},
                           "required": ["v", "kids"], "additionalProperties": False}},
        "$ref": "#/$defs/node",
    },
    "open": {"type": "object", "properties": {"note": {"type": ["string", "null"]}}, "required": ["note"]},
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_json_schema_walk_parses_and_validates(cache, tokenizer, closer_bonus, name, seed):
    schema = SCHEMAS[name]
    c = Constraint(cache.compile(ConstraintSpec.json_schema(schema)))
    text = tokenizer.decode(walk(c, closer_bonus, seed))
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_a_non_strict_schema_ignores_what_it_cannot_enforce(cache, tokenizer, closer_bonus):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False, "if": {"required": ["n"]}, "then": {}}
    with pytest.raises(GrammarError, match="if"):
        cache.compile(ConstraintSpec.json_schema(schema, strict=True))
    compiled = cache.compile(ConstraintSpec.json_schema(schema, strict=False))
    assert any("if" in w for w in compiled.warnings)
    value = json.loads(tokenizer.decode(walk(Constraint(compiled), closer_bonus, 0)))
    jsonschema.validate(value, schema)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_object_walks_give_objects(cache, tokenizer, closer_bonus, seed):
    text = tokenizer.decode(walk(Constraint(cache.compile(ConstraintSpec.json_object())), closer_bonus, seed))
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("not_an_object", ['[1, 2]', '"text"', "12"])
def test_json_object_refuses_other_json(cache, tokenizer, not_an_object):
    c = Constraint(cache.compile(ConstraintSpec.json_object()))
    ids = tokenizer.encode(not_an_object, add_special_tokens=False)
    assert c.accept_many(ids) == 0 and c.tokens == ()


@pytest.mark.parametrize("pattern", [r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"(yes|no|maybe)", r"-?[1-9][0-9]{0,4}"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_regex_walk_fullmatches(cache, tokenizer, closer_bonus, pattern, seed):
    text = tokenizer.decode(walk(Constraint(cache.compile(ConstraintSpec.regex(pattern))), closer_bonus, seed))
    assert re.fullmatch(pattern, text), text


LARK = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /0|[1-9][0-9]{0,2}/
"""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_lark_grammar_walk_is_in_the_language(cache, tokenizer, closer_bonus, seed):
    text = tokenizer.decode(walk(Constraint(cache.compile(ConstraintSpec.grammar(LARK))), closer_bonus, seed))
    # The language has no nesting deeper than the walk makes: check it by evaluating it as Python.
    assert re.fullmatch(r"[0-9+\-()]+", text), text
    assert isinstance(eval(text, {"__builtins__": {}}), int)


@pytest.mark.parametrize(("spec", "reason"), [
    (lambda: ConstraintSpec.json_schema({"type": "foo"}), "foo"),
    (lambda: ConstraintSpec("json_schema", '{"type": '), "not valid JSON"),
    (lambda: ConstraintSpec("json_schema", "[1]"), "object or a boolean"),
    (lambda: ConstraintSpec.json_schema({"type": "string", "pattern": "(a"}), "regex"),
    (lambda: ConstraintSpec.regex("a(b"), "unclosed group"),
    (lambda: ConstraintSpec.grammar("start: foo\n"), "unknown name"),
    (lambda: ConstraintSpec.grammar("start: (\n"), "Expected"),
    (lambda: ConstraintSpec("xml", "<a/>"), "unknown constraint kind"),
    (lambda: ConstraintSpec("json_object", "{}"), "takes no text"),
    (lambda: ConstraintSpec.regex(""), "non-empty"),
])
def test_a_bad_constraint_is_a_grammar_error_with_its_reason(cache, spec, reason):
    with pytest.raises(GrammarError) as caught:
        cache.compile(spec())
    assert reason in caught.value.reason
    assert "<state>" not in caught.value.reason  # llguidance's parser dump is not for clients


def test_the_digest_ignores_layout_but_not_meaning():
    a = ConstraintSpec("json_schema", '{"type": "object", "properties": {"a": {}, "b": {}}}')
    assert a.digest() == ConstraintSpec.json_schema({"type": "object", "properties": {"a": {}, "b": {}}}).digest()
    # Property order is generation order.
    assert a.digest() != ConstraintSpec.json_schema({"type": "object", "properties": {"b": {}, "a": {}}}).digest()
    assert a.digest() != ConstraintSpec(a.kind, a.text, strict=False).digest()
    assert ConstraintSpec("regex", "a+", strict=False).digest() == ConstraintSpec.regex("a+").digest()
    assert ConstraintSpec.regex("a+").digest() != ConstraintSpec.grammar("a+").digest()
    assert ConstraintSpec.regex("a+").digest() != ConstraintSpec.regex("a+ ").digest()


def test_the_cache_shares_compiles_and_evicts_the_least_recently_used(vocab):
    cache = GrammarCache(vocab, max_entries=2)
    a, b, c = (ConstraintSpec.regex(p) for p in ("a+", "b+", "c+"))
    first = cache.compile(a)
    assert isinstance(first, CompiledGrammar)
    assert cache.compile(ConstraintSpec.regex("a+")) is first and cache.hits == 1
    cache.compile(b)
    cache.compile(a)  # a is now the most recent
    cache.compile(c)  # evicts b
    assert a in cache and c in cache and b not in cache and len(cache) == 2
    cache.compile(b)  # evicts a
    assert a not in cache
    again = cache.compile(a)
    assert again is not first and again.grammar == first.grammar


def test_a_failed_compile_is_cached_as_a_refusal(vocab):
    cache = GrammarCache(vocab)
    bad = ConstraintSpec.regex("a(b")
    for _ in range(2):
        with pytest.raises(GrammarError, match="unclosed group"):
            cache.compile(bad)
    assert (cache.misses, cache.hits) == (1, 1)
    assert bad in cache and ConstraintSpec("json_schema", "{") not in cache


def test_a_compile_past_its_time_bound_is_a_grammar_error(vocab):
    cache = GrammarCache(vocab, compile_timeout_s=0.0)
    spec = ConstraintSpec.json_schema(SCHEMAS["order"])
    with pytest.raises(GrammarError, match="longer than"):
        cache.compile(spec)
    deadline = time.monotonic() + 30
    while cache._pending and time.monotonic() < deadline:  # let the abandoned compile finish
        time.sleep(0.01)
    with pytest.raises(GrammarError, match="longer than"):  # its late result does not replace the refusal
        cache.compile(spec)


def test_threads_asking_for_one_spec_share_one_compile(vocab):
    cache = GrammarCache(vocab)
    spec = ConstraintSpec.json_schema(SCHEMAS["tree"])
    results: list[CompiledGrammar] = []
    start = threading.Barrier(6)

    def ask() -> None:
        start.wait()
        results.append(cache.compile(spec))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and all(r is results[0] for r in results)
    assert cache.submit(spec).result(timeout=30) is results[0]


def test_a_forbidden_token_is_refused_and_changes_nothing(cache, tokenizer, vocab):
    c = Constraint(cache.compile(ConstraintSpec.json_schema(SCHEMAS["person"])))
    before = mask_of(c)
    ok = allowed(before, vocab.n_vocab)
    forbidden = int((~ok).nonzero()[0])
    assert not c.accept(forbidden)
    assert not c.accept(vocab.eos_token_ids[0])  # an empty output is not a person
    assert not c.accept(vocab.n_vocab) and not c.accept(-1)
    assert c.tokens == () and torch.equal(mask_of(c), before)
    assert c.accept(int(ok.nonzero()[0])) and len(c.tokens) == 1


def test_a_draft_ends_at_its_first_forbidden_token_and_rolls_back(cache, tokenizer):
    compiled = cache.compile(ConstraintSpec.json_schema(SCHEMAS["person"]))
    good = tokenizer.encode('{"name": "Ada", "age": 36, ', add_special_tokens=False)
    bad = tokenizer.encode("}", add_special_tokens=False)
    c = Constraint(compiled)
    assert c.accept_many([*good, *bad, *good]) == len(good)
    assert c.tokens == tuple(good)
    c.rollback(3)
    reference = Constraint(compiled).replay(good[:-3])
    assert c.tokens == reference.tokens and torch.equal(mask_of(c), mask_of(reference))
    with pytest.raises(ValueError):
        c.rollback(len(good))


def test_eos_ends_the_output_and_can_be_rolled_back(cache, tokenizer, vocab):
    c = Constraint(cache.compile(ConstraintSpec.regex("[a-z]+")))
    ids = tokenizer.encode("abc", add_special_tokens=False)
    eos = vocab.eos_token_ids[0]
    assert c.accept_many(ids) == len(ids) and c.is_accepting and not c.is_finished
    before = mask_of(c)
    assert allowed(before, vocab.n_vocab)[eos]
    assert c.accept_many([eos, ids[0]]) == 1  # nothing follows EOS
    assert c.is_finished and not c.is_accepting and not mask_of(c).any()
    assert not c.accept(ids[0])
    c.rollback(1)
    assert not c.is_finished and torch.equal(mask_of(c), before)


def test_a_complete_schema_output_allows_only_eos(cache, tokenizer, vocab):
    c = Constraint(cache.compile(ConstraintSpec.json_schema({"enum": ["on", "off"]})))
    assert c.accept_many(tokenizer.encode('"off"', add_special_tokens=False)) > 0
    assert c.is_finished and c.is_accepting
    assert allowed(mask_of(c), vocab.n_vocab).nonzero().flatten().tolist() == list(vocab.eos_token_ids)
    assert c.accept(vocab.eos_token_ids[0])


def test_replay_rebuilds_the_same_state(cache, tokenizer, closer_bonus):
    compiled = cache.compile(ConstraintSpec.json_schema(SCHEMAS["order"]))
    out = walk(Constraint(compiled), closer_bonus, 3)
    for cut in (0, 1, len(out) // 2, len(out)):
        original = Constraint(compiled)
        assert original.accept_many(out[:cut]) == cut
        moved = Constraint(compiled).replay(original.tokens)
        assert moved.tokens == original.tokens
        assert torch.equal(mask_of(moved), mask_of(original))
        assert (moved.is_accepting, moved.is_finished) == (original.is_accepting, original.is_finished)
    other = Constraint(compiled)
    with pytest.raises(GrammarError, match="position 1"):
        other.replay([out[0], out[0]])  # '{"' twice is no order
    assert other.tokens == () and torch.equal(mask_of(other), mask_of(Constraint(compiled)))


def test_draft_masks_are_the_masks_along_the_draft(cache, tokenizer):
    compiled = cache.compile(ConstraintSpec.json_schema(SCHEMAS["person"]))
    draft = tokenizer.encode('{"name": "Bo", "age": 7', add_special_tokens=False)
    # '{"name":' must go on with ' "': a ']' there ends the draft.
    draft = [*draft[:3], tokenizer.encode("]", add_special_tokens=False)[0], *draft[3:]]
    c = Constraint(compiled)
    out = new_bitmask(len(draft) + 1, compiled.vocab.n_vocab)
    assert c.draft_masks(draft, out) == 3
    assert c.tokens == ()
    step = Constraint(compiled)
    for i in range(4):
        assert torch.equal(out[i], mask_of(step)), i
        if i < 3:
            assert step.accept(draft[i])
    assert (out[4:] == -1).all()  # rows past the allowed prefix are not written


def test_batched_masks_equal_one_by_one(cache, tokenizer, vocab):
    eos = vocab.eos_token_ids[0]
    ended = Constraint(cache.compile(ConstraintSpec.regex("x")))
    assert ended.accept_many([*tokenizer.encode("x", add_special_tokens=False), eos]) == 2
    rows = [
        (Constraint(cache.compile(ConstraintSpec.json_schema(SCHEMAS["person"]))), 4),
        (Constraint(cache.compile(ConstraintSpec.regex("[0-9]+"))).replay(tokenizer.encode("12", False)), 0),
        (ended, 2),
        (Constraint(cache.compile(ConstraintSpec.json_object())), 5),
    ]
    bitmask = new_bitmask(6, vocab.n_vocab)
    fill_bitmask_rows(rows, bitmask)
    for c, r in rows:
        assert torch.equal(bitmask[r], mask_of(c)), r
    assert (bitmask[[1, 3]] == -1).all()


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r in rows:
        for t in range(logits.shape[1]):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab_size", [1000, 1003])
def test_apply_bitmask_masks_exactly_the_clear_bits_of_the_listed_rows(vocab_size):
    g = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(6, vocab_size, generator=g)
    logits[1, 7] = float("-inf")
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, (vocab_size + 31) // 32 + 1), generator=g, dtype=torch.int32)
    bitmask[3] = -1  # every token allowed: the row must come out unchanged
    rows = [4, 1, 3]
    expected = reference_mask(logits, bitmask, rows)
    got = logits.clone()
    apply_bitmask_(got, bitmask, rows)
    assert torch.equal(got, expected)
    assert torch.equal(got[[0, 2, 5]], logits[[0, 2, 5]])
    assert torch.isneginf(got[4]).any() and not torch.isneginf(got[4]).all()
    apply_bitmask_(got, bitmask, [])
    assert torch.equal(got, expected)


def test_apply_bitmask_refuses_a_mask_narrower_than_the_vocabulary():
    with pytest.raises(ValueError):
        apply_bitmask_(torch.zeros(2, 65), torch.zeros(2, 2, dtype=torch.int32), [0])


def test_a_grammar_mask_on_logits_leaves_only_allowed_tokens(cache, tokenizer, vocab):
    c = Constraint(cache.compile(ConstraintSpec.regex("(yes|no)")))
    bitmask = new_bitmask(2, vocab.n_vocab)
    c.allowed_mask(bitmask[1])
    logits = torch.randn(2, vocab.n_vocab, generator=torch.Generator().manual_seed(0))
    apply_bitmask_(logits, bitmask, [1])
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert finite == allowed(bitmask[1], vocab.n_vocab).nonzero().flatten().tolist()
    assert {tokenizer.decode([t]) for t in finite} >= {"yes", "no"}
    assert all("yes".startswith(tokenizer.decode([t])) or "no".startswith(tokenizer.decode([t])) for t in finite)


def test_a_padded_vocabulary_never_allows_the_padding_nor_control_tokens(tokenizer):
    padded = grammar_vocab(tokenizer, n_vocab=tokenizer.vocab_size + 45)
    assert grammar_vocab(tokenizer, n_vocab=tokenizer.vocab_size + 45) is padded
    assert padded.mask_words == (tokenizer.vocab_size + 45 + 31) // 32
    c = Constraint(GrammarCache(padded).compile(ConstraintSpec.regex("(?s:.{0,20})")))
    ok = allowed(mask_of(c), padded.n_vocab)
    assert ok[: tokenizer.vocab_size].sum() > 40000 and not ok[tokenizer.vocab_size:].any()
    # Control tokens are not text: "any 0-20 characters" allows none of them, but EOS (the output may end here).
    assert not ok[tokenizer.token_to_id("<|im_start|>")] and not ok[tokenizer.token_to_id("<|endoftext|>")]
    assert ok[list(padded.eos_token_ids)].all()
    assert not c.accept(tokenizer.vocab_size + 3)
    with pytest.raises(ValueError):
        grammar_vocab(tokenizer, n_vocab=tokenizer.vocab_size - 1)
    with pytest.raises(ValueError):
        grammar_vocab(tokenizer, n_vocab=tokenizer.vocab_size, eos_token_ids=[])
