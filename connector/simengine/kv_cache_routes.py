"""HTTP controls of the sim-engine's prefix cache and its KV events, for tests and tooling.

- `POST /reset_prefix_cache`: vLLM's development route. Drops the prefix cache and publishes
  `AllBlocksCleared`; `{"success": false}` while blocks are in use (running requests, retained
  handles), as vLLM answers.
- `POST /sim/kv_events/pause`, `/resume`: hold the event stream (batches wait, numbered, and go
  out in order on resume).
- `POST /sim/kv_events/drop` `{"batches": N}`: the next N batches are never sent but stay in the
  replay buffer (a gap the replay fills).

Each `/sim/kv_events/*` route answers the publisher's state (as `GET /sim/state` shows it), or
409 when the engine publishes no events.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvplane.connector.simengine.engine import SimEngine
from kvplane.connector.simengine.kv_event_publisher import KVEventPublisher


def _refused(message: str, status: int) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return web.json_response(body, status=status)


def kv_cache_routes(engine: SimEngine) -> list[web.RouteDef]:
    """The routes, bound to `engine`."""

    async def reset_prefix_cache(request: web.Request) -> web.Response:
        return web.json_response({"success": engine.reset_prefix_cache()})

    def publisher() -> KVEventPublisher:
        if engine.kv_events is None:
            raise web.HTTPConflict(text="this engine publishes no KV events (--kv-events-config)")
        return engine.kv_events

    async def pause(request: web.Request) -> web.Response:
        events = publisher()
        events.pause()
        return web.json_response(events.state())

    async def resume(request: web.Request) -> web.Response:
        events = publisher()
        events.resume()
        return web.json_response(events.state())

    async def drop(request: web.Request) -> web.Response:
        events = publisher()
        try:
            body: Any = await request.json()
        except ValueError:
            return _refused("the body is not valid JSON", 400)
        batches = body.get("batches") if isinstance(body, dict) else None
        if not isinstance(batches, int) or isinstance(batches, bool) or batches < 0:
            return _refused("batches must be a non-negative integer", 400)
        events.drop_next(batches)
        return web.json_response(events.state())

    return [
        web.post("/reset_prefix_cache", reset_prefix_cache),
        web.post("/sim/kv_events/pause", pause),
        web.post("/sim/kv_events/resume", resume),
        web.post("/sim/kv_events/drop", drop),
    ]
