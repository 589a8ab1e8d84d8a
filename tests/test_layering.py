"""The package's layering: every import of ``mergefs/`` goes down the stage order, with no cycle.

Walks every ``import`` and ``from ... import`` of every module with ``ast``, function-local and
``TYPE_CHECKING`` ones included: a deferred import is still an edge. The order (docs/architecture.md):

    core -> methods -> spec -> sources -> recipe -> index -> deltas -> plan -> engine -> mount
      -> ops -> api -> cli -> the package face (mergefs/__init__.py)

Inside one package, modules may import each other as long as no cycle forms. No module imports
a name with a leading underscore from another package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mergefs"
ORDER = ("core", "methods", "spec", "sources", "recipe", "index", "deltas", "plan", "engine",
         "mount", "ops", "api", "cli")


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _stage(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return len(ORDER)  # the face and ``python -m mergefs``: above everything
    return ORDER.index(parts[1])


def _target(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str) -> str:
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


#: modules that import a heavy optional dependency at their top (numba, pyfuse3): the only mergefs
#: modules another module may import inside a function, so that a command that does not need
#: them does not pay for (or need) that dependency
DEFERRED = {"mergefs.deltas._numba_decode", "mergefs.methods._numba_kernels",
            "mergefs.mount.fuse"}


def _top_level(tree: ast.Module) -> set[int]:
    """ids of the import nodes at module level (not inside a function, a class or an ``if``)."""
    return {id(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}


def edges(deferred_only: bool = False) -> list[tuple[str, str, str, int]]:
    """(importer, imported module, name or '', line) for every mergefs import in mergefs/
    (``deferred_only``: those not at module level)."""
    out = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        top = _top_level(tree)
        for node in ast.walk(tree):
            if deferred_only and id(node) in top:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "mergefs" or alias.name.startswith("mergefs."):
                        out.append((module, _known(alias.name), "", node.lineno))
            elif isinstance(node, ast.ImportFrom):
                target = _target(module, node, path.name == "__init__.py")
                if target != "mergefs" and not target.startswith("mergefs."):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in MODULES:
                        out.append((module, sub, "", node.lineno))
                    else:
                        out.append((module, _known(target), alias.name, node.lineno))
    return out


def test_every_module_belongs_to_a_stage():
    for module in MODULES:
        parts = module.split(".")
        assert len(parts) == 1 or parts[1] in (*ORDER, "__main__"), \
            f"{module}: not in a stage of {ORDER}"


def test_imports_go_down_the_stage_order():
    upward = [f"{MODULES[a].relative_to(PKG.parent)}:{line}: {a} -> {b}"
              for a, b, _, line in edges() if _stage(b) > _stage(a)]
    assert not upward, "imports that go up the stage order:\n" + "\n".join(upward)


def test_no_import_cycle():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for a, b, _, _ in edges():
        if a != b:
            graph[a].add(b)
    # a package's face imports its own modules; a module importing its own package's face
    # (``from mergefs.sources import open_source``) is an edge like any other
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_only_heavy_modules_are_imported_late():
    """A function-local (or ``TYPE_CHECKING``) import of a mergefs module defers a heavy optional
    dependency, never a cycle: only the modules in DEFERRED may be imported so."""
    late = [f"{MODULES[a].relative_to(PKG.parent)}:{line}: {b}"
            for a, b, _, line in edges(deferred_only=True) if b not in DEFERRED]
    assert not late, "imports of mergefs modules inside functions:\n" + "\n".join(late)


def test_no_private_name_crosses_a_package():
    crossing = [f"{a} imports {b}.{name}" for a, b, name, _ in edges()
                if name.startswith("_") and name != "__version__"
                and a.split(".")[:2] != b.split(".")[:2]]
    crossing += [f"{a} imports the private module {b}" for a, b, name, _ in edges()
                 if not name and b.rpartition(".")[2].startswith("_")
                 and a.split(".")[:2] != b.split(".")[:2]]
    assert not crossing, "\n".join(crossing)


@pytest.mark.parametrize("bad", [
    "from mergefs.engine.session import Session\n",  # up: core -> engine
    "def f():\n    from mergefs.cli import main\n",  # up, even when deferred
])
def test_the_walk_sees_an_upward_import(bad, tmp_path):
    """The checks above can fail: the walk finds a top-level and a function-local import."""
    tree = ast.parse(bad)
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert found and _stage(found[0].module) > _stage("mergefs.core.errors")
