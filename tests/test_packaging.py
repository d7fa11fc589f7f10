"""pyproject.toml: the base install leaves out the extras' heavy packages, each extra
brings what `prfaas.cli.extras` checks for, and every third-party import is declared."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from prfaas.cli.extras import EXTRAS

HEAVY = {"torch", "transformers", "matplotlib"}


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (PEP 503)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match is not None, requirement
    return re.sub(r"[-_.]+", "-", match.group()).lower()


@pytest.fixture(scope="module")
def project(repo_root: Path) -> dict[str, Any]:
    with (repo_root / "pyproject.toml").open("rb") as f:
        table: dict[str, Any] = tomllib.load(f)["project"]
    return table


def test_base_dependencies_leave_out_torch_transformers_matplotlib(
    project: dict[str, Any],
) -> None:
    """A gateway node's plain `pip install prfaas` pulls none of the heavy packages."""
    base = {_name(r) for r in project["dependencies"]}
    assert not base & HEAVY
    assert {"aiohttp", "numpy", "pyzmq"} <= base


def test_each_extra_declares_the_modules_the_commands_check(project: dict[str, Any]) -> None:
    """`require_extra(name)` and pyproject's `[project.optional-dependencies]` agree."""
    extras = project["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        assert set(modules) <= {_name(r) for r in extras[extra]}, extra
    declared = {_name(r) for name in EXTRAS for r in extras[name]}
    assert declared >= HEAVY


def _top_level_imports(root: Path) -> dict[str, Path]:
    """Top-level module name -> one file importing it, for every absolute import."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.partition(".")[0], path)
    return found


def test_every_third_party_import_is_declared(repo_root: Path, project: dict[str, Any]) -> None:
    """Each module `prfaas/` imports is the stdlib, prfaas itself, or comes from a
    distribution listed in the base dependencies or an extra (not only transitively)."""
    declared = {_name(r) for r in project["dependencies"]}
    for requirements in project["optional-dependencies"].values():
        declared |= {_name(r) for r in requirements}
    providers = importlib.metadata.packages_distributions()
    undeclared = {}
    for module, path in _top_level_imports(repo_root / "prfaas").items():
        if module in sys.stdlib_module_names or module in ("prfaas", "__future__"):
            continue
        dists = {_name(d) for d in providers.get(module, [module])}
        if not dists & declared:
            undeclared[module] = str(path.relative_to(repo_root))
    assert undeclared == {}


def test_every_base_dependency_is_imported(repo_root: Path, project: dict[str, Any]) -> None:
    """No base dependency is dead weight: `prfaas/` imports a module of each."""
    imported = set(_top_level_imports(repo_root / "prfaas"))
    providers = importlib.metadata.packages_distributions()
    used = {_name(d) for module in imported for d in providers.get(module, [])}
    assert {_name(r) for r in project["dependencies"]} - used == set()
