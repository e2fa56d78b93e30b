"""The package layers hold: `lint-imports` checks the contracts in pyproject.toml ([tool.importlinter]) — every
import goes down the layers (launch > gateway > services > metrics > protocol | engine > loading | grammar >
text | cache > config > kernels), so there is no cycle between packages, and the cache imports nothing of the
wire."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lint_imports() -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    return subprocess.run([exe, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_every_import_goes_down_the_layers():
    out = lint_imports()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout and "2 kept, 0 broken" in out.stdout, out.stdout


def module_cycles() -> list[list[str]]:
    """Strongly connected groups of deepinfer's modules (imports anywhere in a file, TYPE_CHECKING excluded)."""
    import grimp

    graph = grimp.build_graph("deepinfer", exclude_type_checking_imports=True, cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for m in sorted(edges):
        if m not in index:
            visit(m)
    return groups


def test_no_module_imports_itself_through_others():
    assert module_cycles() == []


def test_the_services_without_an_engine_load_neither_torch_nor_the_grammar_engine() -> None:
    """The router, tokenizer and gateway handle requests' parameters (a structured-output spec among them) but never
    run a model: importing torch costs a service about a second of start-up, and ten services starting at once on two
    cores kept a router from binding within a client's 10 s connect (the secured cluster test, when the spec's
    package imported torch eagerly)."""
    import subprocess
    import sys

    code = ("import sys, deepinfer.services.router, deepinfer.services.tokenizer, deepinfer.gateway.app, "
            "deepinfer.services.wire; from deepinfer.grammar import ConstraintSpec; "
            "heavy = [m for m in ('torch', 'llguidance') if m in sys.modules]; assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
