"""The roles stand on the shared floor and never on each other: ``web``, ``coordinator`` and
``workers`` import ``residency`` (and outside libraries), never one another, so a role can be
deployed, restarted and reasoned about alone. Only ``workers/runtime.py`` and the pieces the
model process loads beside it import llama.cpp; web never does."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("web", "coordinator", "workers")


def imports(path: Path) -> set[str]:
    """The top-level packages ``path`` imports (relative imports are its own package)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("role", ROLES)
def test_a_role_never_imports_another(role: str) -> None:
    others = set(ROLES) - {role}
    crossing = {
        str(p.relative_to(ROOT)): sorted(imports(p) & others)
        for p in modules(role)
        if imports(p) & others
    }
    assert crossing == {}


#: The entry points that start the roles (``residency up``, ``residency web``…): launchers, not
#: pieces any role runs.
LAUNCHERS = {"residency/cli.py", "residency/web_role.py"}


def test_the_shared_floor_imports_no_role() -> None:
    crossing = {
        str(p.relative_to(ROOT)): sorted(imports(p) & set(ROLES))
        for p in modules("residency")
        if imports(p) & set(ROLES) and str(p.relative_to(ROOT)) not in LAUNCHERS
    }
    assert crossing == {}


def test_web_never_imports_llama_cpp() -> None:
    assert [str(p) for p in modules("web") if "llama_cpp" in imports(p)] == []
