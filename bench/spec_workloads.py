"""The four workloads of `bench/bench_spec.py`, built deterministically from text shipped in `bench/data/spec/`.

    from bench.spec_workloads import build, requests_for
    items = build("code", requests_for("code", 8))     # list[WorkItem], each with chat messages

* ``code``     (a) code edits: a snapshot of one of this repository's source files in the prompt, asked back whole
               with one function renamed;
* ``summary``  (b) summaries of a short document that must quote its key sentences verbatim;
* ``chat``     (c) open-ended questions, all different;
* ``agentic``  (d) agentic repeats: four task templates (a tool call as JSON, SQL for a fixed schema, a status
               report template, JSON extraction from an email) issued again and again with different ids and
               names, cycling through the templates, in this order (earlier outputs may help later requests).

Items are chat messages (role, content); the bench renders them with the model's chat template. Nothing here
imports torch or the engine, and nothing is random at run time: building the same workload twice gives the same
items. See bench/README.md (`bench_spec.py`) and bench/data/spec/README.md.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "spec"

WORKLOADS = ("code", "summary", "chat", "agentic")
LABELS = {"code": "(a) code edits", "summary": "(b) quoting summaries", "chat": "(c) open-ended chat",
          "agentic": "(d) agentic repeats"}

# Requests per workload at the benchmark's concurrencies (a closed loop keeps `concurrency` of them in flight).
COUNTS: dict[str, dict[int, int]] = {
    "code": {1: 4, 8: 8, 32: 32},
    "summary": {1: 4, 8: 12, 32: 32},
    "chat": {1: 4, 8: 12, 32: 32},
    # An agent loop issues its templates again and again: 4 rounds of the 4 templates at concurrency 1, and at
    # 32 a second wave that can learn from the first (all 32 of one wave are in flight together).
    "agentic": {1: 16, 8: 32, 32: 64},
}
QUICK_COUNTS: dict[str, dict[int, int]] = {w: {1: 1, 4: 4} for w in WORKLOADS} | {"agentic": {1: 2, 4: 4}}
# Greedy new tokens per request (EOS still ends a request earlier). A code edit's real answer is the whole file
# (830-1,150 tokens), but SmolLM2-135M does not copy one that far: asked for 1,280 tokens it falls into a loop (one
# import line or one sentence repeated) after a few hundred, which any lookup predicts (2026-12-02: 2.84-2.96x at
# c = 1, 1.51-1.57x at 8, on repetition, not copying). 160 keeps the measured part mostly the model's attempt.
MAX_TOKENS = {"code": 160, "summary": 128, "chat": 128, "agentic": 128}
QUICK_MAX_TOKENS = 24


def requests_for(workload: str, concurrency: int, quick: bool = False) -> int:
    """How many requests a run of `workload` at `concurrency` issues: the tables above, else 4 at concurrency 1
    (8 for agentic) and otherwise 2 × concurrency, at least concurrency and at most max(32, concurrency)."""
    _check(workload)
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    table = (QUICK_COUNTS if quick else COUNTS)[workload]
    if concurrency in table:
        return table[concurrency]
    if concurrency == 1:
        return 8 if workload == "agentic" else 4
    return max(concurrency, min(2 * concurrency, 32))


def max_tokens_for(workload: str, quick: bool = False) -> int:
    _check(workload)
    return QUICK_MAX_TOKENS if quick else MAX_TOKENS[workload]


@dataclass(frozen=True)
class WorkItem:
    """One request: chat messages plus what it was built from (`meta`, for the report)."""

    workload: str
    index: int
    key: str  # stable, human-readable: which file/document/question/template and variation
    messages: tuple[tuple[str, str], ...]  # (role, content), the last one the user's
    meta: dict[str, Any] = field(default_factory=dict, compare=True)

    def chat(self) -> list[dict[str, str]]:
        """The messages as a chat template takes them."""
        return [{"role": r, "content": c} for r, c in self.messages]


def build(workload: str, n: int) -> list[WorkItem]:
    """The first `n` items of `workload`, in issue order."""
    _check(workload)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [_BUILDERS[workload](i) for i in range(n)]


def _check(workload: str) -> None:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")


# -- (a) code edits --------------------------------------------------------------------------------------------

CODE_SYSTEM = ("You are a precise coding assistant. When asked to edit a file, you output the complete edited "
               "file and nothing else.")

# Snapshot file → (original path, [(kind, old name, [new names])]); smallest file first.
CODE_FILES: dict[str, tuple[str, list[tuple[str, str, list[str]]]]] = {
    "services__tokenizer.py.txt": ("deepinfer/services/tokenizer.py", [
        ("method", "_encode", ["_handle_encode", "_on_encode_request", "_encode_request"]),
        ("method", "_detokenize", ["_handle_detokenize", "_on_detokenize_batch", "_detokenize_batch"]),
        ("method", "handlers", ["message_handlers", "handler_table", "dispatch_table"]),
        ("method", "_abort", ["_handle_abort", "_on_abort_request", "_abort_request"]),
    ]),
    "protocol__framing.py.txt": ("deepinfer/protocol/framing.py", [
        ("function", "encode_frames", ["pack_frames", "frames_of", "to_frames"]),
        ("function", "decode_frames", ["unpack_frames", "message_of", "from_frames"]),
        ("function", "_check_sizes", ["_validate_sizes", "_enforce_limits", "_check_frame_sizes"]),
        ("function", "type_frame", ["type_byte_frame", "topic_frame", "first_frame"]),
    ]),
    "launch__systemd.py.txt": ("deepinfer/launch/systemd.py", [
        ("function", "unit_files", ["render_unit_files", "systemd_units", "unit_file_texts"]),
        ("function", "write_units", ["install_units", "write_unit_files", "save_units"]),
        ("function", "exec_start", ["exec_line", "exec_command", "start_command"]),
    ]),
    "engine__identity.py.txt": ("deepinfer/loading/identity.py", [
        ("function", "source_fingerprint", ["fingerprint_source", "source_digest", "weights_fingerprint"]),
        ("function", "cache_namespace", ["build_cache_namespace", "namespace_for", "make_cache_namespace"]),
        ("function", "kv_layout", ["describe_kv_layout", "kv_layout_name", "layout_string"]),
        ("function", "model_files", ["list_model_files", "weight_files", "find_model_files"]),
        ("function", "model_config_at", ["read_model_config", "load_model_config", "config_at"]),
    ]),
}


@cache
def code_source(snapshot: str) -> str:
    return (DATA / "code" / snapshot).read_text(encoding="utf-8")


def _renames(snapshot: str) -> list[tuple[str, str, str]]:
    """Every (kind, old, new) of a file: first choice of new name for each function, then the second, ..."""
    entries = CODE_FILES[snapshot][1]
    depth = max(len(news) for _, _, news in entries)
    return [(kind, old, news[j]) for j in range(depth) for kind, old, news in entries if j < len(news)]


def _code(i: int) -> WorkItem:
    files = list(CODE_FILES)
    snapshot = files[i % len(files)]
    path = CODE_FILES[snapshot][0]
    renames = _renames(snapshot)
    kind, old, new = renames[(i // len(files)) % len(renames)]
    src = code_source(snapshot)
    user = (f"Here is the file `{path}` from a Python project:\n\n```python\n{src}```\n\n"
            f"Rewrite this file with the {kind} `{old}` renamed to `{new}`, and update every place that uses it. "
            "Change nothing else. Output the whole file in one ```python code block and nothing else.")
    return WorkItem("code", i, f"{path}:{old}->{new}", (("system", CODE_SYSTEM), ("user", user)),
                    {"file": path, "snapshot": f"bench/data/spec/code/{snapshot}", "kind": kind, "old": old,
                     "new": new})


# -- (b) summaries that quote ----------------------------------------------------------------------------------

DOCUMENTS = ("footbridge_inspection.txt", "library_board_minutes.txt", "sourdough_starter.txt",
             "ledgerline_release_notes.txt", "greyfen_lighthouse.txt", "garden_water_policy.txt")
SUMMARY_VARIANTS = (  # (audience, number of sentences to quote)
    ("a busy manager", 3), ("a new member of the team", 2), ("readers of a local newspaper", 3),
    ("someone who will act on it tomorrow", 2), ("a ten-year-old reader", 2), ("an archive catalogue", 3),
)


@cache
def document(name: str) -> tuple[str, str]:
    """(title, body) of a shipped document: its first line, and the rest."""
    title, _, body = (DATA / "documents" / name).read_text(encoding="utf-8").partition("\n")
    return title.strip(), body.strip()


def _summary(i: int) -> WorkItem:
    name = DOCUMENTS[i % len(DOCUMENTS)]
    audience, k = SUMMARY_VARIANTS[(i // len(DOCUMENTS)) % len(SUMMARY_VARIANTS)]
    title, body = document(name)
    user = (f"Summarize the document below for {audience} in four or five sentences. Quote its {k} most "
            "important sentences word for word, each inside double quotes, and quote nothing else.\n\n"
            f"{title}\n\n{body}")
    return WorkItem("summary", i, f"{name}:{audience}", (("user", user),),
                    {"document": f"bench/data/spec/documents/{name}", "audience": audience, "quotes": k})


# -- (c) open-ended chat ---------------------------------------------------------------------------------------

QUESTIONS = (
    "What are some good ways to stay focused when working from home?",
    "Why is the sky blue during the day but red at sunset?",
    "Can you suggest a weekend itinerary for someone visiting a small coastal town?",
    "What makes a good first programming language to learn, and why?",
    "Write a short poem about the first snowfall of the year.",
    "How do vaccines train the immune system?",
    "What are the pros and cons of electric cars compared with petrol cars?",
    "Give me some ideas for a birthday party for an eight-year-old who loves dinosaurs.",
    "Explain the difference between weather and climate.",
    "How can I start learning to play the guitar as an adult?",
    "What should I consider before adopting a dog?",
    "Tell me a short story about a robot who wants to become a gardener.",
    "Why do some people find it hard to fall asleep, and what can help?",
    "What is the best way to prepare for a job interview?",
    "How does compound interest work? Give a simple example.",
    "What are some interesting facts about octopuses?",
    "How would you explain what the internet is to someone from the year 1900?",
    "What are a few healthy breakfast ideas that take less than ten minutes?",
    "Describe a day in the life of a lighthouse keeper in the nineteenth century.",
    "What are the main causes of traffic jams in cities, and how can they be reduced?",
    "How do I write a polite email declining a meeting invitation?",
    "What are some tips for taking better photos with a phone?",
    "Why do leaves change colour in autumn?",
    "Suggest five names for a small bakery and explain each one.",
    "What is the difference between a virus and a bacterium?",
    "How can a small team keep its meetings short and useful?",
    "What would happen if the Moon suddenly disappeared?",
    "Give me advice on learning a new language in six months.",
    "How do bees make honey?",
    "What are some fun things to do on a rainy day indoors?",
    "Explain recursion to a beginner using an everyday example.",
    "What are the benefits of keeping a journal?",
    "How do solar panels turn sunlight into electricity?",
    "Write a friendly note to a neighbour asking them to water your plants while you are away.",
    "What makes a story exciting to read?",
    "How can I reduce the amount of food I waste at home?",
)


def _chat(i: int) -> WorkItem:
    q = QUESTIONS[i % len(QUESTIONS)]
    return WorkItem("chat", i, f"question-{i % len(QUESTIONS)}", (("user", q),), {"question": i % len(QUESTIONS)})


# -- (d) agentic repeats ---------------------------------------------------------------------------------------

FIRST_NAMES = ("Alice", "Bilal", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Julia", "Kofi",
               "Lena", "Mateo", "Nadia", "Oscar", "Priya", "Quinn", "Rosa", "Sven", "Tariq")
LAST_NAMES = ("Moreau", "Okafor", "Lindqvist", "Haddad", "Novak", "Tanaka", "Silva", "Brennan", "Kowalski",
              "Mensah", "Petrov", "Ibarra", "Whitfield", "Sato", "Dubois", "Keller")
PRODUCTS = ("kettle", "desk lamp", "pair of hiking boots", "bicycle helmet", "coffee grinder", "backpack",
            "wireless keyboard", "rice cooker")
SERVICES = ("payments-api", "search-indexer", "auth-gateway", "billing-worker", "image-resizer", "orders-db")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")

TOOLS = [
    {"name": "create_ticket", "description": "Open a support ticket.",
     "parameters": {"customer_id": "string", "order_id": "string", "title": "string",
                    "priority": "one of low, normal, high", "assignee": "string"}},
    {"name": "search_orders", "description": "Find a customer's orders.",
     "parameters": {"customer_id": "string", "status": "one of open, shipped, cancelled"}},
    {"name": "send_email", "description": "Send an email to a customer.",
     "parameters": {"to": "string", "subject": "string", "body": "string"}},
]
TOOL_SYSTEM = ("You are an agent that acts only by calling tools. The tools are:\n"
               + "\n".join(json.dumps(t) for t in TOOLS)
               + '\nReply with exactly one JSON object of the form {"tool": "<name>", "arguments": {...}} and '
                 "nothing else.")

SQL_SCHEMA = """CREATE TABLE customers (id SERIAL PRIMARY KEY, name TEXT NOT NULL, email TEXT UNIQUE NOT NULL);
CREATE TABLE orders (id SERIAL PRIMARY KEY, customer_id INTEGER REFERENCES customers(id),
                     placed_at TIMESTAMP NOT NULL, status TEXT NOT NULL);
CREATE TABLE order_items (order_id INTEGER REFERENCES orders(id), product_id INTEGER REFERENCES products(id),
                          quantity INTEGER NOT NULL, unit_price NUMERIC(10, 2) NOT NULL);
CREATE TABLE products (id SERIAL PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL);"""
SQL_SYSTEM = ("You write PostgreSQL queries for this schema:\n" + SQL_SCHEMA
              + "\nAnswer with a single SQL query in a ```sql code block and no explanation.")

REPORT_TEMPLATE = """## Incident status report
- Incident: <incident id>
- Service: <service>
- Owner: <owner>
- Started: <start time>
- Current status: <status>
- Customer impact: <impact>
- Next step: <next step>
- Next update: in 30 minutes"""
REPORT_SYSTEM = ("You are an operations assistant. Fill in report templates exactly: keep every heading and line, "
                 "and replace each <...> with the value from the facts.")

EXTRACT_SYSTEM = ("You extract structured data from support emails. Reply with one JSON object with the keys "
                  "customer_name, order_id, product, problem and requested_action, and nothing else.")

AGENT_TEMPLATES = ("tool_call", "sql", "status_report", "extract")


def _person(rng: random.Random) -> tuple[str, str]:
    return rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)


def _agentic(i: int) -> WorkItem:
    t = i % len(AGENT_TEMPLATES)
    template, v = AGENT_TEMPLATES[t], i // len(AGENT_TEMPLATES)
    rng = random.Random(1000 * (t + 1) + v)  # each (template, variation) its own fixed stream
    first, last = _person(rng)
    cid, order = f"C-{rng.randrange(10000, 99999)}", f"ORD-{rng.randrange(100000, 999999)}"
    if template == "tool_call":
        afirst, alast = _person(rng)
        priority = rng.choice(("low", "normal", "high"))
        user = (f"Step {v + 1}: customer {first} {last} (id {cid}) reports that order {order} arrived damaged. "
                f"Open a ticket about it with priority {priority} and assign it to {afirst} {alast}.")
        system = TOOL_SYSTEM
        meta = {"customer_id": cid, "order_id": order, "priority": priority}
    elif template == "sql":
        month = rng.randrange(12)
        year = rng.choice((2022, 2023, 2024))
        email = f"{first.lower()}.{last.lower()}@example.com"
        user = (f"What is the total amount spent, and the number of orders placed, by the customer with email "
                f"'{email}' in {MONTHS[month]} {year}? Count only orders whose status is 'delivered'.")
        system = SQL_SYSTEM
        meta = {"email": email, "month": month + 1, "year": year}
    elif template == "status_report":
        afirst, alast = _person(rng)
        service = rng.choice(SERVICES)
        inc = f"INC-{rng.randrange(1000, 9999)}"
        start = f"{rng.randrange(24):02d}:{rng.randrange(60):02d} UTC"
        status = rng.choice(("investigating", "mitigated", "monitoring"))
        pct = rng.randrange(2, 40)
        release = f"{rng.randrange(1, 4)}.{rng.randrange(20)}.{rng.randrange(10)}"
        user = (f"Facts: incident={inc}, service={service}, owner={afirst} {alast}, started={start}, "
                f"status={status}, impact={pct}% of requests failed, next step=roll back release {release}.\n\n"
                f"Template:\n{REPORT_TEMPLATE}\n\nWrite the filled-in report and nothing else.")
        system = REPORT_SYSTEM
        meta = {"incident": inc, "service": service}
    else:
        product = rng.choice(PRODUCTS)
        problem = rng.choice(("with a cracked case", "two weeks late", "without its power cable",
                              "in the wrong colour"))
        action = rng.choice(("send a replacement", "refund the order", "tell me when it will be fixed"))
        user = (f"Email:\nHello, this is {first} {last}. My order {order} for a {product} arrived {problem}. "
                f"Could you please {action}? Thank you.")
        system = EXTRACT_SYSTEM
        meta = {"order_id": order, "product": product}
    return WorkItem("agentic", i, f"{template}#{v}", (("system", system), ("user", user)),
                    {"template": template, "variation": v} | meta)


_BUILDERS = {"code": _code, "summary": _summary, "chat": _chat, "agentic": _agentic}
