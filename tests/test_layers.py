"""The package's import graph, computed from the code: no import circle between modules, and
no import from a lower layer to a higher one (the layers are :data:`hpcgnn.LAYERS`).

Every ``import`` / ``from ... import`` of an hpcgnn module counts, at module level or inside a
function (a lazy import is still a dependency), relative ones resolved; ``importlib`` calls on
computed names (the engine registry's specs, the CLI's subcommands) are not imports here.
"""
from __future__ import annotations

import ast
from pathlib import Path

import hpcgnn

PACKAGE = Path(hpcgnn.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("hpcgnn",) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict) -> str | None:
    """The module ``name`` loads: itself, or its longest prefix that is a module of ours."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every import of an hpcgnn module in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` mod
            names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                     for a in node.names]
        else:
            continue
        for name in names:
            if name == "hpcgnn" or name.startswith("hpcgnn."):
                target = _resolve(name, modules)
                if target is not None and target != module and (node.lineno, target) not in found:
                    found.append((node.lineno, target))
    return found


def _graph() -> tuple[dict, dict]:
    """(modules, edges: module -> [(line, imported module)])."""
    modules = _modules()
    return modules, {m: _imports(m, p, modules) for m, p in modules.items()}


def _unit(module: str) -> str:
    """The name :data:`hpcgnn.LAYERS` knows a module by: its top-level package or module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer_of() -> dict[str, int]:
    return {name: i for i, layer in enumerate(hpcgnn.LAYERS) for name in layer}


def _cycles(edges: dict) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for _, child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, ()))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _cycle_path(comp: list[str], edges: dict, modules: dict) -> str:
    """One circle through the component's first module, as ``file:line -> ...`` steps."""
    inside = set(comp)
    start = comp[0]
    paths = {start: []}
    frontier = [start]
    while frontier:                       # breadth first, back to start
        nxt = []
        for m in frontier:
            for line, t in edges[m]:
                step = paths[m] + [(m, line, t)]
                if t == start:
                    return " -> ".join(f"{modules[a].relative_to(PACKAGE.parent)}:{n} imports {b}"
                                       for a, n, b in step)
                if t in inside and t not in paths:
                    paths[t] = step
                    nxt.append(t)
        frontier = nxt
    return ", ".join(comp)


def test_every_package_and_module_has_one_layer():
    """:data:`hpcgnn.LAYERS` names each top-level package and module once, and the package
    docstring (the map) names each of them."""
    names = [n for layer in hpcgnn.LAYERS for n in layer]
    assert len(names) == len(set(names)), f"named twice in hpcgnn.LAYERS: {names}"
    present = {_unit(m) for m in _modules()}
    assert present == set(names), (f"missing from hpcgnn.LAYERS: {sorted(present - set(names))}; "
                                   f"named but absent: {sorted(set(names) - present)}")
    for name in names:
        shown = f"{name}/" if (PACKAGE / name).is_dir() else f"{name}.py"
        assert shown in hpcgnn.__doc__, f"the map in hpcgnn/__init__.py does not name {shown}"


def test_no_import_cycles():
    modules, edges = _graph()
    cycles = _cycles(edges)
    assert not cycles, "import circles:\n" + "\n".join(_cycle_path(c, edges, modules) for c in cycles)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    modules, edges = _graph()
    layer = _layer_of()
    bad = []
    for m, targets in edges.items():
        for line, t in targets:
            a, b = _unit(m), _unit(t)
            if a in layer and b in layer and layer[a] < layer[b]:
                bad.append(f"{modules[m].relative_to(PACKAGE.parent)}:{line}: {m} (layer {layer[a]}, "
                           f"{a}) imports {t} (layer {layer[b]}, {b})")
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


# The checkout's packages outside hpcgnn, bottom first: a package imports hpcgnn and those
# before it, never one after it; hpcgnn imports none of them (the wheel ships hpcgnn alone).
OUTSIDE = ("benchmarks", "tools")


def _top_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, top-level package)`` of every absolute import in ``path`` (relative imports stay
    inside the file's own package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_benchmarks_and_tools_are_above_hpcgnn_and_tools_above_benchmarks():
    root = PACKAGE.parent
    order = ("hpcgnn",) + OUTSIDE
    bad = []
    for i, name in enumerate(order):
        for path in sorted((root / name).rglob("*.py")):
            for line, top in _top_imports(path):
                if top in order[i + 1:]:
                    bad.append(f"{path.relative_to(root)}:{line} ({name}) imports {top}")
    assert not bad, "imports of a package above the importer's:\n" + "\n".join(bad)
    for name in OUTSIDE:
        assert (root / name / "__init__.py").is_file(), f"{name}/ is not a package of the checkout"
