"""The sim-engine's spans: one server span per API request, inside the caller's trace.

The gateway sends `traceparent` with each engine leg (and with `/tokenize`). The request's span is
its child, and what the engine does for the request happens inside it: the pull from the holder
(`kv.pull`), and the handle it publishes through the node agent, whose PublishHandles call carries
the same trace context. Spans go where OpenTelemetry's variables say (`OTEL_EXPORTER_OTLP_ENDPOINT`,
...), as `service.name` `kvplane-sim-engine` unless `OTEL_SERVICE_NAME` names it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from opentelemetry import propagate, trace

# Requests that are part of a turn; health checks, metrics scrapes and /sim/* start no trace.
TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def tracing_middleware(tracer: trace.Tracer, role: str) -> Middleware:
    """An aiohttp middleware that runs each traced request inside a SERVER span."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in TRACED_PATHS:
            return await handler(request)
        with tracer.start_as_current_span(
            f"{request.method} {request.path}",
            context=propagate.extract(request.headers),
            kind=trace.SpanKind.SERVER,
            attributes={
                "http.request.method": request.method,
                "url.path": request.path,
                "kvplane.engine.role": role,
            },
        ) as span:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_status(trace.StatusCode.ERROR)
            return response

    return middleware
