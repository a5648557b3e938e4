"""One name per thing in ``src/dynemb``: no two modules share a file name and no two classes share a name.

A module is named by its file name without the folder (``__init__.py`` aside), since that is what a reader sees in
a traceback, an import line or a search; a class by its bare name, at any depth. ``KNOWN`` lists the duplicates
left in place, each with its reason; a known entry must still be a duplicate, held by exactly the files it lists,
so that it is removed once the duplicate is gone and a third holder of the name is caught.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dynemb"

# (kind, name) -> (the files that hold it, relative to src/dynemb; why it stays). Empty is the goal.
KNOWN: dict = {}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_names() -> dict[str, list[str]]:
    names = defaultdict(list)
    for path in _sources():
        if path.name != "__init__.py":
            names[path.stem].append(path.relative_to(PACKAGE).as_posix())
    return names


def _class_names() -> dict[str, list[str]]:
    names = defaultdict(list)
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names[node.name].append(path.relative_to(PACKAGE).as_posix())
    return names


def _duplicates(kind: str, names: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: sorted(paths) for name, paths in names.items() if len(paths) > 1 and (kind, name) not in KNOWN}


def test_no_two_modules_share_a_name():
    assert _duplicates("module", _module_names()) == {}


def test_no_two_classes_share_a_name():
    assert _duplicates("class", _class_names()) == {}


def test_each_known_duplicate_is_still_one():
    found = {"module": _module_names(), "class": _class_names()}
    for (kind, name), (paths, reason) in KNOWN.items():
        assert reason, f"KNOWN[{kind!r}, {name!r}] gives no reason"
        assert sorted(found[kind].get(name, [])) == sorted(paths), (
            f"the {kind} name {name!r} is no longer held by exactly {paths}: update or remove its KNOWN entry")


def test_test_modules_outside_packages_have_distinct_names():
    """pytest imports a test file of a folder without ``__init__.py`` by its bare name, so two such files of one name
    stop the whole suite's collection ("import file mismatch"), whichever folders are passed."""
    tests = Path(__file__).resolve().parent
    names = defaultdict(list)
    for path in sorted(tests.rglob("test_*.py")):
        if not (path.parent / "__init__.py").exists():
            names[path.name].append(path.relative_to(tests).as_posix())
    assert not {name: paths for name, paths in names.items() if len(paths) > 1}


def test_no_test_imports_a_conftest_by_name():
    """Every folder's ``conftest.py`` is a module named ``conftest``: in a whole-suite run ``from conftest import``
    gets whichever folder's was imported first (a fixture shares it instead)."""
    tests = Path(__file__).resolve().parent
    found = [path.relative_to(tests).as_posix() for path in sorted(tests.rglob("*.py"))
             if any(isinstance(node, (ast.Import, ast.ImportFrom)) and "conftest" in (
                 [getattr(node, "module", None)] + [a.name for a in node.names])
                    for node in ast.walk(ast.parse(path.read_text(), str(path))))]
    assert not found
