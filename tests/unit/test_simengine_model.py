"""Timing model, tokenizer, token oracle, kv_transfer_params and settings of the sim-engine."""

from __future__ import annotations

import pytest

from kvplane.connector.simengine import toy_tokenizer
from kvplane.connector.simengine.kv_params import INCARNATION_KEY, holder_params, parse_remote
from kvplane.connector.simengine.settings import SettingsError, SimEngineSettings, parse_settings
from kvplane.connector.simengine.side_channel import format_host, normalize_host
from kvplane.connector.simengine.timing_model import QWEN3_32B_TTFT_POINTS, TimingModel, fit_two_points
from kvplane.connector.simengine.token_oracle import TokenOracle


def test_default_timing_passes_through_the_published_qwen3_32b_points() -> None:
    t = TimingModel()
    for tokens, seconds in QWEN3_32B_TTFT_POINTS:
        assert t.prefill_s(tokens) == pytest.approx(seconds, rel=1e-9)
    assert t.prefill_base_s == pytest.approx(0.1016, abs=1e-4)
    assert t.prefill_per_token_s == pytest.approx(28.18e-6, rel=1e-3)


def test_speedup_divides_every_duration() -> None:
    t = TimingModel().with_speedup(50)
    assert t.prefill_s(2000) == pytest.approx(0.158 / 50)
    assert t.decode_s(1) == pytest.approx(TimingModel().decode_s(1) / 50)
    with pytest.raises(ValueError):
        TimingModel(speedup=0)


def test_fit_with_a_quadratic_term_still_hits_both_points() -> None:
    a, b = fit_two_points((1000, 0.1), (10000, 0.9), quadratic_s=1e-9)
    t = TimingModel(prefill_base_s=a, prefill_per_token_s=b, prefill_per_token_sq_s=1e-9)
    assert t.prefill_s(1000) == pytest.approx(0.1) and t.prefill_s(10000) == pytest.approx(0.9)


def test_tokenizer_round_trips_and_continues_the_prefix() -> None:
    ids = toy_tokenizer.encode("héllo world")
    assert ids[0] == toy_tokenizer.BOS_ID and toy_tokenizer.decode(ids) == "héllo world"
    oracle = TokenOracle(seed=3)
    state, out = oracle.state_after(ids), []
    for _ in range(20):
        t = oracle.next_token(state)
        out.append(t)
        state = oracle.state_after([t], state)
    assert toy_tokenizer.encode("héllo world" + toy_tokenizer.decode(out)) == ids + out


def test_chat_history_renders_as_a_continuation_of_the_previous_turn() -> None:
    first = [{"role": "user", "content": "hi"}]
    prompt = toy_tokenizer.encode(toy_tokenizer.render_chat(first))
    second = [*first, {"role": "assistant", "content": "abc d"}, {"role": "user", "content": "more"}]
    prompt2 = toy_tokenizer.encode(toy_tokenizer.render_chat(second))
    assert prompt2[: len(prompt) + 5] == prompt + toy_tokenizer.encode("abc d", add_bos=False)
    with pytest.raises(toy_tokenizer.PromptError):
        toy_tokenizer.render_chat([{"content": "no role"}])


def test_oracle_depends_on_the_whole_prefix_and_the_seed() -> None:
    o = TokenOracle(seed=1)
    s1, s2 = o.state_after([5, 6, 7]), o.state_after([4, 6, 7])
    assert s1 != s2 and o.state_after([7], o.state_after([5, 6])) == s1
    assert TokenOracle(seed=2).state_after([5, 6, 7]) != s1
    assert TokenOracle(seed=1, eos_probability=1.0).next_token(s1) == toy_tokenizer.EOS_ID


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_ipv6_side_channel_hosts_are_accepted_bracketed_or_not(host: str) -> None:
    assert normalize_host(host) == "::1" and format_host(host) == "[::1]"
    remote = parse_remote(
        {
            "remote_engine_id": "d",
            "remote_request_id": "r",
            "remote_host": host,
            "remote_port": 5600,
            "remote_block_ids": [[1, 2]],
            "remote_num_tokens": 20,
        }
    )
    assert remote is not None and remote.host == "::1" and remote.block_ids == (1, 2)
    assert SimEngineSettings(side_channel_host=host).side_channel_host == "::1"
    assert format_host("10.0.0.7") == "10.0.0.7" and format_host("d-0.svc") == "d-0.svc"


def test_holder_params_round_trip_through_parse_remote() -> None:
    d = holder_params(
        as_decode_handle=True,
        engine_id="d1",
        incarnation="inc",
        request_id="r1",
        block_ids=[3, 4, 5],
        host="::1",
        port=5601,
        num_tokens=40,
        expiry_time=123.5,
    )
    assert d["do_remote_decode"] is True and d["do_remote_prefill"] is False
    assert d["remote_host"] == "::1" and d["remote_blocks_expiry_time"] == 123.5
    r = parse_remote(d)
    assert r is not None
    assert (r.engine_id, r.request_id, r.port, r.num_tokens, r.expiry_time, r.incarnation) == (
        "d1",
        "r1",
        5601,
        40,
        123.5,
        "inc",
    )
    p = holder_params(
        as_decode_handle=False,
        engine_id="p1",
        incarnation="i",
        request_id="r",
        block_ids=[1],
        host="127.0.0.1",
        port=1,
        num_tokens=5,
        expiry_time=None,
    )
    assert p["do_remote_prefill"] is True and "remote_blocks_expiry_time" not in p and INCARNATION_KEY in p


@pytest.mark.parametrize(
    "broken",
    [
        {"remote_engine_id": None},
        {"remote_block_ids": [["x"]]},
        {"remote_port": 0},
        {"remote_block_ids": []},
        {"remote_host": None},
    ],
)
def test_malformed_remote_params_name_no_remote(broken: dict[str, object]) -> None:
    good = {
        "remote_engine_id": "d",
        "remote_request_id": "r",
        "remote_host": "h",
        "remote_port": 1,
        "remote_block_ids": [[1]],
    }
    assert parse_remote(good) is not None
    assert parse_remote({**good, **broken}) is None


def test_settings_from_flags() -> None:
    s = parse_settings(
        [
            "--role",
            "decode",
            "--side-channel-host",
            "[::1]",
            "--no-bidirectional",
            "--speedup",
            "10",
            "--decoder-kv-blocks-ttl",
            "30",
        ]
    )
    assert s.role == "decode" and s.side_channel_host == "::1" and s.bidirectional is False
    assert s.timing.speedup == 10 and s.decoder_kv_blocks_ttl == 30
    assert s.resolved_engine_id().startswith("sim-decode-")
    assert s.advertised_side_channel_host == "::1"
    wild = parse_settings(
        ["--host", "0.0.0.0", "--side-channel-host", "0.0.0.0", "--advertise-host", "d-0.sim"]
    )
    assert (wild.advertised_http_host, wild.advertised_side_channel_host) == ("d-0.sim", "d-0.sim")
    with pytest.raises(ValueError):
        SimEngineSettings(block_size=0)


def test_environment_sets_defaults_and_flags_win() -> None:
    env = {"KVPLANE_SIM_HTTP_PORT": "9100", "KVPLANE_SIM_BIDIRECTIONAL": "false", "KVPLANE_SIM_SPEEDUP": "4"}
    s = parse_settings([], env=env)
    assert (s.http_port, s.bidirectional, s.timing.speedup) == (9100, False, 4.0)
    assert parse_settings(["--port", "9200", "--bidirectional"], env=env).http_port == 9200
    assert parse_settings(["--bidirectional"], env=env).bidirectional is True
    with pytest.raises(SettingsError):
        parse_settings([], env={"KVPLANE_SIM_BIDIRECTIONAL": "maybe"})


def test_argv_is_read_back_as_the_same_settings_and_names_only_what_differs() -> None:
    changed = SimEngineSettings(
        role="decode",
        engine_id="d-1",
        http_host="::1",
        http_port=0,
        side_channel_host="[::1]",
        side_channel_port=0,
        decoder_kv_blocks_ttl=4.5,
        bidirectional=False,
        enable_prefix_caching=False,
        kvplane_connector=True,
        timing=TimingModel(speedup=50, decode_step_s=0.1, prefill_per_token_s=1e-5),
        node_id="d0",
        control_plane="127.0.0.1:50051",
        auth_token_file="/run/token",
        num_blocks=16384,
        seed=7,
    )
    argv = changed.argv()
    assert parse_settings(argv, env={}) == changed
    assert "--no-bidirectional" in argv and "--kvplane-connector" in argv
    assert argv[argv.index("--speedup") + 1] == "50"
    assert SimEngineSettings().argv() == []
    # Only the flags that differ: the defaults stay the parser's (or the environment's).
    assert SimEngineSettings(role="prefill").argv() == ["--role", "prefill"]
