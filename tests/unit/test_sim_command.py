"""`kvplane sim`: its flags, its JSON, and what it says about a malformed trace."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import yaml

from kvplane.bench.sim.command import main
from kvplane.bench.workloads import TraceError, read_requests
from kvplane.services.routing import policy as policy_package
from kvplane.services.routing.policy.config import DEFAULT_POLICY_FILE


def _line(**fields: object) -> str:
    base: dict[str, object] = {"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [1, 2]}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not None})


def _trace(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _conversation_trace(tmp_path: Path) -> Path:
    lines = []
    ids = list(range(1, 9))
    for k in range(4):
        lines.append(_line(timestamp=30_000 * k, input_length=512 * len(ids), hash_ids=ids))
        ids = ids + [100 * (k + 1) + j for j in range(3)]
    return _trace(tmp_path, lines)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (_line(input_length=None), "missing field 'input_length'"),
        (_line(output_length="many"), "field 'output_length' must be an integer"),
        (_line(hash_ids=[1, "x"]), "field 'hash_ids' must be a list of integers"),
        (_line(input_length=0), "field 'input_length' must be at least 1"),
        ("{not json", "not valid JSON"),
    ],
)
def test_a_malformed_line_is_named_with_its_number_and_field(tmp_path: Path, line: str, field: str) -> None:
    path = _trace(tmp_path, [_line(), "", line])
    with pytest.raises(TraceError, match=f"line 3: {field}"):
        list(read_requests(path))


def test_a_timestamp_that_runs_backwards_is_named(tmp_path: Path) -> None:
    path = _trace(tmp_path, [_line(timestamp=5000), _line(timestamp=4000)])
    with pytest.raises(TraceError, match="line 2: field 'timestamp' 4000 is earlier"):
        list(read_requests(path))


def test_the_command_reports_a_malformed_trace_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _trace(tmp_path, [_line(), _line(hash_ids="12")])
    assert main(["--trace", str(path)]) == 2
    assert f"{path} line 2: field 'hash_ids'" in capsys.readouterr().err


def test_the_command_writes_each_policys_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    argv = [
        "--trace",
        str(_conversation_trace(tmp_path)),
        "--policies",
        "no-reuse,vllm-proxy,kvplane",
        "--engine-model",
        "evicting",
        "--prefill",
        "2",
        "--decode",
        "2",
        "--kv-gib-per-decode",
        "40",
        "--p-cache-gib",
        "0",
        "--seed",
        "3",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["spec"]["engine_model"] == "evicting" and data["turns"] == 4
    assert list(data["policies"]) == ["no-reuse", "vllm-proxy", "kvplane"]
    for figures in data["policies"].values():
        assert set(figures["ttft_ms"]) >= {"p50", "p90", "p99"}
        for key in (
            "reused_token_fraction",
            "wrong_prefix_tokens",
            "wrong_prefix_turns",
            "retained_gb_s",
            "waited_turn_fraction",
            "decisions",
            "releases",
        ):
            assert key in figures
    # Three continuations, each pulled whole: the proxy reuses most of the prompt tokens.
    assert data["policies"]["vllm-proxy"]["decisions"]["pull"] == 3
    assert data["policies"]["no-reuse"]["reused_token_fraction"] == 0.0
    table = capsys.readouterr().out
    assert "vllm-proxy" in table and "wrong-prefix turns" in table


def test_an_unknown_policy_is_refused_with_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--workload", "agentic", "--policies", "kvplane,magic"])
    assert "unknown policy magic" in capsys.readouterr().err


def test_the_same_arguments_give_the_same_json(tmp_path: Path) -> None:
    trace = str(_conversation_trace(tmp_path))
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    for out in outs:
        assert main(["--trace", trace, "--prefill", "2", "--decode", "2", "--json", str(out)]) == 0
    assert outs[0].read_text() == outs[1].read_text()


def _policy_file(tmp_path: Path, **pull: object) -> Path:
    """The packaged routing policy with its `pull` section changed."""
    raw = yaml.safe_load(resources.files(policy_package).joinpath(DEFAULT_POLICY_FILE).read_text("utf-8"))
    raw["pull"] = {**raw["pull"], **pull}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_kvplanes_policies_run_the_routing_policy_file_given_and_the_baselines_their_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(_conversation_trace(tmp_path))
    common = ["--trace", trace, "--policies", "vllm-proxy,kvplane", "--prefill", "2", "--decode", "2"]
    common += ["--p-cache-gib", "0", "--seed", "3"]
    default, custom = tmp_path / "default.json", tmp_path / "custom.json"
    assert main([*common, "--json", str(default)]) == 0
    no_pulls = _policy_file(tmp_path, threshold_tokens=1_000_000)
    assert main([*common, "--routing-policy", str(no_pulls), "--json", str(custom)]) == 0
    assert f"kvplane's routing policy: {no_pulls}" in capsys.readouterr().out
    before = json.loads(default.read_text())["policies"]
    after = json.loads(custom.read_text())
    assert after["spec"]["routing_policy"] == str(no_pulls)
    # P caches nothing: the packaged policy pulls the history; the file's threshold rules it out.
    assert before["kvplane"]["decisions"].get("pull", 0) > 0
    assert "pull" not in after["policies"]["kvplane"]["decisions"]
    assert after["policies"]["kvplane"]["decisions"]["recompute_below_threshold"] > 0
    assert after["policies"]["vllm-proxy"] == before["vllm-proxy"]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (None, "must not be negative"),
        ("pull: {threshold_tokens: 64}", "missing section 'decode'"),
        ("[not, a, mapping", "not valid YAML"),
    ],
)
def test_a_routing_policy_file_that_does_not_load_is_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | None, error: str
) -> None:
    path = _policy_file(tmp_path, threshold_tokens=-1)
    if text is not None:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(SystemExit) as exited:
        main(["--trace", str(_conversation_trace(tmp_path)), "--routing-policy", str(path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"--routing-policy {path}" in err and error in err


def test_a_routing_policy_file_that_is_missing_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "absent.yaml"
    with pytest.raises(SystemExit):
        main(["--trace", str(_conversation_trace(tmp_path)), "--routing-policy", str(missing)])
    assert f"--routing-policy {missing}" in capsys.readouterr().err
