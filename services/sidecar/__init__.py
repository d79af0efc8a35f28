"""kvplane's decode-side sidecar (`kvplane sidecar`), beside each decode engine.

llm-d's P/D contract: the endpoint picker sends a turn to the sidecar of the D it chose, naming P
in `x-prefiller-host-port`. The sidecar runs the P leg (`max_tokens=1` with the route's
`kv_transfer_params`), then the local D leg with what P returned, streamed through. kvplane's
picker also sends the route itself, signed (`signed_route.py`): only a route that verifies, for
this body and unexpired, makes the sidecar call a P or hand D any `kv_transfer_params`. Without
one (no P header, or a client's own request when the gateway failed open) D serves the turn alone,
as a recompute, and D's handle is removed from what the client receives.

The legs, their deadlines, what a failed P leg means (`failover.prefill_retry`) and the body's
checks are the gateway's own code. The sidecar reports nothing to routing: the picker, which
sees D's last event pass back through Envoy, reports the turn; the sidecar tells it what the P leg
did in the `x-kvplane-prefill` response header, which the picker removes. A decode engine that
cannot be reached on the turn's first attempt is answered 503 with `x-kvplane-retry-elsewhere`,
for Envoy to retry on another decode pod (`app._decode_failed`).

    sidecar:
      listen: 0.0.0.0:8000
      decode_url: http://127.0.0.1:8200
      route_key: "<the picker's key>"
"""
