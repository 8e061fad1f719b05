"""The import graph against docs/design.md's layer table: no circle, and no import from a lower layer into a higher one."""
from __future__ import annotations

import ast
import os
import re

import pytest

from project import ROOT, folders, modules

TABLE = os.path.join(ROOT, "docs", "design.md")


def layer_table(text: str) -> dict[str, int]:
    """{unit: layer} from the '## Layers' table: a unit is a folder ('core') or a root module ('model')."""
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    table = {}
    for row in re.findall(r"^\|\s*(\d+)\s*\|([^|]*)\|", section, re.M):
        for name in re.findall(r"`([\w.]+/?)`", row[1]):
            table[name.rstrip("/").removesuffix(".py")] = int(row[0])
    return table


def unit(module: str) -> str:
    """The layer unit of a dotted module name: its folder, or the root module itself."""
    return module.split(".")[0]


def project_imports(path: str, module: str, known: set[str]) -> list[tuple[str, int, bool]]:
    """[(imported project module, line, at module level)] of one file; 'from pkg import mod' counts as pkg.mod."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    top = {id(n) for n in tree.body} | {id(n) for s in tree.body if isinstance(s, ast.If) for n in s.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        found += [(n, node.lineno, id(node) in top) for n in names if n in known]
    return found


def violations(graph: dict[str, list[tuple[str, int, bool]]], layers: dict[str, int], paths: dict[str, str]
               ) -> list[str]:
    """Every import that goes up a layer, sits inside a function, or names a unit missing from the table."""
    found = []
    for mod, imports in graph.items():
        if unit(mod) not in layers:
            found.append(f"{paths[mod]}: '{unit(mod)}' is not in docs/design.md's layer table")
            continue
        for target, line, at_top in imports:
            if unit(target) not in layers:
                continue  # reported as its own module
            if layers[unit(target)] > layers[unit(mod)]:
                found.append(f"{paths[mod]}:{line} imports {target} (layer {layers[unit(target)]}) from layer "
                             f"{layers[unit(mod)]}")
            if not at_top:
                found.append(f"{paths[mod]}:{line} imports {target} inside a function")
    return found


def circles(graph: dict[str, list[tuple[str, int, bool]]]) -> list[list[str]]:
    """The import circles among modules (each as the path of modules that closes it)."""
    found, state = [], {}

    def visit(mod: str, stack: list[str]) -> None:
        state[mod] = "open"
        for target, _, _ in graph.get(mod, []):
            if target == mod or target.startswith(mod + ".") or mod.startswith(target + "."):
                continue  # a package and its own modules
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target] if target in stack else [mod, target])
            elif target not in state:
                visit(target, stack + [target])
        state[mod] = "done"

    for mod in graph:
        if mod not in state:
            visit(mod, [mod])
    return found


@pytest.fixture(scope="module")
def graph():
    paths = modules()
    return {m: project_imports(p, m, set(paths)) for m, p in paths.items()}, paths


def test_every_folder_and_root_module_has_a_layer(graph):
    layers = layer_table(open(TABLE).read())
    units = {unit(m) for m in graph[0]}
    assert units == set(layers), f"not in the table: {units - set(layers)}; in the table only: {set(layers) - units}"
    assert set(folders()) <= units


def test_imports_go_down_the_layers(graph):
    assert violations(*graph[:1], layer_table(open(TABLE).read()), graph[1]) == []


def test_there_is_no_import_circle(graph):
    assert circles(graph[0]) == []


def test_every_folder_opens_with_its_one_idea_and_what_it_may_import():
    for d in folders():
        doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, d, "__init__.py")).read()))
        assert doc and "Layer" in doc, f"{d}/__init__.py: a docstring with the folder's idea and its layer"


def test_the_checks_catch_an_upward_import_a_circle_and_a_function_level_import():
    """The rules themselves fail on the bugs they are for (a made-up graph)."""
    layers = {"core": 0, "nn": 1, "training": 2}
    g = {"core.errors": [("training.loop", 3, True)], "nn.loss": [("core.errors", 1, False)],
         "training.loop": [("core.errors", 1, True)]}
    found = violations(g, layers, {m: m for m in g})
    assert any("imports training.loop (layer 2) from layer 0" in v for v in found)
    assert any("inside a function" in v for v in found)
    assert circles(g) and circles({"a": [("b", 1, True)], "b": [("a", 1, True)]})
    assert not circles({"a": [("b", 1, True)], "b": []})


def test_no_module_exceeds_about_400_non_blank_lines():
    long = {p: n for p in modules().values()
            for n in [sum(1 for line in open(os.path.join(ROOT, p)) if line.strip())] if n > 400}
    assert not long, f"split these into modules of one idea each: {long}"
