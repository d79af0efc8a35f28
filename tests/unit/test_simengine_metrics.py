"""The sim-engine's metrics: vLLM's names where vLLM has the metric, `kvplane_sim_` for the rest, the
load set at each scrape, one registry per engine."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvplane.connector.simengine.engine_hooks import EngineLoad
from kvplane.connector.simengine.metrics import SimEngineMetrics

LOAD = EngineLoad(
    queued_requests=2,
    queued_prefill_tokens=300,
    running_requests=3,
    free_kv_blocks=25,
    total_kv_blocks=100,
    retained_bytes=4096,
    retained_handles=1,
)


def samples(
    metrics: SimEngineMetrics, load: EngineLoad = LOAD
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(metrics.render(load).decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(metrics: SimEngineMetrics, name: str, load: EngineLoad = LOAD, **labels: str) -> float:
    key = frozenset({"model_name": "m", "engine": "0", **labels}.items())
    return samples(metrics, load)[(name, key)]


def test_a_scrape_reports_the_load_under_vllms_names() -> None:
    m = SimEngineMetrics("m")
    assert value(m, "vllm:num_requests_running") == 3 and value(m, "vllm:num_requests_waiting") == 2
    assert value(m, "vllm:kv_cache_usage_perc") == 0.75
    assert value(m, "kvplane_sim_kv_free_blocks") == 25 and value(m, "kvplane_sim_kv_total_blocks") == 100
    assert value(m, "kvplane_sim_retained_bytes") == 4096 and value(m, "kvplane_sim_retained_handles") == 1
    assert value(m, "kvplane_sim_queued_prefill_tokens") == 300


def test_an_engine_without_blocks_reads_as_fully_used_not_as_a_division_by_zero() -> None:
    empty = EngineLoad(0, 0, 0, free_kv_blocks=0, total_kv_blocks=0, retained_bytes=0, retained_handles=0)
    assert value(SimEngineMetrics("m"), "vllm:kv_cache_usage_perc", empty) == 1.0


def test_prompt_tokens_are_counted_in_all_and_by_where_their_kv_came_from() -> None:
    m = SimEngineMetrics("m")
    m.count_prompt(local_cache_hit=10, external=64, local_compute=6)
    assert value(m, "vllm:prompt_tokens_total") == 80
    by_source = {
        s: value(m, "vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_cache_hit", "external_kv_transfer", "local_compute")
    }
    assert by_source == {"local_cache_hit": 10, "external_kv_transfer": 64, "local_compute": 6}


def test_finished_requests_transfers_and_frees_are_counted_by_their_labels() -> None:
    m = SimEngineMetrics("m")
    m.finished("length", 5)
    m.finished("stop", 2)
    m.transfer(0.01, 8192)
    m.transfer_failed()
    m.freed("decode_handle", "read")
    m.handshake("ok")
    m.unmatched_notif("unknown")
    m.load_outcome("prefill", "pulled")
    m.verify_failure("wrong_prefix")
    m.pull_check("clipped")
    m.expired()
    m.first_token(0.2)
    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert value(m, "vllm:generation_tokens_total") == 7
    assert (
        value(m, "vllm:nixl_bytes_transferred_sum") == 8192
        and value(m, "vllm:nixl_xfer_time_seconds_count") == 1
    )
    assert (
        value(m, "vllm:nixl_num_failed_transfers_total") == 1
        and value(m, "vllm:nixl_num_kv_expired_reqs_total") == 1
    )
    assert value(m, "kvplane_sim_retained_frees_total", kind="decode_handle", reason="read") == 1
    assert value(m, "kvplane_sim_handshakes_total", outcome="ok") == 1
    assert value(m, "kvplane_sim_notifications_unmatched_total", kind="unknown") == 1
    assert value(m, "kvplane_sim_kv_loads_total", leg="prefill", outcome="pulled") == 1
    assert value(m, "kvplane_sim_kv_verify_failures_total", reason="wrong_prefix") == 1
    assert value(m, "kvplane_connector_pull_checks_total", outcome="clipped") == 1, (
        "the vLLM connector's name"
    )
    assert value(m, "vllm:time_to_first_token_seconds_count") == 1


def test_shared_blocks_count_only_what_happened() -> None:
    m = SimEngineMetrics("m")
    m.shared_blocks(copied=3, restamped=0)
    got = samples(m)
    assert (
        got[
            (
                "kvplane_sim_shared_leased_blocks_total",
                frozenset({"model_name": "m", "engine": "0", "action": "copied"}.items()),
            )
        ]
        == 3
    )
    assert not any(
        name.startswith("kvplane_sim_shared") and ("action", "restamped") in labels for name, labels in got
    )


def test_each_engine_counts_in_a_registry_of_its_own() -> None:
    a, b = SimEngineMetrics("m"), SimEngineMetrics("m", engine_index="1")
    a.finished("stop", 4)
    assert value(a, "vllm:generation_tokens_total") == 4
    assert not any(name == "vllm:generation_tokens_total" for name, _ in samples(b)), "b finished nothing"
    assert any(name.startswith("process_") for name, _ in samples(a)), "with the process's own metrics"
