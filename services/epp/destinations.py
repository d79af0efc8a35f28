"""Where a routed turn goes through Envoy: D's sidecar, and whether Envoy's subset hint allows it.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any
from urllib.parse import urlsplit

# GIE's names: the header and the `envoy.lb` metadata key of the destination, and the metadata
# namespace and key of the candidates Envoy allows (the subset hint).
DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# A sidecar's answer that Envoy may send to another decode pod: its decode engine could not be
# reached and nothing was sent (`failover.after_decode_failure`). Envoy's retry policy names it
# (`retriable_headers`), and counts the attempts in ATTEMPT_HEADER
# (`include_request_attempt_count`).
RETRY_ELSEWHERE = "x-kvplane-retry-elsewhere"
ATTEMPT_HEADER = "x-envoy-attempt-count"


def sidecar_address(decode_url: str, sidecar_port: int, sidecars: Mapping[str, str]) -> str:
    """`host:port` of the sidecar beside the decode engine at `decode_url`."""
    named = sidecars.get(decode_url) or sidecars.get(decode_url.rstrip("/"))
    if named:
        return named
    host = urlsplit(decode_url).hostname or ""
    return f"[{host}]:{sidecar_port}" if ":" in host else f"{host}:{sidecar_port}"


def subset_hint(filter_metadata: Mapping[str, Any]) -> frozenset[str] | None:
    """The endpoints Envoy allows for this request (`host:port` each); None when it sets no hint."""
    hint = filter_metadata.get(SUBSET_NAMESPACE)
    if not isinstance(hint, Mapping):
        return None
    listed = hint.get(SUBSET_KEY)
    if isinstance(listed, str):
        return frozenset(part.strip() for part in listed.split(",") if part.strip())
    if isinstance(listed, list | tuple):
        return frozenset(str(item) for item in listed)
    return None


def allowed(destination: str, subset: Collection[str] | None) -> bool:
    return subset is None or destination in subset
