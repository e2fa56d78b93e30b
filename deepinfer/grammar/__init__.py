"""Output constraints: JSON schema, any JSON object, regex and Lark grammars, enforced token by token.

The grammar engine is llguidance. The pieces, in the order a request meets them:

* `ConstraintSpec` — what the request asks for (kind, text, strictness); a value, hashed by `digest()`.
* `grammar_vocab(tokenizer, n_vocab=...)` — the model's vocabulary for llguidance, built from the project's
  tokenizer and cached per tokenizer; masks are `n_vocab` (the logits width) wide.
* `GrammarCache(vocab).compile(spec)` — a `CompiledGrammar`, cached by digest, bounded in entries and compile
  time; anything unusable is a `GrammarError(reason)` (a client error). Blocking: run it off the step loop.
* `Constraint(compiled)` — one request's state: `allowed_mask` into an int32 bitmask row, `accept`,
  `accept_many` and `rollback` for speculative drafts, `is_finished`; rebuilt elsewhere from (spec, accepted
  ids) with `replay`, which is the whole migration contract.
* `apply_bitmask_(logits, bitmask, rows)` — masked logits of the listed rows to -inf, other rows untouched.

Contract: a constraint never allows a token that would make the output unable to match its spec, allows EOS
exactly when the output so far is a complete match, and depends only on the spec and the accepted ids. The
package holds no engine state and starts no work on import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from deepinfer.grammar.spec import KINDS, ConstraintSpec, GrammarError, Kind

if TYPE_CHECKING:
    from deepinfer.grammar.bitmask import apply_bitmask_, mask_words, new_bitmask
    from deepinfer.grammar.compile import CompiledGrammar, GrammarCache, compile_grammar, grammar_text
    from deepinfer.grammar.constraint import Constraint, fill_bitmask_rows
    from deepinfer.grammar.vocab import GrammarVocab, grammar_vocab

# The spec is pure and is imported everywhere a request's parameters are (the router, the tokenizer, the gateway
# among them); the rest needs torch and llguidance, which those services never load (a service that imports torch
# starts a second later: ten at once on two cores missed a client's 10 s connect), so it is imported on first use.
_LAZY = {
    "apply_bitmask_": "bitmask", "mask_words": "bitmask", "new_bitmask": "bitmask",
    "CompiledGrammar": "compile", "GrammarCache": "compile", "compile_grammar": "compile", "grammar_text": "compile",
    "Constraint": "constraint", "fill_bitmask_rows": "constraint",
    "GrammarVocab": "vocab", "grammar_vocab": "vocab",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

__all__ = [
    "KINDS",
    "CompiledGrammar",
    "Constraint",
    "ConstraintSpec",
    "GrammarCache",
    "GrammarError",
    "GrammarVocab",
    "Kind",
    "apply_bitmask_",
    "compile_grammar",
    "fill_bitmask_rows",
    "grammar_text",
    "grammar_vocab",
    "mask_words",
    "new_bitmask",
]
