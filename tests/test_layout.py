"""The package layout the README's Layout section promises: no import cycle between
shardkit's modules, dependencies pointing one way (train -> library wings -> ops -> _C),
and no module far over ~400 lines. Read from the source with ``ast``, so the test sees
imports inside functions too."""

import ast
import os

import pytest

import shardkit

PKG_DIR = os.path.dirname(shardkit.__file__)
SOURCE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "shardkit")
# The layer of each top-level part of the package; a module may import only its own layer
# or lower ones. (The wings sit on one layer, and one wing may use another's public names:
# softmax's distributed mode has no business with parallel, but the train app uses all.)
LAYERS = {
    "_C": 0,
    "_build_info": 0,
    "ops": 1,
    "softmax": 2,
    "parallel": 2,
    "ema": 2,
    "transforms": 2,
    "plan": 2,
    "distributed": 3,
    "__init__": 4,
    "build": 4,
    "info": 5,
    "train": 5,
}
MAX_LINES = 420


def _modules():
    root = SOURCE_DIR if os.path.isdir(SOURCE_DIR) else PKG_DIR
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(["shardkit"] + rel)] = path
    return out


def _imports(name, path, known):
    """shardkit modules that ``name`` imports (``from shardkit.x import y`` counts as
    shardkit.x.y when that is a module, else shardkit.x)."""
    tree = ast.parse(open(path).read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t == "shardkit" or t.startswith("shardkit."))
    found.discard(name)
    return found


def _layer(module):
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return LAYERS[top]


def test_no_import_cycles():
    mods = _modules()
    graph = {m: {t for t in _imports(m, p, mods) if t in mods} for m, p in mods.items()}
    # The package __init__ files import their children; a child importing its parent
    # package only re-enters a module already initialized, so edges to a parent are fine.
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_dependencies_point_one_way():
    mods = _modules()
    wrong = []
    for m, p in mods.items():
        if m == "shardkit":
            continue
        for t in _imports(m, p, mods):
            if t in mods and not m.startswith(t + ".") and _layer(t) > _layer(m):
                wrong.append(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})")
    assert not wrong, "imports against the layer order: " + "; ".join(wrong)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_size(name):
    lines = sum(1 for _ in open(_modules()[name]))
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by what its parts are (see the README's Layout)"
