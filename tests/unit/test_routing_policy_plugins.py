"""The filter and scorer packages: importing each registers every plugin in its folder, by name."""

from __future__ import annotations

import pkgutil
from types import ModuleType

import pytest

from kvplane.services.routing.policy import filters, scorers
from kvplane.services.routing.policy.registry import FILTERS, SCORERS


def _folder_modules(package: ModuleType) -> set[str]:
    return {m.name for m in pkgutil.iter_modules(package.__path__)}


@pytest.mark.parametrize(
    ("package", "table"), [(filters, FILTERS), (scorers, SCORERS)], ids=["filters", "scorers"]
)
def test_every_plugin_file_in_the_folder_is_imported_and_registered(
    package: ModuleType, table: dict[str, type]
) -> None:
    assert set(package.__all__) == _folder_modules(package), (
        "a plugin file the package does not import is never registered"
    )
    registered_from = {cls.__module__.rsplit(".", 1)[1] for cls in table.values()}
    assert registered_from >= set(package.__all__), "each plugin file registers a plugin"


@pytest.mark.parametrize(
    ("package", "table"), [(filters, FILTERS), (scorers, SCORERS)], ids=["filters", "scorers"]
)
def test_each_plugin_is_registered_under_its_own_name(package: ModuleType, table: dict[str, type]) -> None:
    for name, cls in table.items():
        if cls.__module__.startswith(package.__name__):
            assert cls.name == name


def test_filters_are_marked_hard_or_soft_and_the_hard_ones_are_correctness_constraints() -> None:
    mine = {n: c for n, c in FILTERS.items() if c.__module__.startswith(filters.__name__)}
    assert all(isinstance(c.hard, bool) for c in mine.values())
    # Role, model and fingerprint decide whether a node can serve the turn at all; liveness and
    # draining are preferences that give way before a turn fails.
    assert {n for n, c in mine.items() if c.hard} == {
        c.name for c in mine.values() if c.__module__.rsplit(".", 1)[1] in {"role", "model", "fingerprint"}
    }
