"""Structure read from the source: the storage layers import without cycles, and switches are explicit."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in (SRC / "dynemb").rglob("*.py")}


def _imports(name: str) -> set[str]:
    """Modules of dynemb that ``name`` imports anywhere in its source (top level or inside functions)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in MODULES and m != name}


def _cycle(names: list[str]) -> list[str] | None:
    graph = {n: _imports(n) & set(names) for n in names}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    return next((c for n in names if n not in state and (c := visit(n))), None)


def test_table_and_kernels_have_no_import_cycle():
    names = sorted(n for n in MODULES if n.startswith(("dynemb.table.", "dynemb.kernels.")))
    assert "dynemb.table.kv" in names and "dynemb.kernels.dispatch" in names
    assert _cycle(names) is None, " -> ".join(_cycle(names))


def test_kernels_sit_below_the_table_layer():
    for name in MODULES:
        if name.startswith("dynemb.kernels"):
            assert not {m for m in _imports(name) if not m.startswith("dynemb.kernels")}, name


def test_only_the_cli_reads_the_environment():
    # launch.py sets MASTER_ADDR & co. for the worker processes it starts; it reads nothing.
    allowed = {"dynemb.cli", "dynemb.distributed.launch"}
    for name, path in MODULES.items():
        uses = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                or isinstance(node, ast.alias) and node.name in ("environ", "getenv")]
        assert name in allowed or not uses, f"{path} touches the environment at lines {uses}"
