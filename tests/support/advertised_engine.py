"""A sim-engine that registers another HTTP URL than its own: a fault-injecting proxy in front of it.

    python -m tests.support.advertised_engine --advertise-url http://127.0.0.1:PORT <sim-engine flags>

The engine, its connector behaviour and its node agent are the sim-engine's
own; only the URL that routing hands to gateways differs, so tests can make
the leg to this engine fail or stall on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

from kvplane.connector.simengine.agent_link import ConnectorObserver, start_node_agent
from kvplane.connector.simengine.app import SimEngineServer
from kvplane.connector.simengine.settings import build_arg_parser, settings_from_args


async def _run() -> None:
    parser = build_arg_parser()
    parser.add_argument("--advertise-url", required=True)
    args = parser.parse_args()
    settings = settings_from_args(args)
    link = ConnectorObserver(settings)
    server = SimEngineServer(settings, link)
    await server.start()
    agent = start_node_agent(server.engine, args.advertise_url, link)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"advertised engine ready: {server.http_url} as {args.advertise_url}", flush=True)
    try:
        await stop.wait()
    finally:
        await asyncio.to_thread(agent.stop)
        await server.stop()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_run())
