"""The package's modules import one another without a circle.

The graph has an edge A -> B for every import run when A is imported (at module level, also under `if`,
`try`, `with` or in a class body; one inside a function runs later and does not count) that names B, a module
of selective_ckpt: `import B`, `from B import name` and, when `name` is a submodule of B, B.name too. A
module's own packages are left out: importing a module runs its packages' __init__ first whatever it names.
With the deferred imports (inside functions) counted too there is no circle either: no import deferred
into a function hides one.
"""

import ast
import pathlib

import selective_ckpt

ROOT = pathlib.Path(selective_ckpt.__file__).parent
PACKAGE = "selective_ckpt"


def _modules():
    """{dotted name: (path, whether it is a package)} of every Python module under the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        out[name] = (path, is_package)
    return out


def _module_level_imports(tree):
    """The Import and ImportFrom statements run at import time: the module body, its if/try/with blocks and
    class bodies."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.ClassDef):
            pending.extend(node.body)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody"):
                pending.extend(getattr(node, field, []))
            pending.extend(s for h in getattr(node, "handlers", []) for s in h.body)


def _resolve(name, node, is_package):
    """The absolute module an ImportFrom names."""
    if not node.level:
        return node.module
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _all_imports(tree):
    """Every Import and ImportFrom statement, those inside functions and classes included."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def import_graph(deferred=False):
    """{module: set of modules of the package it imports at module level (and inside functions: `deferred`)}."""
    modules = _modules()
    graph = {}
    imports = _all_imports if deferred else _module_level_imports
    for name, (path, is_package) in modules.items():
        targets = set()
        for node in imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            source = _resolve(name, node, is_package)
            targets.add(source)
            targets.update(f"{source}.{a.name}" for a in node.names)
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {t for t in targets if t in modules and t != name and t not in ancestors}
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "selective_ckpt.models.attention" in graph["selective_ckpt.models.hf"]
    assert "selective_ckpt.models" in graph["selective_ckpt"]


def _said(found):
    return "; ".join(" <-> ".join(c) for c in found)


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, f"modules that import one another in a circle: {_said(found)}"


def test_no_circle_behind_a_deferred_import():
    found = cycles(import_graph(deferred=True))
    assert not found, f"modules in a circle once their imports inside functions count: {_said(found)}"


def test_module_level_and_deferred_imports():
    tree = ast.parse("import a\nif x:\n    from . import b\ntry:\n    import c\nexcept ImportError:\n"
                     "    import d\ndef f():\n    import e\nclass C:\n    import g\n")
    names = lambda nodes: sorted(a.name for n in nodes for a in n.names)  # noqa: E731
    assert names(_module_level_imports(tree)) == ["a", "b", "c", "d", "g"]
    assert names(_all_imports(tree)) == ["a", "b", "c", "d", "e", "g"]


def test_cycles_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
