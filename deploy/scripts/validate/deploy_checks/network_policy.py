"""Whether Kubernetes NetworkPolicies let one pod's connection in to another, over rendered manifests.

The part of the NetworkPolicy semantics kvplane's policies use (kubernetes.io, "Network Policies"),
for ingress only (the chart restricts no egress):

- a policy applies to the pods of its namespace that its `podSelector` selects (`{}`: all of them)
  when its `policyTypes` include Ingress (or, without `policyTypes`, always);
- a pod that no policy applies to accepts every connection; otherwise a connection is let in when
  a rule of an applicable policy admits it: every peer of its `from` (or any peer, without `from`)
  and every port of its `ports` (or any port, without `ports`);
- a peer with a `podSelector` alone means pods of the policy's namespace; with a `namespaceSelector`
  alone, every pod of the namespaces it selects; with both, the pods it selects in those
  namespaces. A namespace's labels here are only `kubernetes.io/metadata.name`, which Kubernetes
  sets on every namespace;
- a port is a number, or a name that the destination pod gives one of its container ports.

What this does not model (`matchExpressions`, `ipBlock`, `endPort`, protocols other than TCP)
matches nothing: a policy that relies on it is judged stricter than it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Connection:
    """A TCP connection from one pod to another."""

    source_labels: Mapping[str, str]
    source_namespace: str
    dest_labels: Mapping[str, str]
    dest_namespace: str
    port: int
    # The destination pod's container ports by name, for policies that name a port.
    dest_port_names: Mapping[str, int]


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return False
    if set(selector) - {"matchLabels"}:
        return False  # matchExpressions: not modelled
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_admits(peer: Mapping[str, Any], policy_namespace: str, conn: Connection) -> bool:
    if set(peer) - {"podSelector", "namespaceSelector"}:
        return False  # ipBlock: not modelled
    namespace_labels = {"kubernetes.io/metadata.name": conn.source_namespace}
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], namespace_labels):
            return False
    elif conn.source_namespace != policy_namespace:
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], conn.source_labels)


def _port_admits(port: Mapping[str, Any], conn: Connection) -> bool:
    if port.get("protocol", "TCP") != "TCP" or "endPort" in port:
        return False
    wanted = port.get("port")
    if wanted is None:
        return True
    if isinstance(wanted, str) and not wanted.isdigit():
        return conn.dest_port_names.get(wanted) == conn.port
    return int(wanted) == conn.port


def admitted(policies: Iterable[Mapping[str, Any]], conn: Connection) -> bool:
    """Whether the NetworkPolicies of the destination's namespace let `conn` in."""
    applicable = []
    for policy in policies:
        if policy.get("kind") != "NetworkPolicy":
            continue
        namespace = policy.get("metadata", {}).get("namespace", conn.dest_namespace)
        spec = policy.get("spec") or {}
        types = spec.get("policyTypes", ["Ingress"])
        if (
            namespace == conn.dest_namespace
            and "Ingress" in types
            and _selects(spec.get("podSelector", {}), conn.dest_labels)
        ):
            applicable.append((namespace, spec))
    if not applicable:
        return True
    for namespace, spec in applicable:
        for rule in spec.get("ingress") or []:
            peers = rule.get("from")
            ports = rule.get("ports")
            if peers and not any(_peer_admits(p, namespace, conn) for p in peers):
                continue
            if ports and not any(_port_admits(p, conn) for p in ports):
                continue
            return True
    return False
