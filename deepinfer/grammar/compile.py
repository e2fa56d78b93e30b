"""Specs to compiled grammars, and a bounded cache of them.

Compiling builds llguidance's lexer and parser tables for one spec against one vocabulary (sub-millisecond for
most schemas, up to seconds for pathological ones). It must never run on the engine's step loop: callers run
`GrammarCache.compile` on a worker thread (`loop.run_in_executor`, or `await asyncio.wrap_future(cache.submit(spec))`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict

import llguidance

from deepinfer.grammar.spec import JSON_LAYOUT, ConstraintSpec, GrammarError
from deepinfer.grammar.vocab import GrammarVocab

_ANY_OBJECT = '{"type":"object"}'


def grammar_text(spec: ConstraintSpec) -> str:
    """The llguidance grammar (its JSON envelope) for `spec`. Checks only that the text is well-formed enough to
    wrap; whether the grammar itself is valid is found when it is compiled. Raises GrammarError."""
    try:
        if spec.kind == "json_schema":
            overrides = {**JSON_LAYOUT, "lenient": not spec.strict}
            return llguidance.LLMatcher.grammar_from_json_schema(spec.canonical_text(), overrides=overrides)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, overrides=JSON_LAYOUT)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        # "grammar" takes Lark, and converts GBNF to Lark when the text is GBNF.
        return llguidance.grammar_from("grammar", spec.text)
    except ValueError as e:
        raise GrammarError(str(e)) from None


class CompiledGrammar:
    """A spec compiled against one vocabulary: an llguidance matcher in its start state, never advanced, that
    each request's `Constraint` copies. Immutable from the outside and safe to share between threads."""

    __slots__ = ("spec", "digest", "vocab", "grammar", "compile_s", "warnings", "_template", "_lock")

    def __init__(self, spec: ConstraintSpec, digest: str, vocab: GrammarVocab, grammar: str,
                 template: llguidance.LLMatcher, compile_s: float, warnings: tuple[str, ...]) -> None:
        self.spec = spec
        self.digest = digest
        self.vocab = vocab
        self.grammar = grammar
        self.compile_s = compile_s
        self.warnings = warnings
        self._template = template
        # An llguidance object may be used by one thread at a time (a second gets "Already borrowed").
        self._lock = threading.Lock()

    def new_matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher in the start state (a copy: microseconds)."""
        with self._lock:
            return self._template.deep_copy()


def compile_grammar(spec: ConstraintSpec, vocab: GrammarVocab, *,
                    limits: llguidance.LLParserLimits | None = None) -> CompiledGrammar:
    """Compile `spec` for `vocab`, blocking (llguidance releases the GIL while it builds).

    Raises GrammarError with llguidance's message when the text, schema, regex or grammar is invalid, uses what
    the engine does not support (in a strict schema), or exceeds `limits` (lexer fuel, grammar size). The first
    mask is computed here too, so its one-off cost (lexer states for the start) is paid off the step loop and
    counted in `compile_s`.
    """
    t0 = time.perf_counter()
    digest = spec.digest()
    grammar = grammar_text(spec)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocab.llg, limits=limits)
    if failed:
        raise GrammarError(messages[0] if messages else "the grammar is invalid")
    template = llguidance.LLMatcher(vocab.llg, grammar, log_level=0, limits=limits)
    if template.is_error():
        raise GrammarError(_first_line(template.get_error()))
    template.deep_copy().compute_bitmask()
    return CompiledGrammar(spec, digest, vocab, grammar, template, time.perf_counter() - t0, tuple(messages))


def _first_line(message: str) -> str:
    # llguidance appends its parser state and the whole grammar to a matcher's error: not for a client.
    return message.split("\n<state>", 1)[0].strip() or "the grammar is invalid"


class GrammarCache:
    """Compiled grammars by spec digest, for one vocabulary: at most `max_entries` (least recently used goes
    first), each compile bounded by `compile_timeout_s`.

    Failures are cached too (as entries that raise the same GrammarError), so a client resending a schema that
    cannot compile costs a dictionary lookup. Concurrent requests for one spec share one compile.

    Thread-safe. `compile` blocks for up to `compile_timeout_s`: call it from a worker thread, never the step loop,
    or use `submit` from asyncio. Compiles run on the cache's own `workers` threads; one that times out cannot be
    interrupted (llguidance has no cancel), so it keeps its thread until it ends and its late result is dropped —
    `limits` (llguidance's fuel and size limits) are what bound the work itself.
    """

    def __init__(self, vocab: GrammarVocab, *, max_entries: int = 256, compile_timeout_s: float = 5.0,
                 workers: int = 2, limits: llguidance.LLParserLimits | None = None) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.vocab = vocab
        self.max_entries = max_entries
        self.compile_timeout_s = compile_timeout_s
        self._limits = limits
        self._entries: OrderedDict[str, CompiledGrammar | GrammarError] = OrderedDict()
        self._pending: dict[str, concurrent.futures.Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")
        self._waiters = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="grammar-wait")
        self.hits = self.misses = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, spec: ConstraintSpec) -> bool:
        try:
            digest = spec.digest()
        except GrammarError:  # a schema that is not JSON is never an entry
            return False
        with self._lock:
            return digest in self._entries

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        """The compiled grammar for `spec`, from the cache or compiled now. Raises GrammarError (invalid, or the
        compile took longer than `compile_timeout_s`)."""
        digest = spec.digest()
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None:
                self._entries.move_to_end(digest)
                self.hits += 1
                if isinstance(entry, GrammarError):
                    raise GrammarError(entry.reason)
                return entry
            self.misses += 1
            future = self._pending.get(digest)
            started = future is None
            if future is None:
                future = self._pool.submit(compile_grammar, spec, self.vocab, limits=self._limits)
                self._pending[digest] = future
        if started:
            # Outside the lock: a future already done runs its callback here, and the callback takes the lock.
            future.add_done_callback(lambda f: self._finished(digest, f))
        try:
            return future.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            error = GrammarError(f"compiling the constraint took longer than {self.compile_timeout_s:g} s")
            with self._lock:
                self._store(digest, error)
            raise error from None

    def submit(self, spec: ConstraintSpec) -> concurrent.futures.Future[CompiledGrammar]:
        """`compile` on a pool thread, as a future (for asyncio: `await asyncio.wrap_future(cache.submit(spec))`)."""
        # Waiting takes a thread of its own: a waiter on a compile thread could queue behind its own compile.
        return self._waiters.submit(self.compile, spec)

    def close(self) -> None:
        """Stop the compile threads (a compile under way still runs to its end)."""
        self._waiters.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _finished(self, digest: str, future: concurrent.futures.Future[CompiledGrammar]) -> None:
        with self._lock:
            self._pending.pop(digest, None)
            if digest in self._entries:  # timed out meanwhile: the cached refusal stands
                return
            error = future.exception()
            if error is None:
                self._store(digest, future.result())
            elif isinstance(error, GrammarError):
                self._store(digest, error)
            # Anything else is a bug, not a property of the spec: raised to the waiters, not cached.

    def _store(self, digest: str, entry: CompiledGrammar | GrammarError) -> None:
        self._entries[digest] = entry
        self._entries.move_to_end(digest)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
