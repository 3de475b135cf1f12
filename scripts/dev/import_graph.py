"""The import graph of `src/loorl`: files, internal imports, imports that point upward, cycles.

    python scripts/dev/import_graph.py [--edges]

An import is an edge between two loorl modules (`import loorl.x`, `from loorl.x import y`,
`from loorl import x`, function-level imports included). Imports under `if TYPE_CHECKING:` are
edges too, typing edges: an annotation that names a type of a higher layer ties the lower one to it
as surely as a call does (a plug-in's documented signature would name it), so they count in
`upward` and `cycles` like the others; `typing` says how many of the imports are typing only, and
`--edges` marks them. "Upward" means the imported module sits in a higher layer than the importer,
by `LAYERS` below (a module's layer is that of the longest prefix listed; the tree's own folders
are the layers). A cycle is a strongly connected component of more than one module (Tarjan's
algorithm, over the whole graph, typing edges included).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src"  # --root changes it

# lowest first: a module may import from its own layer and below. The second name of each pair is
# where that layer's modules lived in the flat tree before the folders (`--root` at an older commit).
LAYERS = [
    ["loorl.errors", "loorl.types", "loorl.util", "loorl.parallel"]
    + [f"loorl.{m}" for m in ("padding", "hardware", "profiling", "allocator", "wheels", "autocast")]
    + ["loorl.distributed", "loorl.fsdp"],
    ["loorl.algo"] + [f"loorl.{m}" for m in ("masked", "estimators", "losses", "logprobs", "evaluation")],
    ["loorl.settings", "loorl.resolvers"],
    ["loorl.sandbox", "loorl.tasks", "loorl.tools"],
    ["loorl.models", "loorl.gguf_models"],
    ["loorl.planning"],  # the memory plan: reads the settings and the models' architecture (meta device)
    ["loorl.rewards", "loorl.reward_model", "loorl.reward_library"],
    ["loorl.rollout"],
    ["loorl.training"] + [f"loorl.{m}" for m in ("module", "callbacks", "checkpoints", "strategies")],
    ["loorl.estimator_inputs", "loorl.config", "loorl.build"],
    ["loorl.research", "loorl.cli"]
    + [f"loorl.{m}" for m in ("ablation", "grad_variance", "train", "evaluate")]
    + ["loorl.console"],
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> int | None:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    return rank


def imports(path: Path, modules: set[str]) -> dict[str, bool]:
    """The loorl modules `path` imports (a package import counts as its `__init__`), each with True
    when it is imported only under `if TYPE_CHECKING:` (a typing edge)."""
    me = module_name(path)
    found: dict[str, bool] = {}
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for n in ast.walk(block)
    }
    for node in ast.walk(tree):
        typing = id(node) in typing_only
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                pkg = me.split(".")[: -node.level] if not path.name == "__init__.py" else me.split(".")
                base = ".".join(pkg + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for n in names:
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n and n != me and n != "loorl":
                found[n] = found.get(n, True) and typing  # a run-time import anywhere makes it run-time
    # `from loorl.x import y` adds both loorl.x.y (when a module) and loorl.x: keep the most specific
    specific = lambda n: not any(o.startswith(n + ".") for o in found) or n.endswith("__init__")
    return {n: t for n, t in found.items() if specific(n)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--edges", action="store_true", help="list every edge and every upward one")
    parser.add_argument("--root", type=Path, help="another checkout's src/ folder (e.g. a git worktree)")
    args = parser.parse_args(argv)
    global ROOT
    ROOT = args.root.resolve() if args.root else ROOT
    files = sorted(p for p in (ROOT / "loorl").rglob("*.py"))
    modules = {module_name(p) for p in files} - {"loorl"}
    files = [p for p in files if module_name(p) in modules]
    found_imports = {module_name(p): imports(p, modules) for p in files}
    graph = {a: set(bs) for a, bs in found_imports.items()}  # typing edges included
    edges = [(a, b) for a in sorted(graph) for b in sorted(graph[a])]
    typing = {(a, b) for a, b in edges if found_imports[a][b]}
    upward = [(a, b) for a, b in edges if None not in (layer(a), layer(b)) and layer(b) > layer(a)]
    unlayered = sorted(m for m in modules if layer(m) is None)
    found = cycles(graph)
    print(f"files: {len(files)}  imports: {len(edges)}  typing: {len(typing)}  upward: {len(upward)}  "
          f"cycles: {len(found)}")  # fmt: skip
    mark = lambda a, b: "  (typing only)" if (a, b) in typing else ""
    for a, b in upward:
        print(f"  upward: {a} -> {b}{mark(a, b)}")
    for c in found:
        print(f"  cycle: {' <-> '.join(c)}")
    if unlayered:
        print(f"  not in LAYERS: {', '.join(unlayered)}")
    if args.edges:
        for a, b in edges:
            print(f"  {a} -> {b}{mark(a, b)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
