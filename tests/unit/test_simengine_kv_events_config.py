"""The sim-engine's `--kv-events-config` and `--prefix-caching-hash-algo`: vLLM's flags, read
back from `argv()`, and the event source they give the node agent."""

from __future__ import annotations

import pytest

from kvplane.connector.kv_events.vllm_config import EventsConfigError
from kvplane.connector.simengine.kv_events_config import KVEventsConfig
from kvplane.connector.simengine.settings import SimEngineSettings, parse_settings
from kvplane.services.common.model.block_hashes import DEFAULT_SEED

ON = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5560", "replay_endpoint": "tcp://*:5561"}'


def test_events_are_off_by_default_and_leave_no_flag() -> None:
    settings = SimEngineSettings()
    assert not settings.kv_events_config.enabled
    assert settings.kv_events_source() is None
    assert "--kv-events-config" not in settings.argv()


def test_vllms_keys_and_defaults_plus_the_encoding() -> None:
    config = KVEventsConfig.parse(ON)
    assert config.enabled and config.publisher == ""
    assert (config.buffer_steps, config.hwm, config.max_queue_size, config.topic, config.encoding) == (
        10_000,
        100_000,
        100_000,
        "",
        "map",
    )
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}').enabled is False
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": null}').enabled is True
    assert KVEventsConfig.parse("").enabled is False
    assert KVEventsConfig.parse(str(config)) == config


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"enable_kv_cache_events": true, "encodng": "map"}', "unknown"),
        ('{"encoding": "msgpack"}', "encoding"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"enable_kv_cache_events": "yes"}', "boolean"),
        ("[1]", "object"),
        ("{", "JSON"),
    ],
)
def test_a_malformed_config_is_refused(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        KVEventsConfig.parse(text)


def test_flags_and_environment_give_the_settings_and_argv_reads_back() -> None:
    settings = parse_settings(
        ["--kv-events-config", ON, "--prefix-caching-hash-algo", "sha256_cbor", "--block-size", "32"], env={}
    )
    assert settings.kv_events_config.endpoint == "tcp://*:5560"
    assert settings.prefix_caching_hash_algo == "sha256_cbor"
    assert parse_settings(settings.argv(), env={}) == settings
    from_env = parse_settings([], env={"KVPLANE_SIM_KV_EVENTS_CONFIG": ON})
    assert from_env.kv_events_config == settings.kv_events_config


def test_the_cli_refuses_a_bad_config_and_xxhash() -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--kv-events-config", '{"encoding": "msgpack"}'], env={})
    with pytest.raises(SystemExit):
        parse_settings(["--prefix-caching-hash-algo", "xxhash"], env={})


def test_the_source_the_node_agent_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    settings = parse_settings(["--kv-events-config", ON, "--block-size", "32"], env={})
    source = settings.kv_events_source()
    assert source is not None
    assert (source.endpoint, source.replay_endpoint) == ("tcp://127.0.0.1:5560", "tcp://127.0.0.1:5561")
    assert (source.block_size, source.hash_algo, source.hash_seed) == (32, "sha256", DEFAULT_SEED)
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert settings.kv_events_source().hash_seed == "7"  # type: ignore[union-attr]
    no_cache = parse_settings(["--kv-events-config", ON, "--no-enable-prefix-caching"], env={})
    assert no_cache.kv_events_source() is None, "no prefix caching, no block hashes: nothing to read"


def test_settings_refuse_events_their_node_agent_could_not_read() -> None:
    with pytest.raises(EventsConfigError, match="connects"):
        SimEngineSettings(
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:5560")
        )
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        SimEngineSettings(prefix_caching_hash_algo="xxhash")
