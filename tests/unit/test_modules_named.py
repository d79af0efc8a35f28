"""Every product module is named by a test: some test imports it, `import kvplane.x.y` or
`from kvplane.x.y import ...`, to exercise it directly.

A module reached only through another (its package's re-exports, a service built around it) is
tested by accident: a change to it fails a test about something else, or none. Product code is
`services/` and `connector/` (the generated `kvplane.v1` and `bench/` are not); a package whose
`__init__` holds no code is not a module to test. What no test names yet is listed in `UNNAMED`,
each with its reason, so that a module added without a test fails here.

`python -m tests.unit.test_modules_named` prints the product modules no test names.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from tests.unit.test_layering import ROOT, modules

PRODUCT = ("kvplane.services", "kvplane.connector")

# Product modules no test names yet, each with why it stands. Remove an entry with its test.
UNNAMED: dict[str, str] = {}


def product_modules() -> dict[str, Path]:
    """Product modules by dotted name, code-less package `__init__`s left out."""
    return {
        name: path
        for name, path in modules().items()
        if name.startswith(PRODUCT) and (path.name != "__init__.py" or _has_code(path))
    }


def _has_code(path: Path) -> bool:
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return any(not (isinstance(node, ast.ImportFrom) and node.module == "__future__") for node in body)


@cache
def named_by_tests() -> frozenset[str]:
    """Every dotted name a test file imports: `a.b` for `import a.b`, `a.b` and `a.b.c` for
    `from a.b import c` (where `c` may be a module)."""
    names: set[str] = set()
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(names)


def unnamed() -> list[str]:
    return sorted(name for name in product_modules() if name not in named_by_tests())


def test_every_product_module_is_named_by_a_test() -> None:
    missing = [name for name in unnamed() if name not in UNNAMED]
    assert not missing, f"no test imports these modules; test them, or fold them into their user: {missing}"


def test_every_listed_exception_is_still_unnamed() -> None:
    """A module that got its test, or went away, leaves the list."""
    stale = sorted(set(UNNAMED) - set(unnamed()))
    assert not stale, f"named by a test now, or gone: remove from UNNAMED: {stale}"


def test_the_check_sees_the_modules_and_the_imports() -> None:
    product = product_modules()
    assert "kvplane.services.metadata.service" in product and "kvplane.connector.digests" in product
    assert "kvplane.services" not in product, "a package without code is not a module to test"
    assert not any(name.startswith(("kvplane.v1", "kvplane.bench")) for name in product)
    assert "tests.unit.test_layering" in named_by_tests()


if __name__ == "__main__":
    for name in unnamed():
        print(f"{name}\t{UNNAMED.get(name, 'NOT LISTED')}")
