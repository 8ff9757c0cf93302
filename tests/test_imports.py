"""The import graph of the four packages, read from the source (AST; nothing is imported): no import cycle, neither
at module level nor inside a function (a lazy import that closes a cycle works only by the order of first calls);
no private name (``_x``) imported from another module of ours; ``kernels_torch.ops`` never imports a layer module;
every import points down the layering ``kimi`` <- ``reference_jax``, ``kernels_torch`` <- ``kimi_tools``. And
``reference_jax`` (with ``kimi``) imports without torch, in a child process where torch cannot be imported.

Known exceptions are edges in files left to their owners; each names the owner, who removes it with the fix. Mutations killed: a lazy ``from kernels_torch.kda_cudnn import ...`` back into ``kernels_torch.kda`` from
inside ``kda_cudnn`` (cycle); ``kimi/init.py`` importing a private helper of ``kimi.checkpoint``
(``_write_tensor_data``, private name); ``kernels_torch.ops.kda_prep`` importing ``A_LOG_MAX`` from ``kernels_torch.kda`` (ops -> layer, and a cycle through
``kda_cudnn``); a module-level ``import torch`` in ``reference_jax/sharding.py`` (no-torch check).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kimi", "reference_jax", "kernels_torch", "kimi_tools")
LAYER_RANK = {"kimi": 0, "reference_jax": 1, "kernels_torch": 1, "kimi_tools": 2}  # imports point to a lower rank
OPS = "kernels_torch.ops"
OPS_MAY_IMPORT = ("kernels_torch.common", "kernels_torch.kernel_choice", "kernels_torch.activations")  # helpers

# (importer, imported) edges left to their owners; the checks ignore exactly these edges.
KNOWN_CYCLE_EDGES = {}
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()  # (importer, "module.name"); none left


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = f
    return out


MODULES = _modules()


def _own(name: str) -> str | None:
    """The module of ours that importing ``name`` runs last: ``name`` itself or its closest enclosing package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not MODULES[module].name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _scan(module: str) -> tuple[dict[str, int], list[tuple[int, str]]]:
    """``({imported module: first line}, [(line, private "module.name")])`` for one module, every import in the
    file (module level, inside functions, under ``if``/``try``), plus ``alias._x`` uses of an imported module."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    edges: dict[str, int] = {}
    private: list[tuple[int, str]] = []
    aliases: dict[str, str] = {}

    def edge(target: str | None, line: int) -> None:
        if target and target != module:
            edges.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                target = _own(a.name)
                edge(target, node.lineno)
                if target and a.asname and target == a.name:
                    aliases[a.asname] = target
                elif target and not a.asname:
                    aliases[a.name.partition(".")[0]] = _own(a.name.partition(".")[0]) or target
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            if not _own(base):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in MODULES:  # a submodule
                    edge(full, node.lineno)
                    aliases[a.asname or a.name] = full
                else:
                    edge(_own(base), node.lineno)
                    if a.name.startswith("_") and not a.name.startswith("__") and _own(base) != module:
                        private.append((node.lineno, f"{base}.{a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != module:
                private.append((node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
    return edges, private


SCAN = {m: _scan(m) for m in MODULES}


def _graph(skip: set[tuple[str, str]]) -> dict[str, dict[str, int]]:
    return {m: {t: ln for t, ln in SCAN[m][0].items() if (m, t) not in skip} for m in MODULES}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _describe(graph: dict[str, dict[str, int]], comp: list[str]) -> str:
    inside = [
        f"{MODULES[a].relative_to(ROOT)}:{ln} imports {b}" for a in comp for b, ln in graph[a].items() if b in comp
    ]
    return "cycle among " + ", ".join(comp) + ":\n    " + "\n    ".join(sorted(inside))


def test_the_walk_sees_every_package_and_function_level_imports():
    """The scan itself: all four packages are there, and a lazy import inside a function counts as an edge."""
    assert {m.partition(".")[0] for m in MODULES} == set(PACKAGES)
    assert "kernels_torch.kda_cudnn" in MODULES and "kernels_torch.ops.kda_prep" in MODULES
    assert "kernels_torch.decode_cudnn" in SCAN["kernels_torch.mla"][0]  # imported inside GatedMLA.forward


def test_no_import_cycles():
    graph = _graph(KNOWN_CYCLE_EDGES)
    cycles = _cycles(graph)
    assert not cycles, "import cycles (module-level or inside functions):\n  " + "\n  ".join(
        _describe(graph, c) for c in cycles
    )


def test_no_private_names_across_modules():
    bad = [
        f"{MODULES[m].relative_to(ROOT)}:{ln} uses {name}"
        for m, (_, private) in SCAN.items()
        for ln, name in private
        if (m, name) not in KNOWN_PRIVATE_IMPORTS
    ]
    assert not bad, "private names used across modules (make them public and documented, or restructure):\n  " + (
        "\n  ".join(bad)
    )


def test_ops_never_import_layers():
    bad = [
        f"{MODULES[m].relative_to(ROOT)}:{ln} imports {t}"
        for m, edges in _graph(KNOWN_CYCLE_EDGES).items()
        if m == OPS or m.startswith(OPS + ".")
        for t, ln in edges.items()
        if t.startswith("kernels_torch") and t != "kernels_torch" and not t.startswith(OPS) and t not in OPS_MAY_IMPORT
    ]
    assert not bad, "kernels_torch.ops imports a layer module:\n  " + "\n  ".join(bad)


def test_imports_point_down_the_layering():
    bad = [
        f"{MODULES[m].relative_to(ROOT)}:{ln} imports {t}"
        for m, edges in SCAN.items()
        for t, ln in edges[0].items()
        if m.partition(".")[0] != t.partition(".")[0]
        and LAYER_RANK[t.partition(".")[0]] >= LAYER_RANK[m.partition(".")[0]]
    ]
    assert not bad, "imports against the layering kimi <- reference_jax, kernels_torch <- kimi_tools:\n  " + (
        "\n  ".join(bad)
    )


_NO_TORCH = textwrap.dedent(
    """
    import importlib, sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is blocked: reference_jax and kimi must import without torch")

    sys.meta_path.insert(0, NoTorch())
    for name in sys.argv[1:]:
        importlib.import_module(name)
    assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
    print("imported", len(sys.argv) - 1, "modules without torch")
    """
)


def test_reference_and_base_import_without_torch():
    """Every module of ``reference_jax`` and ``kimi``, imported with torch unimportable."""
    names = sorted(m for m in MODULES if m.partition(".")[0] in ("kimi", "reference_jax"))
    r = subprocess.run([sys.executable, "-c", _NO_TORCH, *names], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
