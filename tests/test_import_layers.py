"""The packages of diffrl import only downward, and no set of modules imports itself in a circle.

An AST scan of every module under `diffrl/`, imports inside functions and `if` blocks included, builds the graph of
diffrl-internal imports. Each module sits in one layer (the table below); an import may point to its own layer or a
lower one, never up, and the graph has no circle (modules of one package may import each other, but not in a circle).

An import of diffrl inside a function is allowed only where it defers a heavy optional dependency or keeps
`diffrl --help` fast, and a comment says so: a comment containing "defer" or "lazy" on the import's lines or on the
comment lines just above its block of consecutive import statements (one comment may cover the block).

Imports spelled as strings (`importlib.import_module("diffrl.rewards.hps")`, the reward registry's
`"module:function"` entries) are not seen; every such string today names a module of the package that holds it.

Run as a script (`python tests/test_import_layers.py`) to print every upward import, every circle and every diffrl
import inside a function (those without their comment marked).
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "diffrl"

# Layers, top to bottom: a module may import its own layer or any layer below it.
LAYERS = ["cli", "recipes-launch", "train", "rollout-tasks", "evaluation", "rewards", "serving", "engine", "models", "leaf"]

# Where each top-level module or package of diffrl/ sits, and why. Longest prefix wins.
PLACEMENT: dict[str, tuple[str, str]] = {
    "diffrl": ("leaf", "the package root holds no code"),
    "diffrl.cli": ("cli", "the commands: they parse flags and wire every other part together"),
    "diffrl.recipes": ("recipes-launch", "named flag sets for published runs; build train configs"),
    "diffrl.launch": ("recipes-launch", "Ray placement starts trainers and engine actors on a cluster"),
    "diffrl.train": ("train", "the loop, policy, objectives, checkpoints and the config tree"),
    "diffrl.rollout": ("rollout-tasks", "the rollout manager and engine clients the trainer drives"),
    "diffrl.tasks": ("rollout-tasks", "where prompts come from and which evaluation judges a model"),
    "diffrl.evaluation": ("evaluation", "sampling at fixed seeds and scoring: what tasks, evaluate and compare call"),
    "diffrl.rewards": ("rewards", "scorers over decoded images; no engine or trainer state"),
    "diffrl.serving": ("serving", "HTTP, wire formats, sglang compatibility, the colocated engine process"),
    "diffrl.engine": ("engine", "request validation, prompt encoding, batched denoising, weight updates"),
    "diffrl.models": ("models", "family adapters, LoRA, compile, FP8, checkpoint loading"),
    "diffrl.sampling": ("leaf", "schedules, noise and transitions: pure math over tensors"),
    "diffrl.algorithms": ("leaf", "advantages, train pairs and losses: pure functions"),
    "diffrl.data": ("leaf", "prompt files and the shapes world (grammar, renderer, verifier)"),
    "diffrl.utils": ("leaf", "devices, files, timing and process helpers with no diffrl dependency above"),
    "diffrl.errors": ("leaf", "the exception types every layer raises"),
    "diffrl.assets": ("leaf", "the shipped demo models' folders, named without loading a model"),
}


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    path: str  # importing file, relative to the repository
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} -> {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module of diffrl (an attribute import names its module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    rel = str(path.relative_to(ROOT))
    edges = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from diffrl.serving import server` imports the module diffrl.serving.server; `from diffrl.engine import
            # denoise` likewise, while `from diffrl.engine import DenoiseResult` imports the package's __init__.
            targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix for alias in node.names]
        for target in targets:
            if not (target == "diffrl" or target.startswith("diffrl.")):
                continue
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                edges.append(Edge(module, resolved, rel, node.lineno))
    return list(dict.fromkeys(edges))  # one edge per line, however many names it imports


def layer_of(module: str) -> str:
    best = max((prefix for prefix in PLACEMENT if module == prefix or module.startswith(prefix + ".")), key=len)
    return PLACEMENT[best][0]


def import_graph() -> list[Edge]:
    modules = all_modules()
    return [edge for module, path in modules.items() for edge in imports_of(module, path, modules)]


def upward_imports(edges: list[Edge]) -> list[Edge]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}  # 0 is the top
    return [e for e in edges if rank[layer_of(e.target)] < rank[layer_of(e.source)]]


def circles(edges: list[Edge]) -> list[list[Edge]]:
    """One circle per strongly connected component of more than one module (Tarjan), spelled as a closed path."""
    graph: dict[str, list[Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, []).append(e)
        graph.setdefault(e.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph[v]:
            w = e.target
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)

    found = []
    for component in sorted(components):
        members = set(component)
        # the shortest circle through the component's first module, by breadth-first search inside the component
        start = component[0]
        came: dict[str, Edge | None] = {start: None}
        queue = [start]
        closing = None
        while queue and closing is None:
            nxt = []
            for v in queue:
                for e in graph[v]:
                    if e.target not in members:
                        continue
                    if e.target == start:
                        closing = e
                        break
                    if e.target not in came:
                        came[e.target] = e
                        nxt.append(e.target)
                if closing is not None:
                    break
            queue = nxt
        path = [closing]
        v = closing.source
        while came[v] is not None:
            path.append(came[v])
            v = came[v].source
        path.reverse()
        found.append((component, path))
    return found


def describe_circle(component: list[str], path: list[Edge], edges: list[Edge]) -> str:
    members = set(component)
    inside = [e for e in edges if e.source in members and e.target in members]
    lines = [f"circle of {len(component)} modules ({', '.join(component)}); the shortest through {component[0]}:"]
    lines += [f"    {e}" for e in path]
    lines.append(f"  and every import among them ({len(inside)}):")
    lines += [f"    {e}" for e in inside]
    return "\n".join(lines)


# What a comment must say for a diffrl import to stay inside a function.
DEFERRAL = re.compile(r"defer|lazy", re.IGNORECASE)


@dataclass(frozen=True)
class HiddenImport:
    path: str  # importing file, relative to the repository
    line: int
    function: str
    statement: str  # the import's first line
    explained: bool  # a comment says which dependency it defers

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: in {self.function}(): {self.statement}"


def _imports_diffrl(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == "diffrl" or a.name.startswith("diffrl.") for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or node.module == "diffrl" or (node.module or "").startswith("diffrl.")
    return False


def _statement_lists(node: ast.AST):
    """Every list of statements directly under `node` (bodies, else branches, handlers' bodies, match cases)."""
    for name in ("body", "orelse", "finalbody"):
        value = getattr(node, name, None)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            yield value
    for child in getattr(node, "handlers", []) + getattr(node, "cases", []):
        yield child.body


def hidden_imports_of(path: Path, root: Path = ROOT) -> list[HiddenImport]:
    """The diffrl imports inside functions of `path`, each with whether a comment explains it."""
    text = path.read_text()
    lines = text.splitlines()
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    rel = str(path.relative_to(root))
    found: list[HiddenImport] = []

    def explained(block: list[ast.stmt]) -> bool:
        said = [comments.get(n, "") for s in block for n in range(s.lineno, s.end_lineno + 1)]
        n = block[0].lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):  # the comment lines just above the block
            said.append(lines[n - 1])
            n -= 1
        return any(DEFERRAL.search(c) for c in said)

    def visit(node: ast.AST, function: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        for body in _statement_lists(node):
            if function is not None:
                block: list[ast.stmt] = []
                for stmt in [*body, None]:  # blocks of consecutive imports
                    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                        block.append(stmt)
                        continue
                    ok = bool(block) and explained(block)
                    found.extend(HiddenImport(rel, s.lineno, function, lines[s.lineno - 1].strip(), ok)
                                 for s in block if _imports_diffrl(s))
                    block = []
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(text, filename=str(path)), None)
    return sorted(found, key=lambda h: h.line)


def hidden_imports() -> list[HiddenImport]:
    return [h for path in all_modules().values() for h in hidden_imports_of(path)]


def test_every_top_level_part_has_a_layer():
    top = {module_name(p) for p in PACKAGE.glob("*.py")} | {
        f"diffrl.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()
    }
    top.discard("diffrl")
    assert not top - set(PLACEMENT), f"give these a layer in PLACEMENT: {sorted(top - set(PLACEMENT))}"
    assert {layer for layer, _ in PLACEMENT.values()} <= set(LAYERS)


def test_the_scan_sees_imports_in_functions_and_relative_imports():
    modules = all_modules()
    edges = imports_of("diffrl.data.shapes", modules["diffrl.data.shapes"], modules)
    assert {"diffrl.data.shapes.grammar", "diffrl.data.shapes.verify"} <= {e.target for e in edges}
    edges = imports_of("diffrl.rewards", modules["diffrl.rewards"], modules)
    assert "diffrl.data.shapes.verify" in {e.target for e in edges}  # imported inside a function


def test_no_import_points_up_the_layers():
    upward = upward_imports(import_graph())
    assert not upward, f"{len(upward)} upward imports (layers, top to bottom: {' > '.join(LAYERS)}):\n" + "\n".join(
        f"  {e}  ({layer_of(e.source)} imports {layer_of(e.target)})" for e in upward
    )


def test_no_import_circles():
    graph = import_graph()
    found = circles(graph)
    assert not found, f"{len(found)} import circles:\n" + "\n".join(describe_circle(c, p, graph) for c, p in found)


def test_the_hidden_import_scan_sees_comments_above_a_block_and_on_the_line(tmp_path):
    source = (
        "import diffrl.errors\n"
        "def f():\n"
        "    # deferred: diffusers\n"
        "    from diffrl.models import demo\n"
        "    from diffrl.models import sd3\n"
        "\n"
        "    import json\n"
        "    from diffrl.data import prompts\n"  # the same block: statements in a row, blank lines or not
        "    x = 1\n"
        "    from diffrl.rewards import get_reward\n"
        "    if True:\n"
        "        import diffrl.data  # lazy: keeps the CLI's help fast\n"
        "    from . import errors\n"
    )
    module = tmp_path / "example.py"
    module.write_text(source)
    found = hidden_imports_of(module, root=tmp_path)
    assert [(h.line, h.explained) for h in found] == [(4, True), (5, True), (8, True), (10, False), (12, True), (13, False)]


def test_diffrl_imports_inside_functions_say_what_they_defer():
    unexplained = [h for h in hidden_imports() if not h.explained]
    assert not unexplained, (
        f"{len(unexplained)} diffrl imports inside functions: move each to the top of its module, or, where it defers "
        "a heavy optional dependency or keeps `diffrl --help` fast, say which in a comment containing 'defer' or "
        "'lazy' (on the import, or just above its block of imports):\n" + "\n".join(f"  {h}" for h in unexplained))


if __name__ == "__main__":
    graph = import_graph()
    upward = upward_imports(graph)
    print(f"{len(graph)} diffrl-internal imports; {len(upward)} upward:")
    for e in upward:
        print(f"  {e}  ({layer_of(e.source)} imports {layer_of(e.target)})")
    found = circles(graph)
    print(f"{len(found)} circles:")
    for component, path in found:
        print(describe_circle(component, path, graph))
    hidden = hidden_imports()
    print(f"{len(hidden)} diffrl imports inside functions, {sum(not h.explained for h in hidden)} without a comment "
          "saying what they defer (marked *):")
    for h in hidden:
        print(f"  {' ' if h.explained else '*'} {h}")
