"""kvplane's OpenAI-compatible HTTP front (`kvplane gateway`).

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (streaming or not),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus, on the same port).

Each turn: Route (gRPC) -> the P leg (`max_tokens=1`, routing's
kv_transfer_params) -> the D leg with P's params, streamed through event by
event (only the events that can hold what the turn needs are parsed:
decode_events.py) -> ReportTurn in the background. It runs on uvloop
(`event_loop`, or `--event-loop asyncio`). Responses carry `x-kvplane-decision`
(routing's decision, `fallback` without routing, `retry_no_handle` after a
failed P leg), `x-kvplane-route-id` and `x-kvplane-conversation`.

Before any route or engine call (admission.py, request_body.py): the API key
is checked from the headers and the declared size against `max_body_bytes`
before the body is read (a refused request's connection is closed, its body
never drained); the head and the body each have a deadline; the body must be
valid UTF-8 JSON within `max_json_depth`, and meet the completion rules
(ids, token ranges, numbers). Every refusal is a 4xx in OpenAI's error format.
Each tenant gets its own prefix cache through vLLM's `cache_salt`
(cache_salt.py), and a bounded share of prompt tokens in flight
(tenant_share.py). A turn that fails after its P leg reports what P returned,
so that routing has P's held blocks released at once.

Configuration is the `gateway` section of kvplane's settings, for example:

    gateway:
      listen: 127.0.0.1:8080
      routing: [127.0.0.1:50051]
      api_keys: [{token: "<secret>", tenant: acme}]
      # While routing is unreachable: engines that recompute each turn, taken in turn; one
      # whose leg failed is skipped for fallback_suspect_s (5 s) and never retried by its turn.
      fallback_prefill_url: [http://127.0.0.1:8100, http://127.0.0.1:8101]
      fallback_decode_url: http://[::1]:8200
      models: [kvplane-sim]

or flags: `kvplane gateway --listen HOST:PORT --routing HOST:PORT[,HOST:PORT]
--fallback-prefill URL[,URL] --fallback-decode URL[,URL]` (environment: comma-separated URLs).
"""
