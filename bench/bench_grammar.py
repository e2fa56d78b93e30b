"""Grammar engines for structured output, llguidance vs xgrammar: compile time and per-step mask time for JSON
schemas, on SmolLM2's vocabulary (49,152 tokens) and on a DeepSeek-sized one (129,280).

    .venv/bin/python -m bench.bench_grammar [--quick] [--repeats 5] [--steps 64] [--schemas bench/data/schemas]
                                            [--vocabs smollm2,deepseek-sized] [--json PATH]

xgrammar is not a project dependency; install it into the venv for this bench only (its declared dependencies,
transformers and triton among them, are not needed for what is measured here):

    .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi

Without it the bench says so and measures llguidance alone.

What is measured, the same way for both engines:

* setup: the engine's view of the vocabulary (llguidance `LLTokenizer` through `deepinfer.grammar.grammar_vocab`;
  xgrammar `TokenizerInfo` from the same token strings), once per vocabulary.
* compile: a schema's text to its first mask, with each engine's own cache out of the way (llguidance:
  `deepinfer.grammar.compile_grammar`, uncached; xgrammar: `GrammarCompiler(cache_enabled=False)`, compile, a
  matcher, its first mask). `--repeats` compiles of each schema in bench/data/schemas/. Same JSON layout for both:
  no free whitespace, separators ", " and ": ", no properties beyond the schema's.
* mask: one `fill next token bitmask` into a preallocated int32 row, per step of a walk of `--steps` tokens per
  schema. The walk is chosen by llguidance's masks with the test's noise model (tests/unit/test_grammar.py: at
  each step the allowed token with the highest seeded uniform score, +1 for tokens holding `"`, `}` or `]`), a
  new seed when a walk reaches EOS, and xgrammar is fed the same tokens, so both engines mask the same states.
  Steps where their masks differ are counted (they should not).
* accept: advancing by the step's token (llguidance through `deepinfer.grammar.Constraint.accept`).

The DeepSeek-sized vocabulary: no DeepSeek tokenizer is available offline, so it is SmolLM2's byte-level BPE
extended with synthetic merges to 128,000 tokens (each new token the concatenation of an existing word-start
token of 2-8 characters and an existing continuation token of 1-6 characters, seeded; a valid BPE: every new
token has its merge), and the model vocabulary padded to 129,280 like DeepSeek-V3's (ids past the tokenizer
stand for no text). Its token strings are not DeepSeek's (no CJK- or code-heavy tokens); what it reproduces is
the size of the vocabulary and of the masks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as Backend

from deepinfer.grammar import (
    CompiledGrammar,
    Constraint,
    ConstraintSpec,
    GrammarVocab,
    apply_bitmask_,
    compile_grammar,
    grammar_vocab,
    new_bitmask,
)
from deepinfer.loading.fetch import fetch_smollm2
from deepinfer.text.tokenizer import Tokenizer

SCHEMAS = Path(__file__).parent / "data" / "schemas"
DEEPSEEK_TOKENIZER = 128_000
DEEPSEEK_MODEL_VOCAB = 129_280  # DeepSeek-V3's config vocab_size


# ----- vocabularies -----


@dataclass
class Vocabulary:
    name: str
    tokenizer: Tokenizer
    n_vocab: int
    note: str


def smollm2() -> Vocabulary:
    tok = Tokenizer.from_gguf(fetch_smollm2(progress=False))
    return Vocabulary("smollm2", tok, tok.vocab_size, "SmolLM2-135M-Instruct's byte-level BPE")


def deepseek_sized(base: Tokenizer, *, size: int = DEEPSEEK_TOKENIZER, seed: int = 0) -> Vocabulary:
    """SmolLM2's tokenizer with synthetic merges up to `size` tokens (see the module docstring)."""
    doc = json.loads(base.backend.to_str())
    model = doc["model"]
    vocab: dict[str, int] = model["vocab"]
    merges: list[Any] = model["merges"]
    as_pairs = bool(merges) and isinstance(merges[0], list)
    specials = {t["content"] for t in doc.get("added_tokens", []) if t.get("special")}
    tokens = [t for t in vocab if t not in specials]
    starts = [t for t in tokens if t.startswith("Ġ") and 2 <= len(t) <= 8]
    tails = [t for t in tokens if not t.startswith("Ġ") and 1 <= len(t) <= 6]
    rng = random.Random(seed)
    next_id = max(vocab.values()) + 1
    while next_id < size:
        a, b = rng.choice(starts), rng.choice(tails)
        if a + b in vocab:
            continue
        vocab[a + b] = next_id
        merges.append([a, b] if as_pairs else f"{a} {b}")
        next_id += 1
    backend = Backend.from_str(json.dumps(doc))
    tok = Tokenizer(backend, bos_token=base.bos_token, eos_token=base.eos_token)
    note = f"SmolLM2's BPE + {size - base.vocab_size:,} synthetic merges, padded to {DEEPSEEK_MODEL_VOCAB:,}"
    return Vocabulary("deepseek-sized", tok, DEEPSEEK_MODEL_VOCAB, note)


def closer_bonus(tok: Tokenizer, n_vocab: int) -> torch.Tensor:
    bonus = torch.zeros(n_vocab)
    for token, i in tok.backend.get_vocab(with_added_tokens=True).items():
        if any(ch in token for ch in '"}]'):
            bonus[i] = 1.0
    return bonus


def mean_token_bytes(tok: Tokenizer) -> float:
    lengths = [len(tok.decode([i]).encode()) for i in range(0, tok.vocab_size, 7)]
    return statistics.fmean(lengths)


# ----- engines -----


class LLGuidance:
    name = "llguidance"

    def __init__(self, v: Vocabulary) -> None:
        t0 = time.perf_counter()
        self.vocab: GrammarVocab = grammar_vocab(v.tokenizer, n_vocab=v.n_vocab)
        self.setup_s = time.perf_counter() - t0

    def compile(self, schema: str) -> CompiledGrammar:
        return compile_grammar(ConstraintSpec.json_schema(schema), self.vocab)


class XGrammar:
    name = "xgrammar"

    def __init__(self, v: Vocabulary) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        encoded = [""] * v.tokenizer.vocab_size
        for token, i in v.tokenizer.backend.get_vocab(with_added_tokens=True).items():
            encoded[i] = token
        for i, added in v.tokenizer.backend.get_added_tokens_decoder().items():
            if added.special:
                encoded[i] = ""  # xgrammar takes an empty token for a special one: never allowed in text
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=v.n_vocab,
                                      stop_token_ids=list(v.tokenizer.eos_token_ids), add_prefix_space=False)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0

    def compile(self, schema: str) -> Any:
        compiled = self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "),
                                                     strict_mode=True)
        matcher = self.xgr.GrammarMatcher(compiled)
        matcher.fill_next_token_bitmask(new_bitmask(1, self.info.vocab_size))
        return compiled


# ----- measurements -----


@dataclass
class Figures:
    setup_s: float = 0.0
    compile_s: list[float] = field(default_factory=list)
    mask_s: list[float] = field(default_factory=list)
    accept_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    mask_differences: int = 0  # steps where the two engines' masks differ
    wider_steps: int = 0  # ... where this engine allows a token llguidance does not
    narrower_steps: int = 0  # ... where llguidance allows a token this engine does not
    refused_steps: int = 0


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def time_compiles(engine: Any, schemas: dict[str, str], repeats: int, figures: Figures) -> None:
    for name, text in schemas.items():
        for _ in range(repeats):
            t0 = time.perf_counter()
            try:
                engine.compile(text)
            except Exception as e:  # noqa: BLE001 - an engine refusing a schema is a result, printed
                figures.failures.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
                break
            figures.compile_s.append(time.perf_counter() - t0)


def walk_tokens(compiled: CompiledGrammar, bonus: torch.Tensor, steps: int, seed: int,
                figures: Figures) -> list[list[int]]:
    """Walks (token lists, each ending at EOS or the step budget) chosen by llguidance's masks, timed."""
    n_vocab = compiled.vocab.n_vocab
    row = new_bitmask(1, n_vocab)
    walks: list[list[int]] = []
    taken = 0
    while taken < steps:
        c = Constraint(compiled)
        g = torch.Generator().manual_seed(seed + len(walks))
        walk: list[int] = []
        while taken < steps:
            t0 = time.perf_counter()
            c.allowed_mask(row[0])
            figures.mask_s.append(time.perf_counter() - t0)
            bits = (row[0].view(torch.uint8).unsqueeze(-1).long() >> torch.arange(8)) & 1
            allowed = bits.flatten()[:n_vocab].bool()
            token = int((torch.rand(n_vocab, generator=g) + bonus).masked_fill(~allowed, -1.0).argmax())
            t0 = time.perf_counter()
            ok = c.accept(token)
            figures.accept_s.append(time.perf_counter() - t0)
            assert ok, "llguidance refused a token its own mask allowed"
            walk.append(token)
            taken += 1
            if token in compiled.vocab.eos_token_ids:
                break
        walks.append(walk)
    return walks


def replay_xgrammar(engine: XGrammar, schema: str, walks: list[list[int]], reference: CompiledGrammar,
                    figures: Figures) -> None:
    compiled = engine.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "),
                                                   strict_mode=True)
    row = new_bitmask(1, engine.info.vocab_size)
    ours = new_bitmask(1, engine.info.vocab_size)
    eos = set(reference.vocab.eos_token_ids)
    for walk in walks:
        m = engine.xgr.GrammarMatcher(compiled)
        c = Constraint(reference)
        for token in walk:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(row)
            figures.mask_s.append(time.perf_counter() - t0)
            c.allowed_mask(ours[0])
            if not torch.equal(row, ours):
                figures.mask_differences += 1
                figures.wider_steps += bool((row & ~ours).any())
                figures.narrower_steps += bool((ours & ~row).any())
            t0 = time.perf_counter()
            ok = m.accept_token(token)
            figures.accept_s.append(time.perf_counter() - t0)
            c.accept(token)
            if not ok:
                figures.refused_steps += 1
                break
            if token in eos:
                break


def time_apply(n_vocab: int, rows: int, repeats: int = 50) -> float:
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (n_vocab + 31) // 32), generator=g, dtype=torch.int32)
    logits = torch.randn(rows, n_vocab, generator=g)
    index = list(range(rows))
    times = []
    for _ in range(repeats):
        work = logits.clone()
        t0 = time.perf_counter()
        apply_bitmask_(work, bitmask, index)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----- report -----


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.processor()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", type=Path, default=SCHEMAS)
    ap.add_argument("--repeats", type=int, default=5, help="compiles per schema and engine")
    ap.add_argument("--steps", type=int, default=64, help="walk steps per schema")
    ap.add_argument("--vocabs", default="smollm2,deepseek-sized")
    ap.add_argument("--quick", action="store_true", help="3 schemas, 2 repeats, 16 steps: a smoke run")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 2, 16
    started = time.perf_counter()
    schema_files = sorted(args.schemas.glob("*.json"))[: 3 if args.quick else None]
    schemas = {p.stem: p.read_text() for p in schema_files}
    try:
        import xgrammar  # noqa: F401
        engines: list[type] = [LLGuidance, XGrammar]
    except Exception as e:  # noqa: BLE001 - any import failure means: measure llguidance alone
        print(f"xgrammar unavailable ({type(e).__name__}: {e}); measuring llguidance alone. "
              "Install it with: .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi")
        engines = [LLGuidance]
    print(f"machine: {machine()}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, llguidance {package_version('llguidance')}, "
          f"xgrammar {package_version('xgrammar')}, torch threads {torch.get_num_threads()}")
    print(f"{len(schemas)} schemas from {args.schemas}, {args.repeats} compiles each, {args.steps} walk steps each")

    base = smollm2()
    wanted = args.vocabs.split(",")
    vocabularies = [base] if "smollm2" in wanted else []
    if "deepseek-sized" in wanted:
        t0 = time.perf_counter()
        vocabularies.append(deepseek_sized(base.tokenizer))
        print(f"built the deepseek-sized vocabulary in {time.perf_counter() - t0:.1f} s")

    results: dict[str, dict[str, Figures]] = {}
    notes: dict[str, str] = {}
    for v in vocabularies:
        notes[v.name] = (f"{v.note}: tokenizer {v.tokenizer.vocab_size:,} tokens, logits {v.n_vocab:,}, "
                         f"mean token {mean_token_bytes(v.tokenizer):.2f} bytes")
        print(f"\n[{v.name}] {notes[v.name]}")
        bonus = closer_bonus(v.tokenizer, v.n_vocab)
        per_engine: dict[str, Figures] = {}
        instances = {}
        for cls in engines:
            fig = Figures()
            engine = cls(v)
            instances[cls.name] = engine
            fig.setup_s = engine.setup_s
            time_compiles(engine, schemas, args.repeats, fig)
            per_engine[cls.name] = fig
        ours = instances["llguidance"]
        for i, (name, text) in enumerate(schemas.items()):
            try:
                compiled = ours.compile(text)
            except Exception:  # noqa: BLE001 - already counted as a compile failure
                continue
            walks = walk_tokens(compiled, bonus, args.steps, 1000 * i, per_engine["llguidance"])
            if "xgrammar" in instances and not any(f.startswith(f"{name}:") for f in per_engine["xgrammar"].failures):
                replay_xgrammar(instances["xgrammar"], text, walks, compiled, per_engine["xgrammar"])
        results[v.name] = per_engine
        for engine_name, fig in per_engine.items():
            for failure in fig.failures:
                print(f"  {engine_name} could not compile {failure}")

    print("\nper engine and vocabulary (compile: schema text to first mask; mask: one step's fill; times on one core "
          "unless the engine threads its compile; differ/wider/narrower: steps where the engine's mask differs from "
          "llguidance's / allows a token llguidance does not / misses one llguidance allows)")
    header = (f"{'vocab':<15} {'engine':<11} {'setup s':>8} {'compile p50 ms':>15} {'p99 ms':>9} "
              f"{'mask p50 us':>12} {'p99 us':>9} {'accept p50 us':>14} {'steps':>6} {'differ/wider/narrower':>22}")
    print(header)
    for vname, per_engine in results.items():
        for ename, f in per_engine.items():
            if not f.compile_s:
                continue
            print(f"{vname:<15} {ename:<11} {f.setup_s:8.2f} {pct(f.compile_s, 50) * 1e3:15.2f} "
                  f"{pct(f.compile_s, 99) * 1e3:9.2f} {pct(f.mask_s, 50) * 1e6:12.1f} {pct(f.mask_s, 99) * 1e6:9.1f} "
                  f"{pct(f.accept_s, 50) * 1e6:14.1f} {len(f.mask_s):6d} "
                  f"{'' if ename == 'llguidance' else f'{f.mask_differences}/{f.wider_steps}/{f.narrower_steps}':>22}")
    if len(engines) == 2:
        print("\nxgrammar / llguidance (above 1: llguidance faster)")
        for vname, per_engine in results.items():
            a, b = per_engine["llguidance"], per_engine["xgrammar"]
            if not (a.compile_s and b.compile_s and a.mask_s and b.mask_s):
                continue
            print(f"{vname:<15} compile p50 {pct(b.compile_s, 50) / pct(a.compile_s, 50):7.1f}x  "
                  f"p99 {pct(b.compile_s, 99) / pct(a.compile_s, 99):7.1f}x  "
                  f"mask p50 {pct(b.mask_s, 50) / pct(a.mask_s, 50):5.2f}x  "
                  f"p99 {pct(b.mask_s, 99) / pct(a.mask_s, 99):5.2f}x  "
                  f"(xgrammar refused {b.refused_steps} of llguidance's tokens)")
    print("\napply_bitmask_ (deepinfer.grammar, plain torch), median per call:")
    for v in vocabularies:
        one, batch = time_apply(v.n_vocab, 1), time_apply(v.n_vocab, 32)
        print(f"{v.name:<15} 1 row {one * 1e6:8.1f} us   32 rows {batch * 1e6:8.1f} us")
    command = " ".join([sys.executable, "-m", "bench.bench_grammar", *(argv or sys.argv[1:])])
    print(f"\ntotal {time.perf_counter() - started:.0f} s; reproduce: {command}")
    if args.json:
        out = {v: {e: {k: getattr(f, k) for k in ("setup_s", "compile_s", "mask_s", "accept_s", "failures",
                                                  "mask_differences", "wider_steps", "narrower_steps",
                                                  "refused_steps")}
                   for e, f in per.items()} for v, per in results.items()}
        args.json.write_text(json.dumps({"machine": machine(), "notes": notes, "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
