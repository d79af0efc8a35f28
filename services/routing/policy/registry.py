"""Plugin kinds and the registry that composes them by name.

A plugin is a frozen dataclass whose fields are its parameters, registered
under the name a policy file uses for it. Filters drop nodes, scorers rate
them in [0, 1], and a picker ranks them from the weighted sum of scores.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from kvplane.services.routing.policy.snapshot import LegContext, NodeState


class PolicyConfigError(ValueError):
    """A policy file names an unknown plugin or gives it bad parameters."""


class Filter(Protocol):
    name: ClassVar[str]
    # Hard filters are correctness constraints and always apply; soft ones are
    # dropped when they would leave no node for a leg.
    hard: ClassVar[bool]

    def keep(self, state: NodeState, ctx: LegContext) -> bool: ...


class Scorer(Protocol):
    name: ClassVar[str]

    def score(self, state: NodeState, ctx: LegContext) -> float: ...


class Picker(Protocol):
    name: ClassVar[str]

    def rank(self, scored: Sequence[tuple[NodeState, float]], ctx: LegContext) -> list[NodeState]: ...


FILTERS: dict[str, type[Any]] = {}
SCORERS: dict[str, type[Any]] = {}
PICKERS: dict[str, type[Any]] = {}

_T = TypeVar("_T")


def _register(table: dict[str, type[Any]]) -> Callable[[type[_T]], type[_T]]:
    def add(cls: type[_T]) -> type[_T]:
        name = cls.name  # type: ignore[attr-defined]
        if name in table:
            raise RuntimeError(f"plugin {name!r} registered twice")
        table[name] = cls
        return cls

    return add


register_filter = _register(FILTERS)
register_scorer = _register(SCORERS)
register_picker = _register(PICKERS)


def build(table: Mapping[str, type[Any]], kind: str, name: str, params: Mapping[str, Any]) -> Any:
    """An instance of the plugin `name` with `params`, or PolicyConfigError."""
    cls = table.get(name)
    if cls is None:
        raise PolicyConfigError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}")
    allowed = {f.name for f in fields(cls)} if is_dataclass(cls) else set()
    unknown = set(params) - allowed
    if unknown:
        raise PolicyConfigError(f"{kind} {name!r} takes no parameter(s) {', '.join(sorted(unknown))}")
    try:
        return cls(**params)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"{kind} {name!r}: {exc}") from None
