"""Grammar engines for structured output, llguidance vs xgrammar: compile time and per-step mask time for JSON
schemas, on SmolLM2's vocabulary (49,152 tokens) and on a DeepSeek-sized one (129,280).

    .venv/bin/python -m bench.bench_grammar [--quick] [--repeats 5] [--steps 64] [--schemas bench/data/schemas]
                                            [--vocabs smollm2,deepseek-sized] [--xgrammar-threads N] [--json PATH]

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
* apply_bitmask_: deepinfer.grammar's masking of logits rows, 1 and 32 rows, 1 torch thread and the default.

Every time is taken as wall and as CPU time (the calling thread's for masks, the process's for compiles, whose
threads xgrammar may use): on a shared machine a step that lost its core shows as wall >> CPU. The phases run
apart — logits masking first, then llguidance on every vocabulary, then xgrammar — so neither engine's threads
run during the other's timings.

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

    def __init__(self, v: Vocabulary, *, threads: int) -> None:
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
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0

    def compile(self, schema: str) -> Any:
        compiled = self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "),
                                                     strict_mode=True)
        matcher = self.xgr.GrammarMatcher(compiled)
        matcher.fill_next_token_bitmask(new_bitmask(1, self.info.vocab_size))
        return compiled


# ----- measurements -----
# Wall time and CPU time both: on a shared 2-core machine another process can take the core mid-step, which shows
# as wall >> CPU. Masks are computed in the calling thread by both engines (thread CPU time); compiles may use
# an engine's own threads (process CPU time, all threads).


@dataclass
class Figures:
    setup_s: float = 0.0
    compile_wall: list[float] = field(default_factory=list)
    compile_cpu: list[float] = field(default_factory=list)
    mask_wall: list[float] = field(default_factory=list)
    mask_cpu: list[float] = field(default_factory=list)
    accept_wall: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    mask_differences: int = 0  # steps where this engine's mask differs from llguidance's
    wider_steps: int = 0  # ... where it allows a token llguidance does not
    narrower_steps: int = 0  # ... where llguidance allows a token it does not
    refused_steps: int = 0  # walks cut short: it refused the token llguidance's walk took


@dataclass
class Walk:
    tokens: list[int] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)  # llguidance's mask before each token


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def time_compiles(engine: Any, schemas: dict[str, str], repeats: int, figures: Figures) -> set[str]:
    """Compile every schema `repeats` times; the names of those the engine refused."""
    refused = set()
    for name, text in schemas.items():
        for _ in range(repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                engine.compile(text)
            except Exception as e:  # noqa: BLE001 - an engine refusing a schema is a result, printed
                figures.failures.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
                refused.add(name)
                break
            figures.compile_wall.append(time.perf_counter() - w0)
            figures.compile_cpu.append(time.process_time() - c0)
    return refused


def walk_llguidance(compiled: CompiledGrammar, bonus: torch.Tensor, steps: int, seed: int,
                    figures: Figures) -> list[Walk]:
    """Walks chosen by llguidance's masks (each ends at EOS or when `steps` are spent), timed, masks kept."""
    n_vocab = compiled.vocab.n_vocab
    row = new_bitmask(1, n_vocab)
    walks: list[Walk] = []
    taken = 0
    while taken < steps:
        c = Constraint(compiled)
        g = torch.Generator().manual_seed(seed + len(walks))
        walk = Walk()
        while taken < steps:
            w0, c0 = time.perf_counter(), time.thread_time()
            c.allowed_mask(row[0])
            figures.mask_wall.append(time.perf_counter() - w0)
            figures.mask_cpu.append(time.thread_time() - c0)
            walk.masks.append(row[0].clone())
            bits = (row[0].view(torch.uint8).unsqueeze(-1).long() >> torch.arange(8)) & 1
            allowed = bits.flatten()[:n_vocab].bool()
            token = int((torch.rand(n_vocab, generator=g) + bonus).masked_fill(~allowed, -1.0).argmax())
            w0 = time.perf_counter()
            ok = c.accept(token)
            figures.accept_wall.append(time.perf_counter() - w0)
            assert ok, "llguidance refused a token its own mask allowed"
            walk.tokens.append(token)
            taken += 1
            if token in compiled.vocab.eos_token_ids:
                break
        walks.append(walk)
    return walks


def replay_xgrammar(engine: XGrammar, schema: str, walks: list[Walk], eos: Sequence[int], figures: Figures) -> None:
    """Feed xgrammar the tokens of llguidance's walks, timing its masks and comparing them with llguidance's."""
    compiled = engine.compile(schema)
    row = new_bitmask(1, engine.info.vocab_size)
    for walk in walks:
        m = engine.xgr.GrammarMatcher(compiled)
        for token, theirs in zip(walk.tokens, walk.masks):
            w0, c0 = time.perf_counter(), time.thread_time()
            m.fill_next_token_bitmask(row)
            figures.mask_wall.append(time.perf_counter() - w0)
            figures.mask_cpu.append(time.thread_time() - c0)
            if not torch.equal(row[0], theirs):
                figures.mask_differences += 1
                figures.wider_steps += bool((row[0] & ~theirs).any())
                figures.narrower_steps += bool((theirs & ~row[0]).any())
            w0 = time.perf_counter()
            ok = m.accept_token(token)
            figures.accept_wall.append(time.perf_counter() - w0)
            if not ok:
                figures.refused_steps += 1
                break
            if token in eos:
                break


def time_apply(n_vocab: int, rows: int, repeats: int = 50) -> tuple[float, float]:
    """apply_bitmask_ on `rows` rows of a random mask: median wall and thread-CPU seconds per call."""
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (n_vocab + 31) // 32), generator=g, dtype=torch.int32)
    logits = torch.randn(rows, n_vocab, generator=g)
    index = list(range(rows))
    wall, cpu = [], []
    for _ in range(repeats):
        work = logits.clone()
        w0, c0 = time.perf_counter(), time.thread_time()
        apply_bitmask_(work, bitmask, index)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.thread_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


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
    ap.add_argument("--xgrammar-threads", type=int, default=os.cpu_count() or 1, help="xgrammar's compile threads")
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
        have_xgrammar = True
    except Exception as e:  # noqa: BLE001 - any import failure means: measure llguidance alone
        print(f"xgrammar unavailable ({type(e).__name__}: {e}); measuring llguidance alone. "
              "Install it with: .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi")
        have_xgrammar = False
    print(f"machine: {machine()}; load average at start {os.getloadavg()[0]:.2f}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, llguidance {package_version('llguidance')}, "
          f"xgrammar {package_version('xgrammar')}, torch threads {torch.get_num_threads()}, "
          f"xgrammar compile threads {args.xgrammar_threads}")
    print(f"{len(schemas)} schemas from {args.schemas}, {args.repeats} compiles each, {args.steps} walk steps each")

    base = smollm2()
    wanted = args.vocabs.split(",")
    vocabularies = [base] if "smollm2" in wanted else []
    if "deepseek-sized" in wanted:
        t0 = time.perf_counter()
        vocabularies.append(deepseek_sized(base.tokenizer))
        print(f"built the deepseek-sized vocabulary in {time.perf_counter() - t0:.1f} s")
    notes = {v.name: (f"{v.note}: tokenizer {v.tokenizer.vocab_size:,} tokens, logits {v.n_vocab:,}, "
                      f"mean token {mean_token_bytes(v.tokenizer):.2f} bytes") for v in vocabularies}
    for name, note in notes.items():
        print(f"  {name}: {note}")

    # Masking logits first, before either engine has started threads of its own.
    applied: dict[str, dict[str, tuple[float, float]]] = {}
    default_threads = torch.get_num_threads()
    for v in vocabularies:
        applied[v.name] = {}
        for threads in sorted({1, default_threads}):
            torch.set_num_threads(threads)
            for rows in (1, 32):
                applied[v.name][f"{rows} row(s), {threads} torch thread(s)"] = time_apply(v.n_vocab, rows)
    torch.set_num_threads(default_threads)

    # Each engine alone: llguidance over every vocabulary, then xgrammar replaying llguidance's walks.
    results: dict[str, dict[str, Figures]] = {v.name: {} for v in vocabularies}
    walks: dict[tuple[str, str], list[Walk]] = {}
    for v in vocabularies:
        fig = results[v.name]["llguidance"] = Figures()
        engine = LLGuidance(v)
        fig.setup_s = engine.setup_s
        refused = time_compiles(engine, schemas, args.repeats, fig)
        bonus = closer_bonus(v.tokenizer, v.n_vocab)
        for i, (name, text) in enumerate(schemas.items()):
            if name not in refused:
                walks[(v.name, name)] = walk_llguidance(engine.compile(text), bonus, args.steps, 1000 * i, fig)
    if have_xgrammar:
        for v in vocabularies:
            fig = results[v.name]["xgrammar"] = Figures()
            xg = XGrammar(v, threads=args.xgrammar_threads)
            fig.setup_s = xg.setup_s
            refused = time_compiles(xg, schemas, args.repeats, fig)
            for name, text in schemas.items():
                if name not in refused and (v.name, name) in walks:
                    replay_xgrammar(xg, text, walks[(v.name, name)], v.tokenizer.eos_token_ids, fig)

    for vname, per_engine in results.items():
        for ename, f in per_engine.items():
            for failure in f.failures:
                print(f"{vname}: {ename} could not compile {failure}")
    print("\ncompile: schema text to first mask (CPU: all the process's threads); mask: one step's fill (CPU: the "
          "calling thread's); differ/wider/narrower: steps where xgrammar's mask differs from llguidance's / allows a "
          "token llguidance does not / misses one llguidance allows")
    print(f"{'vocab':<15} {'engine':<11} {'setup s':>7} {'compile p50 ms':>14} {'p99':>7} {'cpu p50':>8} "
          f"{'mask p50 us':>11} {'p99':>7} {'cpu p50':>8} {'cpu p99':>8} {'accept p50 us':>13} {'steps':>5} "
          f"{'differ/wider/narrower':>21}")
    for vname, per_engine in results.items():
        for ename, f in per_engine.items():
            if not f.compile_wall or not f.mask_wall:
                continue
            diffs = "" if ename == "llguidance" else f"{f.mask_differences}/{f.wider_steps}/{f.narrower_steps}"
            print(f"{vname:<15} {ename:<11} {f.setup_s:7.2f} {pct(f.compile_wall, 50) * 1e3:14.2f} "
                  f"{pct(f.compile_wall, 99) * 1e3:7.2f} {pct(f.compile_cpu, 50) * 1e3:8.2f} "
                  f"{pct(f.mask_wall, 50) * 1e6:11.1f} {pct(f.mask_wall, 99) * 1e6:7.1f} "
                  f"{pct(f.mask_cpu, 50) * 1e6:8.1f} {pct(f.mask_cpu, 99) * 1e6:8.1f} "
                  f"{pct(f.accept_wall, 50) * 1e6:13.1f} {len(f.mask_wall):5d} {diffs:>21}")
    if have_xgrammar:
        print("\nxgrammar / llguidance (above 1: llguidance faster)")
        for vname, per_engine in results.items():
            a, b = per_engine["llguidance"], per_engine["xgrammar"]
            if not (a.compile_wall and b.compile_wall and a.mask_wall and b.mask_wall):
                continue
            print(f"{vname:<15} compile p50 {pct(b.compile_wall, 50) / pct(a.compile_wall, 50):6.1f}x  "
                  f"p99 {pct(b.compile_wall, 99) / pct(a.compile_wall, 99):6.1f}x  "
                  f"cpu p50 {pct(b.compile_cpu, 50) / pct(a.compile_cpu, 50):6.1f}x  "
                  f"mask p50 {pct(b.mask_wall, 50) / pct(a.mask_wall, 50):5.2f}x  "
                  f"p99 {pct(b.mask_wall, 99) / pct(a.mask_wall, 99):5.2f}x  "
                  f"(xgrammar refused {b.refused_steps} of llguidance's tokens)")
    print("\napply_bitmask_ (deepinfer.grammar, plain torch), median per call, wall / thread CPU:")
    for vname, per in applied.items():
        print(f"{vname:<15} " + "   ".join(f"{k}: {w * 1e6:.0f} / {c * 1e6:.0f} us" for k, (w, c) in per.items()))
    command = " ".join([sys.executable, "-m", "bench.bench_grammar", *(argv or sys.argv[1:])])
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average at end {os.getloadavg()[0]:.2f}; "
          f"reproduce: {command}")
    if args.json:
        keys = ("setup_s", "compile_wall", "compile_cpu", "mask_wall", "mask_cpu", "accept_wall", "failures",
                "mask_differences", "wider_steps", "narrower_steps", "refused_steps")
        out = {v: {e: {k: getattr(f, k) for k in keys} for e, f in per.items()} for v, per in results.items()}
        args.json.write_text(json.dumps({"machine": machine(), "notes": notes, "results": out,
                                         "apply_bitmask": applied}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
