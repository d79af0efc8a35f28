"""The route the endpoint picker hands a decode-side sidecar, signed so that no client can forge it.

The picker chooses P and D and names the blocks P is to pull (`kv_transfer_params`); the sidecar
beside D runs the legs. What the sidecar is told travels in one request header, `x-kvplane-route`:
a JSON object and its HMAC-SHA256 under a key the picker and the sidecars share
(`sidecar.route_key`). Why a signed header, and not the body or a bare header:

- An engine trusts whatever `kv_transfer_params` it is given, so those params must come from
  kvplane's router and from nobody else. Envoy sets the picker's headers over any the client sent,
  but when the picker is down and the gateway fails open, Envoy forwards the client's own request
  untouched: only a signature lets the sidecar tell the picker's route from a client's.
- The signature covers the SHA-256 of the body the sidecar receives and an expiry, so that a route
  seen once (in a log) cannot be replayed with another body, or later.
- A header leaves the body as the picker sends it on (no second encoding of a 1 MiB prompt), and
  the sidecar checks it before reading anything else.

A request without a valid route is served by D alone, as a recompute, with every
`kv_transfer_params` the client sent removed (`sidecar/app.py`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from kvplane.services.client import Endpoint, RouteResult
from kvplane.v1 import routing_pb2

ROUTE_HEADER = "x-kvplane-route"
# llm-d's P/D header: the prefill engine's host:port, set by the picker.
PREFILLER_HEADER = "x-prefiller-host-port"
# The sidecar's account of the P leg, in its response to the picker (who removes it).
PREFILL_REPORT_HEADER = "x-kvplane-prefill"


def host_port(url: str) -> str:
    """An engine URL's `host:port` as llm-d's `x-prefiller-host-port` spells it."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class BadRoute(Exception):
    """The route header is malformed, forged, expired, or for another body."""


@dataclass(frozen=True, slots=True)
class SignedRoute:
    route: RouteResult
    # Ask D for token ids (the picker's report needs them: `decode_events.DigestingEngines`).
    return_token_ids: bool
    # Where the sidecar reports D's answer (`answer_report.py`), and under which id; "" when the
    # picker reads D's answer from Envoy's response phase itself.
    answer_to: str = ""
    answer_id: str = ""
    # The client asked for token ids (they stay in what it sees); the report needs the output's
    # ids (D's handle may lack digests).
    keep_ids: bool = False
    collect_ids: bool = True
    # The picker holds the prompt's token ids already: the report leaves D's out.
    prompt_known: bool = False


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _endpoint(e: Endpoint) -> list[str]:
    return [e.node_id, e.http_url, e.incarnation]


def sign(
    key: bytes,
    route: RouteResult,
    *,
    body: bytes,
    return_token_ids: bool,
    expires_at: float,
    answer_to: str = "",
    answer_id: str = "",
    keep_ids: bool = False,
    collect_ids: bool = True,
    prompt_known: bool = False,
) -> str:
    """The header value for `route`, valid for `body` until `expires_at` (Unix time, s)."""
    if not key:
        raise ValueError("an empty key signs nothing a client could not sign too")
    payload = orjson.dumps(
        {
            "id": route.route_id,
            "decision": route.decision,
            "p": _endpoint(route.prefill),
            "d": _endpoint(route.decode),
            "params": route.prefill_params,
            "skip": route.skip_decode_retention,
            "ids": return_token_ids,
            "answer": [answer_to, answer_id],
            "keep": keep_ids,
            "collect": collect_ids,
            "known": prompt_known,
            "exp": expires_at,
            "body": hashlib.sha256(body).hexdigest(),
        }
    )
    mac = hmac.new(key, payload, hashlib.sha256).digest()
    return f"{_b64(payload)}.{_b64(mac)}"


def verify(key: bytes, value: str, *, body: bytes, now: float) -> SignedRoute:
    """The route in a header value; raises BadRoute unless it is the picker's, for `body`, unexpired.

    No key verifies nothing: an HMAC under an empty key is one anybody can make."""
    if not key:
        raise BadRoute("no route key is configured (sidecar.route_key)")
    encoded, _, mac = value.partition(".")
    try:
        payload, given = _unb64(encoded), _unb64(mac)
    except ValueError:
        raise BadRoute("the route header is not base64") from None
    if not hmac.compare_digest(hmac.new(key, payload, hashlib.sha256).digest(), given):
        raise BadRoute("the route header's signature does not verify")
    fields: Any = orjson.loads(payload)
    if fields["exp"] < now:
        raise BadRoute("the route header has expired")
    if not hmac.compare_digest(fields["body"], hashlib.sha256(body).hexdigest()):
        raise BadRoute("the route header was signed for another body")
    route = RouteResult(
        route_id=fields["id"],
        decision=fields["decision"],
        reason="",
        prefill=Endpoint(*fields["p"]),
        decode=Endpoint(*fields["d"]),
        prefill_params=fields["params"],
        expected_reused_tokens=0,
        response=routing_pb2.RouteResponse(),
        skip_decode_retention=fields["skip"],
    )
    answer_to, answer_id = fields.get("answer") or ("", "")
    return SignedRoute(
        route,
        bool(fields["ids"]),
        answer_to=str(answer_to),
        answer_id=str(answer_id),
        keep_ids=bool(fields.get("keep", False)),
        collect_ids=bool(fields.get("collect", True)),
        prompt_known=bool(fields.get("known", False)),
    )
