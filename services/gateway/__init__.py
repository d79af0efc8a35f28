"""kvplane's OpenAI-compatible HTTP front (`kvplane gateway`).

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (streaming or not),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus, on the same port).

Each turn: Route (gRPC) -> the P leg (`max_tokens=1`, routing's
kv_transfer_params) -> the D leg with P's params, streamed through event by
event -> ReportTurn in the background. Responses carry `x-kvplane-decision`
(routing's decision, `fallback` without routing, `retry_no_handle` after a
failed P leg), `x-kvplane-route-id` and `x-kvplane-conversation`.

Configuration is the `gateway` section of kvplane's settings, for example:

    gateway:
      listen: 127.0.0.1:8080
      routing: [127.0.0.1:50051]
      api_keys: [{token: "<secret>", tenant: acme}]
      fallback_prefill_url: http://127.0.0.1:8100
      fallback_decode_url: http://[::1]:8200
      models: [kvplane-sim]

or flags: `kvplane gateway --listen HOST:PORT --routing HOST:PORT[,HOST:PORT]`.
"""
