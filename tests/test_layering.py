"""Structure read from the source: the layers import only downwards, no package has an import cycle, and switches
are explicit.

``LAYERS`` is the one list of the layers, bottom first: every package and top-level module of ``src/dynemb``
(``__init__`` is the package's own ``__init__.py``, the public names). A module may import its own layer and the
layers listed before it. Every import counts: at the top of a module or inside a function (lazy), and
``importlib.import_module`` calls. A ``TYPE_CHECKING`` import counts for the order (the annotations depend on
the module it names) but not for cycles (it never runs). ``docs/architecture.md`` lists the same layers in the
same order; :func:`test_the_architecture_doc_lists_these_layers` keeps the two equal.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOC = ROOT / "docs" / "architecture.md"

LAYERS = (
    "kernels",
    "_version",
    "serialization",
    "checks",
    "table",
    "functional",
    "embedding",
    "optim",
    "distributed",
    "collection",
    "checkpoint",
    "data",
    "serving",
    "models",
    "train",
    "job",
    "endpoint",
    "demo",
    "cli",
    "__main__",
    "__init__",
)

# Imports that close a known cycle inside a package, (importer, imported), each with why it is still there. The
# cycle check leaves these edges out; empty is the goal.
KNOWN_CYCLES: set = set()  # (importer, imported) pairs of a cycle being removed, each with its reason


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in (SRC / "dynemb").rglob("*.py")}


def layer_of(name: str) -> str:
    """The layer of module ``name``: its package or top-level module under ``dynemb``; ``__init__`` for the root."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST, type_checking: bool = False):
    """Every node of ``tree`` with whether it sits under ``if TYPE_CHECKING:`` (its ``else`` runs, so it counts)."""
    yield tree, type_checking
    for field, value in ast.iter_fields(tree):
        children = value if isinstance(value, list) else [value]
        flag = type_checking or (_is_type_checking(tree) and field == "body")
        for child in children:
            if isinstance(child, ast.AST):
                yield from _walk(child, flag)


def _resolve(name: str, level: int, package: str) -> str:
    if not level:
        return name
    anchor = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(anchor + ([name] if name else []))


def _names_own_package(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Name) and node.id in ("__name__", "__package__")


def _dynamic_import(node: ast.Call, package: str, where: str) -> str | None:
    """The module an ``importlib.import_module`` call names when it is a string; None for another call, or for a
    name computed at run time, which must stay in the caller's own package (so in its layer; the cycle check cannot
    see it): relative to ``__name__`` or ``__package__`` (the anchor), or an f-string that starts with one of them.
    The test fails on a dynamic import it cannot place.
    """
    func = node.func
    if not (isinstance(func, ast.Attribute) and func.attr == "import_module"
            or isinstance(func, ast.Name) and func.id in ("import_module", "__import__")):
        return None
    target = node.args[0] if node.args else None
    anchored = len(node.args) > 1 and _names_own_package(node.args[1])
    if isinstance(target, ast.Constant) and isinstance(target.value, str):
        level = len(target.value) - len(target.value.lstrip("."))
        if not level or anchored:
            return _resolve(target.value[level:], level, package) if level else target.value
    elif isinstance(target, ast.JoinedStr) and target.values:
        first = target.values[0]
        if (isinstance(first, ast.FormattedValue) and _names_own_package(first.value)
                or anchored and isinstance(first, ast.Constant) and first.value.startswith(".")):
            return None
    elif isinstance(target, ast.Name) and anchored:
        return None  # a variable's value, relative to the caller's package (factory.STORE_TYPES: ".memory")
    raise AssertionError(f"{where}:{node.lineno}: a dynamic import the layering test cannot place; name the module "
                         f"as a string, or relative to __name__ / __package__")


def imports(name: str, *, type_checking: bool = True) -> set[str]:
    """Modules of dynemb that ``name`` imports anywhere in its source (top level, inside functions, dynamic);
    without the ``TYPE_CHECKING`` ones unless ``type_checking``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node, checking in _walk(ast.parse(path.read_text())):
        if checking and not type_checking:
            continue
        if isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, package)
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.Call) and (target := _dynamic_import(node, package, str(path))):
            found.add(target)
    return {m for m in found if m in MODULES and m != name}


def _cycle(names: list[str]) -> list[str] | None:
    graph = {n: imports(n, type_checking=False) & set(names) for n in names}
    for importer, imported in KNOWN_CYCLES:
        graph.get(importer, set()).discard(imported)
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


def _position(layer: str) -> str:
    return f"layer {LAYERS.index(layer) + 1} of {len(LAYERS)}, {layer!r}"


def test_every_package_and_module_is_a_layer():
    found = {layer_of(name) for name in MODULES}
    assert not found - set(LAYERS), f"not in LAYERS (add each where its imports allow): {sorted(found - set(LAYERS))}"
    assert not set(LAYERS) - found, f"LAYERS names what src/dynemb does not have: {sorted(set(LAYERS) - found)}"
    assert len(set(LAYERS)) == len(LAYERS)


def test_layers_import_only_themselves_and_the_layers_below():
    wrong = []
    for name in sorted(MODULES):
        here = layer_of(name)
        for target in sorted(imports(name)):
            there = layer_of(target)
            if LAYERS.index(there) > LAYERS.index(here):
                wrong.append(f"{name} ({_position(here)}) imports {target} ({_position(there)})")
    assert not wrong, "imports of a layer above:\n  " + "\n  ".join(wrong)


def test_no_package_has_an_import_cycle():
    packages: dict[str, list[str]] = {}
    for name in MODULES:
        packages.setdefault(layer_of(name), []).append(name)
    assert "table" in packages and "serving" in packages
    cycles = {layer: cycle for layer, names in packages.items() if (cycle := _cycle(sorted(names)))}
    assert not cycles, "\n".join(f"{layer}: {' -> '.join(cycle)}" for layer, cycle in sorted(cycles.items()))


def test_the_known_cycles_are_still_there():
    # An entry of KNOWN_CYCLES that no longer closes a cycle would hide the next one through the same import.
    for importer, imported in KNOWN_CYCLES:
        assert imported in imports(importer, type_checking=False), f"{importer} no longer imports {imported}"
        assert importer in imports(imported, type_checking=False), f"{imported} no longer imports {importer}"


def test_kernels_sit_below_the_table_layer():
    for name in MODULES:
        if name.startswith("dynemb.kernels"):
            assert not {m for m in imports(name) if not m.startswith("dynemb.kernels")}, name


def doc_layers(text: str) -> list[str]:
    """The layer names of the first ``text`` code block after the doc's ``## Layers`` heading: the first word of
    each line that does not start with a space (a trailing ``/`` marks a package)."""
    section = text.split("\n## Layers", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    return [line.split()[0].rstrip("/") for line in block.splitlines() if line.strip() and not line[0].isspace()]


def test_the_architecture_doc_lists_these_layers():
    assert doc_layers(DOC.read_text()) == list(LAYERS)


def test_only_the_cli_reads_the_environment():
    # launch.py sets MASTER_ADDR & co. for the worker processes it starts; it reads nothing.
    allowed = {"dynemb.cli", "dynemb.distributed.launch"}
    for name, path in MODULES.items():
        uses = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
                or isinstance(node, ast.alias) and node.name in ("environ", "getenv")]
        assert name in allowed or not uses, f"{path} touches the environment at lines {uses}"


def test_the_architecture_doc_s_group_diagram_names_every_meta_field():
    """The execution-group diagram's ``meta [G, 15]`` lists the columns the group kernels read, as the code has them."""
    from dynemb.kernels.dispatch import GROUP_META

    text = DOC.read_text()
    diagram = text[text.index("TableGroup meta ["):text.index("One grouped training step")]
    assert f"meta [G, {len(GROUP_META)}]" in diagram
    missing = [name for name in GROUP_META if not re.search(rf"\b{name}\b", diagram)]
    assert not missing, f"docs/architecture.md's group diagram lacks {missing}"
