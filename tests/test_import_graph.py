"""pdtrace's import graph: no circle among its modules, none excepted, counting imports at every level (inside
functions too; `if TYPE_CHECKING:` blocks excepted: they never run). docs/architecture.md says which layer may
import which."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pdtrace"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, set[str]]:
    """module -> the pdtrace modules it imports (a package import counts as its __init__)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        pending: list[ast.AST] = [ast.parse(path.read_text())]
        while pending:
            node = pending.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    pending.extend(child.orelse)
                elif isinstance(child, ast.Import):
                    deps.update(alias.name for alias in child.names)
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        parts = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                        base = ".".join(parts + ([base] if base else []))
                    for alias in child.names:
                        full = f"{base}.{alias.name}"
                        deps.add(full if full in modules else base)
                else:
                    pending.append(child)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_import_circle_in_pdtrace():
    found = circles(import_graph())
    assert found == [], "import circle(s): " + "; ".join(sorted(str(sorted(c)) for c in found))


def test_the_recording_modules_import_no_session_and_no_recorder_below_them():
    """The recorder's split (issue 35): the writer process and the conversion import neither the session nor the
    recorder; the process hooks import no recorder."""
    graph = import_graph()
    rec = "pdtrace.recording."
    assert not graph[rec + "writer_process"] & {rec + "session", rec + "recorder", rec + "flight"}
    assert not graph[rec + "conversion"] & {rec + "session", rec + "recorder", rec + "writer_process",
                                            rec + "process_hooks"}
    assert not graph[rec + "process_hooks"] & {rec + "session", rec + "recorder", rec + "flight"}


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]
    assert circles({"a": {"b"}, "b": set()}) == []


#: Files whose inner imports may go without a reason for now, each with why. The test fails when one of them has
#: none left (so the entry is removed), as KNOWN does for circles.
UNEXPLAINED_ALLOWED: dict[str, str] = {}


def unexplained_inner_imports(source: str) -> list[int]:
    """The lines of the imports inside functions of `source` that give no reason: no comment on the import's
    first or last line, nor a comment line right above it."""
    lines = source.splitlines()
    found = set()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                first, last = lines[node.lineno - 1], lines[(node.end_lineno or node.lineno) - 1]
                above = lines[node.lineno - 2] if node.lineno >= 2 else ""
                if "#" not in first and "#" not in last and not above.strip().startswith("#"):
                    found.add(node.lineno)
    return sorted(found)


def test_every_import_inside_a_function_says_why():
    missing, clean_allowed = [], []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        lines = unexplained_inner_imports(path.read_text())
        if rel in UNEXPLAINED_ALLOWED:
            if not lines:
                clean_allowed.append(rel)
            continue
        missing += [f"pdtrace/{rel}:{line}" for line in lines]
    assert not missing, ("imports inside functions without a reason (a comment on the line or the line above; "
                         "or move them to the top): " + ", ".join(missing))
    assert not clean_allowed, f"every inner import of {clean_allowed} says why now: remove from UNEXPLAINED_ALLOWED"


def test_the_reason_check_flags_an_import_without_one():
    source = '''
import os


def bare():
    import json
    return json


def trailing():
    import json  # lazy: a reason
    return json


def above():
    # lazy: a reason
    from json import (dumps,
                      loads)
    return dumps, loads


def on_the_last_line():
    from json import (dumps,
                      loads)  # lazy: a reason
    return dumps, loads


async def bare_async():
    import json
    from os import path
    return json, path


class Holder:
    def method(self):
        import json
        return json
'''
    assert unexplained_inner_imports(source) == [6, 29, 30, 36]
