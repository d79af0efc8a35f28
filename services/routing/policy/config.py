"""A routing policy file: which plugins run for each leg, with what weights and parameters.

YAML (or an equivalent mapping)::

    decode:
      filters: [live, role, same-model, not-draining, same-fingerprint]
      scorers:
        - {name: holder-affinity, weight: 4, params: {reserve_tokens: 1024}}
        - {name: free-kv, weight: 1}
      picker: max-score
    prefill:
      filters: [...]
      scorers: [...]
    pull: {threshold_tokens: 64, expiry_margin_ms: 5000, max_transfer_fraction: 0.5}
    prefill_on_decode: {max_new_tokens: 1000}
    cost_model: {prefill_fixed_ms: 101.6, recompute_ms_per_token: 0.0282}

A plugin entry is its name, or a mapping with `name`, optional `weight`
(scorers only, default 1) and `params`. `default_policy.yaml` beside this
file is the policy used when none is configured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvplane.services.routing.policy import filters as _filters  # noqa: F401  (registers)
from kvplane.services.routing.policy import picker as _picker  # noqa: F401  (registers)
from kvplane.services.routing.policy import scorers as _scorers  # noqa: F401  (registers)
from kvplane.services.routing.policy import turn_cost as _turn_cost  # noqa: F401  (registers)
from kvplane.services.routing.policy.cost_model import CostModel
from kvplane.services.routing.policy.decode_prefill import PrefillOnDecodeSettings
from kvplane.services.routing.policy.pull_decision import PullSettings
from kvplane.services.routing.policy.registry import (
    FILTERS,
    PICKERS,
    SCORERS,
    Filter,
    Picker,
    PolicyConfigError,
    Scorer,
    build,
)

DEFAULT_POLICY_FILE = "default_policy.yaml"
# What the cost model learns, not what a policy sets.
_LEARNED = frozenset(
    {"prefill_fit", "prefill_samples", "transfer_fit", "transfer_samples", "handshake_samples"}
)


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class LegPolicy:
    """The plugins that choose the node for one leg."""

    filters: tuple[Filter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    decode: LegPolicy
    prefill: LegPolicy
    pull: PullSettings
    cost_model: CostModel
    prefill_on_decode: PrefillOnDecodeSettings = field(default_factory=PrefillOnDecodeSettings)


def _entry(raw: Any, kind: str) -> tuple[str, float, Mapping[str, Any]]:
    if isinstance(raw, str):
        return raw, 1.0, {}
    if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
        raise PolicyConfigError(f"a {kind} entry must be a name or a mapping with 'name'")
    unknown = set(raw) - {"name", "weight", "params"}
    if unknown:
        raise PolicyConfigError(f"{kind} {raw['name']!r}: unknown key(s) {', '.join(sorted(unknown))}")
    weight = raw.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
        raise PolicyConfigError(f"{kind} {raw['name']!r}: weight must be a non-negative number")
    params = raw.get("params") or {}
    if not isinstance(params, Mapping):
        raise PolicyConfigError(f"{kind} {raw['name']!r}: params must be a mapping")
    return raw["name"], float(weight), params


def _leg(raw: Any, leg: str) -> LegPolicy:
    if not isinstance(raw, Mapping):
        raise PolicyConfigError(f"'{leg}' must be a mapping with filters, scorers and picker")
    unknown = set(raw) - {"filters", "scorers", "picker"}
    if unknown:
        raise PolicyConfigError(f"'{leg}': unknown key(s) {', '.join(sorted(unknown))}")
    built_filters = []
    for item in raw.get("filters") or []:
        name, _, params = _entry(item, "filter")
        built_filters.append(build(FILTERS, "filter", name, params))
    built_scorers = []
    for item in raw.get("scorers") or []:
        name, weight, params = _entry(item, "scorer")
        built_scorers.append(WeightedScorer(build(SCORERS, "scorer", name, params), weight))
    picker_name, _, picker_params = _entry(raw.get("picker", "max-score"), "picker")
    return LegPolicy(
        tuple(built_filters), tuple(built_scorers), build(PICKERS, "picker", picker_name, picker_params)
    )


def _values(cls: type[Any], raw: Any, section: str, learned: frozenset[str] = frozenset()) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise PolicyConfigError(f"'{section}' must be a mapping")
    allowed = {f.name for f in fields(cls)} - learned
    unknown = set(raw) - allowed
    if unknown:
        raise PolicyConfigError(f"'{section}': unknown key(s) {', '.join(sorted(unknown))}")
    try:
        return cls(**raw)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"'{section}': {exc}") from None


def policy_from_mapping(raw: Mapping[str, Any]) -> PolicyConfig:
    if not isinstance(raw, Mapping):
        raise PolicyConfigError("a policy must be a mapping")
    unknown = set(raw) - {"decode", "prefill", "pull", "cost_model", "prefill_on_decode"}
    if unknown:
        raise PolicyConfigError(f"unknown section(s) {', '.join(sorted(unknown))}")
    for leg in ("decode", "prefill"):
        if leg not in raw:
            raise PolicyConfigError(f"missing section '{leg}'")
    return PolicyConfig(
        decode=_leg(raw["decode"], "decode"),
        prefill=_leg(raw["prefill"], "prefill"),
        pull=_values(PullSettings, raw.get("pull"), "pull"),
        cost_model=_values(CostModel, raw.get("cost_model"), "cost_model", _LEARNED),
        prefill_on_decode=_values(PrefillOnDecodeSettings, raw.get("prefill_on_decode"), "prefill_on_decode"),
    )


def policy_from_yaml(text: str) -> PolicyConfig:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyConfigError(f"policy is not valid YAML: {exc}") from None
    return policy_from_mapping(raw)


def load_policy(path: str | Path | None = None) -> PolicyConfig:
    """The policy in `path`, or the packaged default when `path` is empty."""
    if path:
        return policy_from_yaml(Path(path).read_text(encoding="utf-8"))
    text = resources.files(__package__).joinpath(DEFAULT_POLICY_FILE).read_text(encoding="utf-8")
    return policy_from_yaml(text)
