"""What the comparison reads around each block: counters before and after, and the engines' state.

Every reading is a cumulative counter, so a block's share is the difference of two readings,
which is sound only because blocks run one after another:

- CPU seconds of each process (utime + stime of all its threads, from /proc);
- the prefill engines' prompt tokens by source (`vllm:prompt_tokens_by_source_total`: pulled
  from D, P's own prefix cache, computed), summed over the prefill engines;
- etcd's requests (gRPC messages received by its KV, Lease and Watch services, by method) and
  writes (revisions from puts and deletes), from its Prometheus endpoint;
- kvplane's processes that talk to etcd (the services, every routing replica, a gateway routing
  in its own process): the etcd requests they sent, by what each was for (`op:check_out`,
  `op:publish`, `op:report_load`, ...), summed over their own metrics
  (`kvplane_etcd_request_seconds`);
- kvplane's gateway: time spent in each leg of a turn (Route, P, D), summed, with counts.

Between blocks the engines are brought back to the same state: idle, and with no decode handle
retained from an earlier block (fronts that never read D's handles would otherwise leave them
holding memory until their TTL, and the next block would pay for it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvplane.bench.live import CACHED, COMPUTED, DECODE_CACHED, prompt_token_sources
from kvplane.bench.route_bench import cpu_seconds

ETCD_SERVICES = ("etcdserverpb.KV", "etcdserverpb.Lease", "etcdserverpb.Watch")
# etcd 3.4 and later; the debugging names are kept beside them in 3.4.
ETCD_WRITES = ("etcd_mvcc_put_total", "etcd_mvcc_delete_total")
GATEWAY_LEGS = ("tokenize", "route", "prefill", "decode")
# kvplane's services time every etcd request they send, labelled by what it was for.
SERVICES_ETCD = "kvplane_etcd_request_seconds_count"
# The eviction leader's time from a node's KV demand to its answer (releases committed, moves sent).
DEMAND_ANSWER = "kvplane_eviction_demand_answer_seconds"
DEMAND_N, DEMAND_S, DEMAND_LE_1S = "demand:n", "demand:s", "demand:le_1s"
# A sim-engine's requests that found too few free KV blocks, and how long they waited for them.
KV_WAIT = "kvplane_sim_kv_wait_seconds"
KV_WAIT_N, KV_WAIT_S, KV_WAIT_LE_1S = "kvwait_n:", "kvwait_s:", "kvwait_le_1s:"
# Polling of the waits between blocks.
POLL_S = 0.1
# A process has settled once its CPU moves less than this over one SETTLE_WINDOW_S.
SETTLE_CPU_S = 0.03
SETTLE_WINDOW_S = 0.3

Counters = dict[str, float]


# One read of a process's metrics or state: long enough that a process slowed by a loaded machine
# is waited for (a stuck one is still found out), since the readings frame every block.
_READ_TIMEOUT = aiohttp.ClientTimeout(total=120)


def samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a Prometheus text page."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, float(sample.value)


async def _text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=_READ_TIMEOUT) as resp:
        resp.raise_for_status()
        return await resp.text()


async def _summed(
    session: aiohttp.ClientSession, urls: Sequence[str], parse: Callable[[str], Counters]
) -> Counters:
    """`parse` of every page at `urls`, added up key by key."""
    total: Counter[str] = Counter()
    for page in await asyncio.gather(*(_text(session, url) for url in urls)):
        total.update(parse(page))
    return dict(total)


def cpu(pids: Mapping[str, int]) -> Counters:
    """CPU seconds so far of each named process (a process that has gone reads as nan)."""
    out: Counters = {}
    for name, pid in pids.items():
        try:
            out[name] = cpu_seconds(pid)
        except (OSError, ValueError, IndexError):
            out[name] = float("nan")
    return out


# Prompt tokens computed by the i-th prefill engine are counted under f"{COMPUTED_ON}{i}".
COMPUTED_ON = "computed_on:"
# The decode engines' host tier: handles moved there, and handles read from there; and why the
# decode engines freed retained handles (`freed:<reason>`: read, early, ttl, host_full, drain).
HOST_MOVED, HOST_READ = "host_moved", "host_read"
FREED = "freed:"


async def prefill_sources(
    session: aiohttp.ClientSession, prefills: Sequence[str], decodes: Sequence[str] = ()
) -> Counters:
    """Prompt tokens by source, summed over the prefill engines (vLLM's labels), and the tokens
    each prefill engine computed (how evenly a front spread the prefill work). A turn a decode
    engine served alone (routed prefill_on_decode) counts too: its tokens from D's own cache under
    DECODE_CACHED, the ones it computed as computed. The decode engines' host-tier moves and
    reads come with them (HOST_MOVED, HOST_READ)."""
    out: Counters = {}
    for i, url in enumerate(prefills):
        mine = await prompt_token_sources(session, [url])
        for source, tokens in mine.items():
            out[source] = out.get(source, 0.0) + tokens
        out[f"{COMPUTED_ON}{i}"] = mine.get(COMPUTED, 0.0)
    for url in decodes:
        alone, host = await decode_counts(session, url)
        out[DECODE_CACHED] = out.get(DECODE_CACHED, 0.0) + alone.get(CACHED, 0.0)
        out[COMPUTED] = out.get(COMPUTED, 0.0) + alone.get(COMPUTED, 0.0)
        for key, value in host.items():
            out[key] = out.get(key, 0.0) + value
    return out


async def decode_counts(session: aiohttp.ClientSession, url: str) -> tuple[Counters, Counters]:
    """A sim-engine's prompt tokens of requests that were neither leg of a P/D turn, by source
    (a vLLM engine does not count them apart: none there), its host tier's moves and reads, and
    its decode handles freed by reason."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    alone: Counters = {}
    host: Counters = {HOST_MOVED: 0.0, HOST_READ: 0.0}
    for name, labels, value in samples(text):
        if name == "kvplane_sim_alone_prompt_tokens_total":
            source = labels.get("source", "")
            alone[source] = alone.get(source, 0.0) + value
        elif name == "kvplane_sim_host_spills_total":
            key = HOST_MOVED if labels.get("outcome") == "moved" else f"host_{labels.get('outcome', '?')}"
            host[key] = host.get(key, 0.0) + value
        elif name == "kvplane_sim_host_reads_total":
            host[HOST_READ] += value
        elif name == "kvplane_sim_retained_frees_total" and labels.get("kind") == "decode_handle":
            key = f"{FREED}{labels.get('reason', '?')}"
            host[key] = host.get(key, 0.0) + value
    return alone, host


def etcd_counts(text: str) -> Counters:
    """etcd's `requests`, `writes` and requests by method (`rpc:<Method>`) from its metrics page."""
    out: Counters = {"requests": 0.0, "writes": 0.0}
    for name, labels, value in samples(text):
        if name == "grpc_server_msg_received_total" and labels.get("grpc_service") in ETCD_SERVICES:
            out["requests"] += value
            key = f"rpc:{labels.get('grpc_method', '?')}"
            out[key] = out.get(key, 0.0) + value
        elif name in ETCD_WRITES:
            out["writes"] += value
    return out


async def etcd(session: aiohttp.ClientSession, client_url: str) -> Counters:
    return etcd_counts(await _text(session, f"{client_url}/metrics"))


def services_etcd_ops(text: str) -> Counters:
    """The etcd requests kvplane's services sent, by operation (`op:<name>`, every outcome)."""
    out: Counters = {}
    for name, labels, value in samples(text):
        if name == SERVICES_ETCD:
            key = f"op:{labels.get('op', '?')}"
            out[key] = out.get(key, 0.0) + value
    return out


def seconds_histogram(text: str, metric: str, count: str, total: str, within_1s: str) -> Counters:
    """A histogram of seconds on a metrics page, every label summed: its count, its sum, and how
    many observations were at most 1 s (its `le="1.0"` bucket), under the keys given."""
    keys = {"_count": count, "_sum": total, "_bucket": within_1s}
    out: Counters = {}
    for name, labels, value in samples(text):
        key = keys.get(name[len(metric) :]) if name.startswith(metric) else None
        if key is None or (key == within_1s and float(labels.get("le", "nan")) != 1.0):
            continue
        out[key] = out.get(key, 0.0) + value
    return out


def demand_answers(text: str) -> Counters:
    """The eviction leader's answers to the nodes' KV demand: how many (`demand:n`), their seconds
    (`demand:s`) and how many took at most 1 s (`demand:le_1s`)."""
    return seconds_histogram(text, DEMAND_ANSWER, DEMAND_N, DEMAND_S, DEMAND_LE_1S)


def services_counts(text: str) -> Counters:
    """What a kvplane process's page says about the control plane: its etcd requests by operation
    and, from the eviction leader, its answers to KV demand."""
    return {**services_etcd_ops(text), **demand_answers(text)}


async def services_etcd(session: aiohttp.ClientSession, metrics_urls: Sequence[str]) -> Counters:
    """`services_counts` of every one of kvplane's processes at `metrics_urls`, summed."""
    return await _summed(session, metrics_urls, services_counts)


def gateway_leg_counts(text: str) -> Counters:
    """Seconds and count of each leg (all outcomes): `route_s`, `route_n`, `prefill_s`, ...; and
    `tokenize_local_n`, the tokenize legs done in the gateway's process (no engine asked)."""
    out: Counters = {}
    for name, labels, value in samples(text):
        leg = labels.get("leg", "")
        if leg not in GATEWAY_LEGS:
            continue
        if name == "kvplane_gateway_leg_seconds_sum":
            out[f"{leg}_s"] = out.get(f"{leg}_s", 0.0) + value
        elif name == "kvplane_gateway_leg_seconds_count":
            out[f"{leg}_n"] = out.get(f"{leg}_n", 0.0) + value
            if leg == "tokenize" and labels.get("outcome") == "local":
                out["tokenize_local_n"] = out.get("tokenize_local_n", 0.0) + value
    return out


async def gateway_legs(session: aiohttp.ClientSession, gateway_urls: Sequence[str]) -> Counters:
    """kvplane gateways' leg timings (tokenize, Route, ...), summed; none for no gateway (a block
    of another front, the idle window)."""
    return await _summed(session, [f"{url}/metrics" for url in gateway_urls], gateway_leg_counts)


def delta(after: Mapping[str, float], before: Mapping[str, float]) -> Counters:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


# -- the engines between blocks ---------------------------------------------------------


async def _state(session: aiohttp.ClientSession, url: str) -> dict[str, object]:
    async with session.get(f"{url}/sim/state", timeout=_READ_TIMEOUT) as resp:
        resp.raise_for_status()
        state: dict[str, object] = await resp.json()
        return state


async def _busy(session: aiohttp.ClientSession, url: str) -> bool:
    load = (await _state(session, url)).get("load")
    if not isinstance(load, dict):
        return True
    return bool(load.get("queued_requests") or load.get("running_requests"))


async def wait_idle(session: aiohttp.ClientSession, engines: Sequence[str], timeout_s: float = 60.0) -> None:
    """Until no engine has a request queued or running."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [url for url in engines if await _busy(session, url)]
        if not busy:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"engines still busy after {timeout_s:.0f}s: {busy}")
        await asyncio.sleep(POLL_S)  # polling with a deadline


async def release_decode_handles(
    session: aiohttp.ClientSession, decodes: Sequence[str], timeout_s: float = 30.0
) -> int:
    """Frees every handle the decode engines retain (as their TTL would); returns how many."""
    released = 0
    deadline = time.monotonic() + timeout_s
    for url in decodes:
        while True:
            held = [
                r["request_id"]
                for r in _retained(await _state(session, url))
                if r.get("kind") == "decode_handle" and isinstance(r.get("request_id"), str)
            ]
            if not held:
                break
            for request_id in held:
                async with session.post(f"{url}/sim/release_early", json={"request_id": request_id}) as resp:
                    resp.raise_for_status()
                    released += bool((await resp.json()).get("released"))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} still retains {len(held)} handles after {timeout_s:.0f}s")
    return released


async def set_decode_retention(session: aiohttp.ClientSession, decodes: Sequence[str], enabled: bool) -> None:
    """Turns D's retention of finished turns (vLLM's bidirectional_kv_xfer) on or off on every
    decode engine, for the turns that follow."""
    await _switch(session, decodes, "bidirectional", enabled)


async def set_decode_host_tier(session: aiohttp.ClientSession, decodes: Sequence[str], enabled: bool) -> None:
    """Turns the decode engines' moving of retained handles to their host tier on or off."""
    await _switch(session, decodes, "host_tier", enabled)


async def _switch(session: aiohttp.ClientSession, engines: Sequence[str], name: str, enabled: bool) -> None:
    """POSTs `/sim/<name>` `{"enabled": ...}` to every engine; each must answer the new state."""
    for url in engines:
        async with session.post(f"{url}/sim/{name}", json={"enabled": enabled}) as resp:
            resp.raise_for_status()
            if (await resp.json()).get(name) is not enabled:
                raise RuntimeError(f"{url} did not switch {name} to {enabled}")


def _retained(state: Mapping[str, object]) -> list[dict[str, object]]:
    retained = state.get("retained")
    return [r for r in retained if isinstance(r, dict)] if isinstance(retained, list) else []


async def settle(pids: Mapping[str, int], timeout_s: float = 10.0) -> bool:
    """Until every process's CPU moves less than SETTLE_CPU_S over a window (background work such
    as kvplane's ReportTurn done); False when the deadline passed first."""
    if not pids:
        return True
    deadline = time.monotonic() + timeout_s
    before = cpu(pids)
    while time.monotonic() < deadline:
        await asyncio.sleep(SETTLE_WINDOW_S)  # one sampling window of the CPU counters
        now = cpu(pids)
        if all(now[k] - before[k] < SETTLE_CPU_S for k in pids):
            return True
        before = now
    return False


@dataclass(frozen=True)
class Reading:
    """Every counter at one moment."""

    at: float  # time.monotonic()
    cpu: Counters
    sources: Counters
    etcd: Counters
    gateway: Counters
    engines: Counters = dataclasses.field(default_factory=dict)


ENGINE_TTFT = "vllm:time_to_first_token_seconds"
TTFT_S, TTFT_N = "ttft_s:", "ttft_n:"


def engine_counts(text: str, engine: str) -> Counters:
    """An engine's own time to first token (from the request's arrival at the engine, queue and KV
    pull included), summed and counted over its requests: `ttft_s:<engine>`, `ttft_n:<engine>`;
    and a sim-engine's waits for free KV blocks (`kvwait_n:`, `kvwait_s:`, `kvwait_le_1s:`)."""
    out: Counters = {TTFT_S + engine: 0.0, TTFT_N + engine: 0.0}
    for name, _labels, value in samples(text):
        if name == ENGINE_TTFT + "_sum":
            out[TTFT_S + engine] += value
        elif name == ENGINE_TTFT + "_count":
            out[TTFT_N + engine] += value
    waits = seconds_histogram(text, KV_WAIT, KV_WAIT_N + engine, KV_WAIT_S + engine, KV_WAIT_LE_1S + engine)
    return out | waits


async def engine_metrics(session: aiohttp.ClientSession, engines: Mapping[str, str]) -> Counters:
    """Every engine's `engine_counts`, by engine name (`p0`, `d1`, ...) -> its URL."""
    out: Counters = {}
    for name, url in engines.items():
        out |= engine_counts(await _text(session, f"{url}/metrics"), name)
    return out


async def read_all(
    session: aiohttp.ClientSession,
    pids: Mapping[str, int],
    prefills: Sequence[str],
    etcd_url: str,
    gateway_urls: Sequence[str],
    services_metrics_urls: Sequence[str] = (),
    engines: Mapping[str, str] | None = None,
    decodes: Sequence[str] = (),
    *,
    ends_window: bool = False,
) -> Reading:
    """Every counter now; the services' etcd requests by operation join etcd's own (`op:*`).

    Reading the pages costs the processes that serve them CPU (building and compressing their
    metrics), which a front's processes must not be charged: a reading that opens a window takes
    the processes' CPU after its pages, one that `ends_window` before them."""
    if ends_window:
        at, cpu_then = time.monotonic(), cpu(pids)
    sources, etcd_now, ops, legs, ttft = await asyncio.gather(
        prefill_sources(session, prefills, decodes),
        etcd(session, etcd_url),
        services_etcd(session, services_metrics_urls),
        gateway_legs(session, gateway_urls),
        engine_metrics(session, engines or {}),
    )
    if not ends_window:
        at, cpu_then = time.monotonic(), cpu(pids)
    return Reading(at, cpu_then, sources, {**etcd_now, **ops}, legs, ttft)
