"""The project's own modules, found on disk: the root's .py files and those of its subsystem folders."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_PRODUCT = {"tests", "benchmarks", "scripts", "configs", "docs"}
"""Folders beside the product's code: they may import anything of it."""


def folders() -> list[str]:
    """The subsystem folders: the root's directories that are Python packages."""
    return sorted(d for d in os.listdir(ROOT) if d not in NOT_PRODUCT
                  and os.path.isfile(os.path.join(ROOT, d, "__init__.py")))


def modules() -> dict[str, str]:
    """{dotted module name: path relative to the root} for every module of the product (no tests, benchmarks)."""
    found = {f[:-3]: f for f in os.listdir(ROOT) if f.endswith(".py")}
    for d in folders():
        for f in os.listdir(os.path.join(ROOT, d)):
            if f.endswith(".py"):
                name = d if f == "__init__.py" else f"{d}.{f[:-3]}"
                found[name] = f"{d}/{f}"
    return dict(sorted(found.items()))
