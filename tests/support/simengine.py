"""Starts sim-engine processes on free loopback ports and talks to them over HTTP."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.connector.simengine.timing_model import TimingModel
from kvplane.services.common.model.handles import fresh_prefill_params
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.devstack.processes import ManagedProcess
from tests.conftest import MESH_SECRET

MODEL = "kvplane-sim"


def sim(**changes: Any) -> SimEngineSettings:
    """A test engine's settings: fast enough for tests, slow enough that decode steps are real
    sleeps, with `changes` (fields of SimEngineSettings; `speedup` sets the timing's)."""
    timing = TimingModel(speedup=changes.pop("speedup", 50))
    base: dict[str, Any] = {"timing": timing, "block_size": 16, "num_blocks": 512, "bytes_per_block": 4096}
    return SimEngineSettings(**(base | changes))


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll until predicate() is truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class Engine:
    """A running sim-engine process."""

    process: ManagedProcess
    port: int

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            data: bytes = r.read()
            return data

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.get("/sim/state"))
        return out

    def retained_ids(self) -> set[str]:
        return {r["request_id"] for r in self.state()["retained"]}

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total = 0.0
        for line in self.get("/metrics").decode().splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            series, _, value = line.rpartition(" ")
            metric_name, _, rest = series.partition("{")
            if metric_name != name:
                continue
            if all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += float(value)
        return total

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """POST with stream=true; the parsed SSE data events, [DONE] excluded."""
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(dict(body, stream=True)).encode(),
            headers={"Content-Type": "application/json"},
        )
        events: list[dict[str, Any]] = []
        with urllib.request.urlopen(req, timeout=30) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                events.append(json.loads(line[6:]))
        return events

    def log(self) -> str:
        return self.process.log_tail(chars=1 << 30)


def start_engine(name: str, log_dir: Path, settings: SimEngineSettings | None = None) -> Engine:
    """Starts a sim-engine process with `settings` (default: `sim()`) on a free HTTP port."""
    port = free_port()
    settings = dataclasses.replace(settings or sim(), http_port=port)
    process = ManagedProcess(
        name,
        [sys.executable, "-m", "kvplane.connector.simengine", *settings.argv()],
        log_dir / f"{name}.log",
        # The node agent's credentials for the test services (mesh mode, tests/conftest.py).
        env={"PYTHONUNBUFFERED": "1", "KVPLANE_SIM_MESH_SECRET": MESH_SECRET},
    )
    process.start()
    return Engine(process=process, port=port)


def wait_healthy(engine: Engine, timeout_s: float = 60) -> None:
    def healthy() -> bool:
        if not engine.process.alive():
            raise AssertionError(f"{engine.name} exited ({engine.process.exit_status()}):\n{engine.log()}")
        try:
            with urllib.request.urlopen(engine.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    wait_for(healthy, timeout_s, f"{engine.name} to become healthy", interval_s=0.1)


def stop_engine(engine: Engine) -> None:
    engine.process.stop()


@contextlib.contextmanager
def engines(log_dir: Path, specs: dict[str, SimEngineSettings]) -> Iterator[dict[str, Engine]]:
    """Start all engines in parallel; stop every one of them on exit, even after a failure."""
    started: dict[str, Engine] = {}
    try:
        for name, settings in specs.items():
            started[name] = start_engine(name, log_dir, settings)
        for e in started.values():
            wait_healthy(e)
        yield started
    finally:
        for e in started.values():
            stop_engine(e)


# -- the legs of a turn, as kvplane's gateway drives them --------------------


def tokens(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(300, 30000) for _ in range(n)]


def p_leg(p: Engine, prompt: list[int], d_handle: dict[str, Any] | None = None) -> dict[str, Any]:
    kvp: dict[str, Any] = fresh_prefill_params()
    if d_handle is not None:
        kvp = dict(d_handle, do_remote_decode=True, do_remote_prefill=False)
    return p.post(
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 1,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": kvp,
        },
    )


def d_leg(d: Engine, prompt: list[int], p_params: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    return d.post(
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": p_params,
        },
    )


def reference(r: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    out = r.post(
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert out["kv_transfer_params"] is None
    ids: list[int] = out["choices"][0]["token_ids"]
    return ids


def sources(e: Engine) -> dict[str, float]:
    return {
        s: e.metric("vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_cache_hit", "external_kv_transfer", "local_compute")
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def loads(e: Engine, outcome: str) -> float:
    return e.metric("kvplane_sim_kv_loads_total", outcome=outcome)
