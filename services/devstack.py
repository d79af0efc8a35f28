"""`kvplane dev-stack` (what `make run` starts): the whole system on one machine.

It starts a single-member etcd with its data in a temporary directory,
`kvplane serve all`, one prefill and one decode sim-engine (real NIXL), and
the gateway, each as its own process with its log in the run directory. It
shows start-up progress, runs a short multi-turn demo through the gateway,
prints the URLs, and keeps everything up until Ctrl-C, then stops it all.

`start_stack()` is the same start-up code, for tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplane.connector.simengine.settings import Role, SimEngineSettings
from kvplane.connector.simengine.timing_model import TimingModel
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.devstack_credentials import GATEWAY, DevCredentials

DEMO_API_KEY = "dev-key"
DEMO_TENANT = "demo"


class StartupError(RuntimeError):
    """A process of the stack did not come up."""


def engine_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for the stack's engines: UCX (under NIXL) listens on loopback only.

    UCX otherwise opens its TCP listener on every network interface, and the KV it serves has no
    authentication: in the dev stack every transfer is local, so nothing else may reach it. A
    UCX_NET_DEVICES already set is left alone.
    """
    env = os.environ if environ is None else environ
    return {} if "UCX_NET_DEVICES" in env else {"UCX_NET_DEVICES": "lo"}


@dataclass
class ManagedProcess:
    """One child process with its log file; stopped with SIGTERM, then SIGKILL."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def _wait_ready(proc: ManagedProcess, probe: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise StartupError(f"{proc.name} exited during start-up:\n{proc.log_tail()}")
        try:
            if await probe():
                return
        except Exception:
            # Not ready yet. But a cancelled task's cancellation is handed to the future it awaits,
            # and grpc.aio's call task swallows it when its call has just ended, raising the call's
            # status instead: a Ctrl-C during start-up would be lost here, and start-up go on.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError from None
        await asyncio.sleep(0.1)  # polling readiness until the deadline
    raise StartupError(f"{proc.name} was not ready after {timeout_s:.0f}s:\n{proc.log_tail()}")


def grpc_health_probe(target: str) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        async with grpc.aio.insecure_channel(target) as channel:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    return probe


def http_health_probe(url: str) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        async with (
            aiohttp.ClientSession() as session,
            session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r,
        ):
            return r.status == 200

    return probe


@dataclass
class Stack:
    """A running dev stack."""

    run_dir: Path
    etcd: LocalEtcd
    grpc_target: str
    gateway_url: str
    prefill_url: str
    decode_url: str
    metrics_url: str
    processes: list[ManagedProcess] = field(default_factory=list)
    # Every engine's URL by role (the first of each is prefill_url / decode_url).
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    # Call metadata of the stack's operator principal (the control plane runs in token mode).
    operator_metadata: tuple[tuple[str, str], ...] = ()

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.etcd.cleanup()

    def urls(self) -> dict[str, str]:
        return {
            "gateway (OpenAI API)": self.gateway_url,
            "kvplane gRPC (metadata, routing, eviction)": self.grpc_target,
            "kvplane metrics": self.metrics_url,
            "prefill sim-engine": self.prefill_url,
            "decode sim-engine": self.decode_url,
            "etcd": f"http://{self.etcd.endpoint}",
            "logs": str(self.run_dir),
        }


@dataclass(frozen=True)
class StackPorts:
    """Loopback ports to pin; 0 takes a free one (every run a new one)."""

    gateway: int = 0
    grpc: int = 0
    metrics: int = 0
    prefill: int = 0
    decode: int = 0


def _kvplane(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvplane.services.cli", *args]


async def start_stack(
    run_dir: Path | None = None,
    *,
    speedup: float = 1.0,
    decoder_ttl_s: float = 480.0,
    progress: Callable[[str], None] = lambda _msg: None,
    timeout_s: float = 120.0,
    prefill_prefix_caching: bool = True,
    ports: StackPorts = StackPorts(),
    prefill_nodes: int = 1,
    decode_nodes: int = 1,
) -> Stack:
    """Starts etcd, `serve all`, P and D sim-engines and the gateway; returns when all are ready.

    `prefill_prefix_caching` False starts the prefill engines with vLLM's prefix cache off.
    `prefill_nodes` and `decode_nodes` engines of each role (p0, p1, ...; d0, d1, ...).
    """
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="kvplane-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1"
    # Token mode, as deployed: every engine, the gateway and the probes present their own token.
    credentials = DevCredentials(run_dir / "credentials")
    node_ids = [f"p{i}" for i in range(prefill_nodes)] + [f"d{i}" for i in range(decode_nodes)]
    progress("starting etcd")
    etcd = LocalEtcd(host)
    etcd.start()
    grpc_port, metrics_port = ports.grpc or free_port(), ports.metrics or free_port()
    p_port, d_port = ports.prefill or free_port(), ports.decode or free_port()
    gw_port = ports.gateway or free_port()
    stack = Stack(
        run_dir=run_dir,
        etcd=etcd,
        grpc_target=f"{host}:{grpc_port}",
        gateway_url=f"http://{host}:{gw_port}",
        prefill_url=f"http://{host}:{p_port}",
        decode_url=f"http://{host}:{d_port}",
        metrics_url=f"http://{host}:{metrics_port}/metrics",
        operator_metadata=credentials.operator_metadata(),
    )
    try:
        services = ManagedProcess(
            "kvplane serve all",
            _kvplane(
                "serve",
                "all",
                "--listen",
                stack.grpc_target,
                "--etcd",
                etcd.endpoint,
                "--metrics-port",
                str(metrics_port),
                "--config",
                str(credentials.services_config(node_ids)),
            ),
            run_dir / "services.log",
        )
        stack.processes.append(services)
        progress("starting kvplane serve all (metadata, routing, eviction)")
        services.start()
        await _wait_ready(services, grpc_health_probe(stack.grpc_target), timeout_s)

        engines = []
        nodes: list[tuple[Role, str, int]] = [
            ("prefill", f"p{i}", p_port if i == 0 else free_port()) for i in range(prefill_nodes)
        ]
        nodes += [("decode", f"d{i}", d_port if i == 0 else free_port()) for i in range(decode_nodes)]
        for role, node_id, port in nodes:
            (stack.prefill_urls if role == "prefill" else stack.decode_urls).append(f"http://{host}:{port}")
            sim = SimEngineSettings(
                role=role,
                node_id=node_id,
                http_host=host,
                http_port=port,
                side_channel_host=host,
                side_channel_port=free_port(),
                control_plane=stack.grpc_target,
                auth_token_file=credentials.token_file(node_id),
                timing=TimingModel(speedup=speedup),
                decoder_kv_blocks_ttl=decoder_ttl_s,
                model="sim-model",
                # 256 MiB of KV: room for a few dozen long conversations.
                num_blocks=16384,
                enable_prefix_caching=prefill_prefix_caching or role != "prefill",
            )
            engine = ManagedProcess(
                f"{role} sim-engine",
                _kvplane("sim-engine", *sim.argv()),
                run_dir / f"engine-{node_id}.log",
                env=engine_env(),
            )
            stack.processes.append(engine)
            progress(f"starting the {role} sim-engine")
            engine.start()
            engines.append((engine, f"http://{host}:{port}/health"))
        for engine, health in engines:
            await _wait_ready(engine, http_health_probe(health), timeout_s)

        gateway_config = run_dir / "gateway.yaml"
        gateway_config.write_text(  # JSON is YAML
            json.dumps(
                {
                    "gateway": {
                        "api_keys": [{"token": DEMO_API_KEY, "tenant": DEMO_TENANT}],
                        "routing_token_file": credentials.token_file(GATEWAY),
                        # The engines' limits: what they would refuse, the gateway refuses before routing.
                        "vocab_size": SimEngineSettings.vocab_size,
                        "max_model_len": SimEngineSettings.max_model_len,
                    }
                }
            )
        )
        gateway = ManagedProcess(
            "gateway",
            _kvplane(
                "gateway",
                "--config",
                str(gateway_config),
                "--listen",
                f"{host}:{gw_port}",
                "--routing",
                stack.grpc_target,
                "--model",
                "sim-model",
                "--fallback-prefill",
                stack.prefill_url,
                "--fallback-decode",
                stack.decode_url,
                # The engines' /tokenize gives routing the exact token ids of chat turns.
                "--tokenize-url",
                stack.prefill_url,
            ),
            run_dir / "gateway.log",
        )
        stack.processes.append(gateway)
        progress("starting the gateway")
        gateway.start()
        await _wait_ready(gateway, http_health_probe(f"{stack.gateway_url}/health"), timeout_s)
        progress("waiting for the engines to register")
        await _wait_ready(
            services,
            _nodes_registered(stack.grpc_target, len(nodes), credentials.operator_metadata()),
            timeout_s,
        )
        return stack
    except BaseException:
        stack.stop()
        raise


def _nodes_registered(
    target: str, count: int, metadata: tuple[tuple[str, str], ...]
) -> Callable[[], Awaitable[bool]]:
    from kvplane.v1 import metadata_pb2, metadata_pb2_grpc

    async def probe() -> bool:
        async with grpc.aio.insecure_channel(target) as channel:
            nodes = await metadata_pb2_grpc.MetadataServiceStub(channel).ListNodes(
                metadata_pb2.ListNodesRequest(), timeout=1, metadata=metadata
            )
            return len(nodes.nodes) >= count

    return probe


@dataclass(frozen=True)
class DemoTurn:
    conversation: str
    turn: int
    prompt_tokens: int
    ttft_ms: float
    decision: str
    # Where the prefill engine got the prompt's KV: pulled + prefill_cache + computed = prompt_tokens.
    pulled_tokens: int
    prefill_cache_tokens: int
    computed_tokens: int
    text: str


async def run_demo(
    stack: Stack, *, conversations: int = 2, turns: int = 3, max_tokens: int = 96
) -> list[DemoTurn]:
    """Multi-turn chats through the gateway; one record per turn.

    P's own prefix cache holds each turn's prompt, so all the next turn could pull is D's
    answer; routing pulls it only where the transfer beats recomputing it, and otherwise
    lets P recompute that tail beside its cache hit.
    """
    out: list[DemoTurn] = []
    headers = {"Authorization": f"Bearer {DEMO_API_KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for c in range(conversations):
            conversation = f"demo-{c}"
            messages = [{"role": "system", "content": "You are a terse assistant."}]
            for t in range(1, turns + 1):
                user = " ".join(f"question {c}.{t} about item {i}" for i in range(60 * t))
                messages.append({"role": "user", "content": user})
                body = {
                    "model": "sim-model",
                    "messages": messages,
                    "max_tokens": max_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                before = await _prompt_sources(session, stack.prefill_url)
                started = time.perf_counter()
                ttft = 0.0
                text = ""
                usage: dict[str, int] = {}
                async with session.post(
                    f"{stack.gateway_url}/v1/chat/completions",
                    json=body,
                    headers={"X-Conversation-Id": conversation},
                ) as resp:
                    if resp.status != 200:
                        raise RuntimeError(
                            f"turn {t} of {conversation}: HTTP {resp.status}: {await resp.text()}"
                        )
                    decision = resp.headers.get("x-kvplane-decision", "?")
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        for choice in chunk.get("choices", []):
                            piece = (choice.get("delta") or {}).get("content") or ""
                            if piece and not ttft:
                                ttft = (time.perf_counter() - started) * 1e3
                            text += piece
                        usage = chunk.get("usage") or usage
                after = await _prompt_sources(session, stack.prefill_url)
                pulled = int(after["external_kv_transfer"] - before["external_kv_transfer"])
                cached = int(after["local_cache_hit"] - before["local_cache_hit"])
                computed = int(after["local_compute"] - before["local_compute"])
                prompt_tokens = int(usage.get("prompt_tokens", 0)) if usage else 0
                messages.append({"role": "assistant", "content": text})
                out.append(
                    DemoTurn(conversation, t, prompt_tokens, ttft, decision, pulled, cached, computed, text)
                )
    return out


async def _prompt_sources(session: aiohttp.ClientSession, engine_url: str) -> dict[str, float]:
    """The prefill engine's prompt tokens by source (vLLM's metric), summed over labels."""
    async with session.get(f"{engine_url}/metrics") as resp:
        text = await resp.text()
    totals = {"external_kv_transfer": 0.0, "local_compute": 0.0, "local_cache_hit": 0.0}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            labels, _, value = line.rpartition(" ")
            for source in totals:
                if f'source="{source}"' in labels:
                    totals[source] += float(value)
    return totals


def demo_table(turns: Sequence[DemoTurn]) -> str:
    """The demo's table: per turn, where the prefill engine got each prompt token's KV."""
    header = ("conversation", "turn", "prompt", "TTFT ms", "decision", "pulled", "P cache", "computed")
    lines = ["{:<14}{:>5}{:>8}{:>9}  {:<28}{:>8}{:>9}{:>9}".format(*header)]
    for t in turns:
        lines.append(
            f"{t.conversation:<14}{t.turn:>5}{t.prompt_tokens:>8}{t.ttft_ms:>9.0f}  {t.decision:<28}"
            f"{t.pulled_tokens:>8}{t.prefill_cache_tokens:>9}{t.computed_tokens:>9}"
        )
    lines.append(
        "pulled: read from the decode engine over NIXL; P cache: the prefill engine's own prefix cache;\n"
        "computed: prefilled. The three add up to the prompt."
    )
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> int:
    # Made here, not by start_stack, so that a Ctrl-C during start-up still says where the logs were.
    temporary = not args.run_dir
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="kvplane-run-"))
    try:
        return await _serve_stack(args, run_dir)
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
        run_dir, speedup=args.speedup, progress=lambda m: print(f"==> {m}", flush=True), ports=ports
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
        print("\nCtrl-C stops everything.", flush=True)
        if args.exit_after_demo:
            return 0
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("\n==> stopping", flush=True)
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
