"""The package reads floor by floor: no import circles, no import running back up.

Floors, lowest first (``docs/patterns.md``, "Module map"): ``_compat`` / ``config`` / ``report`` / ``spec``
(shared by all), ``reference``, ``kernels`` and ``patterns``, ``ops``, ``backend``,
``explain`` / ``export`` / ``testing`` (test corpora and the spelling grammar), the package's ``__init__``. A module may import its own floor or lower
ones. Read from the sources (``ast``), so a circle hidden behind an import at the bottom of a file
or inside a function is caught too, and nothing is imported to check it.
"""
import ast
import pathlib

import hstu_inductor

ROOT = pathlib.Path(hstu_inductor.__file__).resolve().parent
PKG = ROOT.name

FLOORS = {"_compat": 0, "config": 0, "report": 0, "spec": 0, "reference": 1, "kernels": 2, "patterns": 2, "ops": 3,
          "backend": 5, "cost_rule": 5, "graph_breaks": 5, "explain": 6, "export": 6, "testing": 6, "": 7}


def _modules() -> dict:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = [PKG, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set:
    """The package's modules that ``name`` imports anywhere in its source (top level or not)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names}
            out |= subs & modules.keys()
            if subs - modules.keys() and target in modules:  # names defined by the module / package itself
                out.add(target)
    out.discard(name)
    return out


def _graph() -> dict:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _floor(name: str) -> int:
    parts = name.split(".")
    return FLOORS[parts[1] if len(parts) > 1 else ""]


def _cycle(graph: dict):
    """One import circle of ``graph`` as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_floors_are_known():
    assert {_floor(m) for m in _graph()} <= set(FLOORS.values())  # a new top-level module needs a floor


def test_no_import_circles():
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_upward_imports():
    upward = sorted(f"{m} -> {n}" for m, deps in _graph().items() for n in deps if _floor(n) > _floor(m))
    assert not upward, "imports running up the floors:\n" + "\n".join(upward)


def test_the_checks_can_fail():
    """The two checks on made-up graphs: a circle, and patterns importing ops."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _floor(f"{PKG}.patterns.attention") < _floor(f"{PKG}.ops.attention")
