"""The fronts the comparison drives, each on the same engines.

- `kvplane`: kvplane's gateway as it runs by default (Route, P leg or, where routing sends the
  turn to its D alone, none, streamed D leg, ReportTurn), asking routing over gRPC (a `serve
  routing` replica of its own).
- `kvplane-colocated`: kvplane's gateway with routing in its own process
  (`gateway.routing_in_process`): the same turn without the Route hop.
- `vllm-router`: vllm-router (PyPI) in `--vllm-pd-disaggregation` mode with its defaults
  (cache-aware policy for P and D), started as its users start it: `vllm-router --prefill URL
  ... --decode URL ...`.
- `example-proxy`: vLLM's multi-turn P/D example proxy as rebuilt in
  `kvplane.bench.example_proxy`, on uvicorn (round-robin P and D).
- `zero-hop-reuse`: no front at all. The client sends the P leg and then the D leg straight to
  the engines and carries D's retained handle (the `kv_transfer_params` of D's last chunk)
  into the next turn's P leg: the best any front could do with the handle.
- `zero-hop`: the same client with fresh params on every P leg (no handle carried).
- `kvplane-spread` and `kvplane-spread-own-record` (not run by default): two gateways that each
  route in their own process, as gateway replicas behind a load balancer without affinity; turn t
  of conversation i goes to gateway (i + t) mod 2, so every later turn meets a routing record
  that did not route the turn before. The first pair reads the engines' KV events, the second
  sets them aside: what the events bring where one gateway's record cannot know.
- `kvplane-decode-prefill` (not run by default): kvplane's gateway with `gateway.prefill_on_decode`
  set on, asking `kvplane`'s routing replica: a later turn that adds few tokens to what its D holds
  is prefilled by that D, with no P leg (decision `prefill_on_decode`). Since that setting is on by
  default, the same as `kvplane`; records made before differ (`PREFILL_ON_DECODE_FRONTS_BEFORE`).
- `kvplane-local-tokenizer` (not run by default): kvplane's gateway with the sim-engine's
  tokenizer files (`gateway.tokenizers`), asking `kvplane`'s routing replica: it tokenizes a text
  prompt in its own process where `kvplane` asks P's `/tokenize`; the same with token-id prompts.
- `kvplane-epp` (not run by default): kvplane as a Gateway API inference gateway's endpoint
  picker: Envoy with `kvplane epp` over ext_proc, and a `kvplane sidecar` beside each decode
  engine running the P and D legs; routed by the same routing replica as `kvplane`. Charged
  Envoy, the picker, the sidecars, that replica, metadata and eviction, and etcd.

Both zero-hop clients give conversation i the engines P[i mod nP] and D[i mod nD] for all its
turns, so that the one difference between them is the handle. The three HTTP fronts receive
the same request and the same headers (an API key and `X-Session-ID`, the conversation).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from kvplane.services.common.model.handles import fresh_prefill_params
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.devstack.processes import ManagedProcess

KVPLANE, VLLM_ROUTER, EXAMPLE_PROXY = "kvplane", "vllm-router", "example-proxy"
KVPLANE_COLOCATED = "kvplane-colocated"
ZERO_HOP_REUSE, ZERO_HOP = "zero-hop-reuse", "zero-hop"
ALL_FRONTS = (KVPLANE, KVPLANE_COLOCATED, VLLM_ROUTER, EXAMPLE_PROXY, ZERO_HOP_REUSE, ZERO_HOP)
# kvplane on the same engines through a routing replica that ignores their KV events (its own
# record of P's caches only): what the events bring, measured in the same run. Not run by default.
KVPLANE_OWN_RECORD = "kvplane-own-record"
KVPLANE_SPREAD, KVPLANE_SPREAD_OWN_RECORD = "kvplane-spread", "kvplane-spread-own-record"
SPREAD_FRONTS = (KVPLANE_SPREAD, KVPLANE_SPREAD_OWN_RECORD)
KVPLANE_EPP = "kvplane-epp"
# kvplane's gateway with `gateway.prefill_on_decode` on, on the same routing replica as `kvplane`.
KVPLANE_DECODE_PREFILL = "kvplane-decode-prefill"
# kvplane's gateway, with the decode engines' host tier on for its blocks (off for every other
# front's): a D short of KV blocks moves retained handles to host memory instead of waiting for
# the control plane to release them. Only where the workload gives D a host tier.
KVPLANE_HOST_TIER = "kvplane-host-tier"
# kvplane's gateway with the model's tokenizer files (`gateway.tokenizers`), on the same routing
# replica as `kvplane`: it tokenizes a text prompt in its own process, where `kvplane` asks P's
# /tokenize. Only text prompts (`--prompts text`) tell the two apart.
KVPLANE_LOCAL_TOKENIZER = "kvplane-local-tokenizer"
SELECTABLE_FRONTS = (
    *ALL_FRONTS,
    KVPLANE_OWN_RECORD,
    *SPREAD_FRONTS,
    KVPLANE_EPP,
    KVPLANE_DECODE_PREFILL,
    KVPLANE_HOST_TIER,
    KVPLANE_LOCAL_TOKENIZER,
)
# The fronts that are kvplane (they use etcd; their gateways, or the picker, time Route).
KVPLANE_FRONTS = (
    KVPLANE,
    KVPLANE_COLOCATED,
    KVPLANE_OWN_RECORD,
    *SPREAD_FRONTS,
    KVPLANE_EPP,
    KVPLANE_DECODE_PREFILL,
    KVPLANE_HOST_TIER,
    KVPLANE_LOCAL_TOKENIZER,
)
# The fronts whose gateway (or picker) lets routing send a turn to its D alone
# (`gateway.prefill_on_decode`, on by default): every kvplane front. A record says which of its
# fronts did (`compare.document`), since records made before the default changed differ.
PREFILL_ON_DECODE_FRONTS = frozenset(KVPLANE_FRONTS)
# What a record that does not say means: only this front's gateway set it, the others' were off.
PREFILL_ON_DECODE_FRONTS_BEFORE = frozenset({KVPLANE_DECODE_PREFILL})
# The front every other is paired against.
REFERENCE = ZERO_HOP_REUSE
VLLM_ROUTER_VERSION = "0.1.17"


class FrontError(RuntimeError):
    """A turn the front did not complete (HTTP error, error event, short answer)."""


@dataclass
class Conversation:
    """What a client keeps between the turns of one conversation."""

    conversation_id: str
    index: int
    # D's retained handle from the previous turn (zero-hop-reuse only).
    handle: dict[str, Any] | None = None
    # Turns sent so far (a front with several URLs spreads them by it).
    turns_sent: int = 0


@dataclass(frozen=True)
class TurnOutcome:
    ttft_ms: float
    output: list[int]
    # kvplane's routing decision (x-kvplane-decision); empty for the other fronts.
    decision: str = ""
    # The answer's time per output token after the first (nan: fewer than two tokens).
    tpot_ms: float = math.nan
    # The answer's text, as the chunks carried it.
    text: str = ""
    # When the turn started (perf_counter): TTFT is measured from it.
    started_at: float = math.nan


class Front(Protocol):
    """One way of running a turn on the shared engines."""

    name: str

    @property
    def decode_retention(self) -> bool:
        """Whether the front's users run D with vLLM's bidirectional_kv_xfer on: D then keeps every
        finished turn's KV (pinned until read, released or expired), which only a front that
        carries D's handle into the next turn has a use for. The engines are switched to it
        before each of the front's blocks."""
        ...

    @property
    def decode_host_tier(self) -> bool:
        """Whether a decode engine short of KV blocks moves retained handles to its host tier
        during the front's blocks (where the workload gives D one): only a front whose control
        plane hears of the move can hand the moved handle out."""
        ...

    def processes(self) -> dict[str, int]:
        """The front's own processes (name -> pid), whose CPU is charged to it."""
        ...

    async def turn(
        self, session: aiohttp.ClientSession, conversation: Conversation, body: dict[str, Any]
    ) -> TurnOutcome: ...


@dataclass(frozen=True)
class StreamResult:
    status: int
    decision: str
    ttft_ms: float
    output: list[int]
    kv_transfer_params: dict[str, Any] | None
    tpot_ms: float = math.nan
    text: str = ""


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    started: float,
) -> StreamResult:
    """POSTs a streamed completion and reads it to its end.

    TTFT is taken from `started` (the turn's start, which for a zero-hop client is before its
    P leg) to the first chunk with a token; TPOT from that chunk to the last chunk with a token,
    over the tokens after the first (what a decode engine's other work, a prefill it runs among
    its decodes for one, costs the answers it is streaming). D's `kv_transfer_params` come from
    the chunk that carries them (the one with `finish_reason`).
    """
    ttft = 0.0
    first_at = last_at = 0.0
    output: list[int] = []
    texts: list[str] = []
    params: dict[str, Any] | None = None
    async with session.post(url, json=body, headers=dict(headers)) as resp:
        if resp.status != 200:
            raise FrontError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        decision = resp.headers.get("x-kvplane-decision", "")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise FrontError(f"{url}: error event: {json.dumps(chunk['error'])[:300]}")
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids:
                    last_at = time.perf_counter()
                    if not ttft:
                        first_at = last_at
                        ttft = (first_at - started) * 1e3
                output += ids
                texts.append(choice.get("text") or "")
            if chunk.get("kv_transfer_params"):
                params = chunk["kv_transfer_params"]
        tpot = (last_at - first_at) * 1e3 / (len(output) - 1) if len(output) > 1 else math.nan
        return StreamResult(resp.status, decision, ttft, output, params, tpot, "".join(texts))


@dataclass
class HttpFront:
    """A front with an OpenAI endpoint: kvplane's gateway, vllm-router, the example proxy.

    With several URLs (replicas of one front), turn t of conversation i goes to URL (i + t) mod n.
    """

    name: str
    urls: Sequence[str]
    pids: dict[str, int]
    api_key: str = ""
    # vllm-router carries no handle from D: its users run D without bidirectional_kv_xfer.
    decode_retention: bool = True
    decode_host_tier: bool = False

    def processes(self) -> dict[str, int]:
        return dict(self.pids)

    async def turn(
        self, session: aiohttp.ClientSession, conversation: Conversation, body: dict[str, Any]
    ) -> TurnOutcome:
        headers = {"X-Session-ID": conversation.conversation_id}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.urls[(conversation.index + conversation.turns_sent) % len(self.urls)]
        conversation.turns_sent += 1
        started = time.perf_counter()
        result = await stream_completion(session, f"{url}/v1/completions", body, headers, started)
        return TurnOutcome(
            result.ttft_ms,
            result.output,
            result.decision,
            result.tpot_ms,
            result.text,
            started,
        )


@dataclass
class ZeroHopFront:
    """P leg then D leg straight to the engines, with or without D's handle carried over."""

    name: str
    prefills: Sequence[str]
    decodes: Sequence[str]
    reuse: bool

    @property
    def decode_retention(self) -> bool:
        return self.reuse

    @property
    def decode_host_tier(self) -> bool:
        return False  # nothing would tell this client where a moved handle went

    def processes(self) -> dict[str, int]:
        return {}

    async def turn(
        self, session: aiohttp.ClientSession, conversation: Conversation, body: dict[str, Any]
    ) -> TurnOutcome:
        prefill = self.prefills[conversation.index % len(self.prefills)]
        decode = self.decodes[conversation.index % len(self.decodes)]
        handle = conversation.handle if self.reuse else None
        conversation.handle = None  # a handle is read once, whatever this turn does
        p_body = {
            **body,
            "stream": False,
            "max_tokens": 1,
            "kv_transfer_params": handle or fresh_prefill_params(),
        }
        started = time.perf_counter()
        async with session.post(f"{prefill}/v1/completions", json=p_body) as resp:
            if resp.status != 200:
                raise FrontError(f"prefill {prefill}: HTTP {resp.status}: {(await resp.text())[:300]}")
            p_params = (await resp.json()).get("kv_transfer_params")
        d_body = {**body, "kv_transfer_params": p_params}
        result = await stream_completion(session, f"{decode}/v1/completions", d_body, {}, started)
        params = result.kv_transfer_params
        if self.reuse and params and params.get("do_remote_decode"):
            conversation.handle = params
        return TurnOutcome(
            result.ttft_ms,
            result.output,
            tpot_ms=result.tpot_ms,
            text=result.text,
            started_at=started,
        )


# -- served fronts: processes of their own --------------------------------------------


def vllm_router_binary() -> str | None:
    """The `vllm-router` command beside this interpreter (the bench extra installs it), or on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def vllm_router_process(
    binary: str, prefills: Sequence[str], decodes: Sequence[str], log: Path
) -> tuple[str, ManagedProcess]:
    """vllm-router in P/D mode with its defaults; its Prometheus listener on a free port."""
    port = free_port()
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
    for url in prefills:
        argv += ["--prefill", url]
    for url in decodes:
        argv += ["--decode", url]
    # Not a behaviour setting: the default port (29000) would collide with another run's router.
    argv += ["--prometheus-port", str(free_port())]
    return f"http://127.0.0.1:{port}", ManagedProcess("vllm-router", argv, log)


def example_proxy_process(
    prefills: Sequence[str], decodes: Sequence[str], log: Path
) -> tuple[str, ManagedProcess]:
    """vLLM's example P/D proxy (kvplane.bench.example_proxy), on uvicorn."""
    port = free_port()
    argv = [sys.executable, "-m", "kvplane.bench.example_proxy", str(port), "--prefill", *prefills]
    argv += ["--decode", *decodes]
    return f"http://127.0.0.1:{port}", ManagedProcess("example proxy", argv, log)


async def wait_serving(
    session: aiohttp.ClientSession, proc: ManagedProcess, url: str, timeout_s: float = 90.0
) -> None:
    """Until `url` answers 200, the process dies, or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited during start-up:\n{proc.log_tail()}")
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            last = repr(exc)
        await asyncio.sleep(0.2)  # polling interval of a start-up wait with a deadline
    raise RuntimeError(
        f"{proc.name} did not serve {url} within {timeout_s:.0f}s ({last}):\n{proc.log_tail()}"
    )
