"""Istio's AuthorizationPolicy decision for one request, over rendered manifests.

The part of Istio's semantics kvplane's policies use (istio.io, "Authorization Policy"):

- a policy applies to the workloads its `selector.matchLabels` selects, or to every workload of
  its namespace without one;
- DENY first: a request matching any rule of an applicable DENY policy is refused;
- then ALLOW: with no applicable ALLOW policy the request is allowed; with some, it is allowed
  only if it matches a rule of one of them. A policy with an empty spec applies to the whole
  namespace and has no rule, so it matches nothing: the namespace's default deny;
- a rule matches when every one of its parts does (`from`, `to`, `when`); each part matches when
  any of its entries does; inside an entry, every field given must match; a field's list matches
  when any value does. Strings match exactly, by prefix (`abc*`), by suffix (`*abc`) or any (`*`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Request:
    """A request as the destination's proxy sees it."""

    principal: str  # the caller's mesh identity (SPIFFE without the scheme)
    namespace: str  # the caller's namespace
    workload_labels: Mapping[str, str]  # the destination pod's labels
    port: int
    path: str
    method: str = "POST"
    headers: Mapping[str, str] = field(default_factory=dict)
    # The caller pod's labels: Istio decides on the principal; the NetworkPolicies on these.
    source_labels: Mapping[str, str] = field(default_factory=dict)


def _string_match(pattern: str, value: str) -> bool:
    if pattern == "*":
        return True
    if pattern.endswith("*"):
        return value.startswith(pattern[:-1])
    if pattern.startswith("*"):
        return value.endswith(pattern[1:])
    return pattern == value


def _any(patterns: Iterable[Any], value: str) -> bool:
    return any(_string_match(str(p), value) for p in patterns)


def _field(entry: Mapping[str, Any], positive: str, negative: str, value: str) -> bool:
    """A field and its `not` form: the value must match one of the first and none of the second."""
    if positive in entry and not _any(entry[positive], value):
        return False
    return not (negative in entry and _any(entry[negative], value))


def _source_matches(source: Mapping[str, Any], request: Request) -> bool:
    return _field(source, "principals", "notPrincipals", request.principal) and _field(
        source, "namespaces", "notNamespaces", request.namespace
    )


def _operation_matches(op: Mapping[str, Any], request: Request) -> bool:
    return (
        _field(op, "ports", "notPorts", str(request.port))
        and _field(op, "paths", "notPaths", request.path)
        and _field(op, "methods", "notMethods", request.method)
    )


def _condition_matches(cond: Mapping[str, Any], request: Request) -> bool:
    header = re.fullmatch(r"request\.headers\[(.+)\]", cond["key"])
    if header is None:
        return False  # a condition this evaluator does not model matches nothing: stricter
    value = request.headers.get(header.group(1).lower())
    if value is None:
        return "notValues" in cond and "values" not in cond
    return _field(cond, "values", "notValues", value)


def rule_matches(rule: Mapping[str, Any], request: Request) -> bool:
    sources = rule.get("from")
    if sources and not any(_source_matches(s.get("source", {}), request) for s in sources):
        return False
    operations = rule.get("to")
    if operations and not any(_operation_matches(o.get("operation", {}), request) for o in operations):
        return False
    return all(_condition_matches(c, request) for c in rule.get("when", []))


def _applies(policy: Mapping[str, Any], request: Request) -> bool:
    selector = (policy.get("spec") or {}).get("selector", {}).get("matchLabels")
    return selector is None or all(request.workload_labels.get(k) == v for k, v in selector.items())


def allowed(policies: Iterable[Mapping[str, Any]], request: Request) -> bool:
    """Whether Istio lets `request` through, given every AuthorizationPolicy of its namespace."""
    applicable = [p for p in policies if p.get("kind") == "AuthorizationPolicy" and _applies(p, request)]
    for policy in applicable:
        spec = policy.get("spec") or {}
        if spec.get("action") == "DENY" and any(rule_matches(r, request) for r in spec.get("rules", [])):
            return False
    allow = [p for p in applicable if (p.get("spec") or {}).get("action", "ALLOW") == "ALLOW"]
    if not allow:
        return True
    return any(rule_matches(r, request) for p in allow for r in (p.get("spec") or {}).get("rules", []))
