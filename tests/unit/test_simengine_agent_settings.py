"""The sim-engine's node agent takes its settings from the engine's flags and environment."""

from __future__ import annotations

import pytest

from kvplane.connector.node_agent import NodeAgentSettings
from kvplane.connector.simengine.agent_link import agent_settings
from kvplane.connector.simengine.settings import parse_settings

CONTROL_PLANE = ["--control-plane", "127.0.0.1:50051"]


def test_the_read_report_linger_defaults_to_the_node_agents() -> None:
    settings = agent_settings(parse_settings(CONTROL_PLANE))
    assert settings.release_linger_s == NodeAgentSettings(metadata_target="x").release_linger_s


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--release-linger-s", "0.25"], {}, 0.25),
        ([], {"KVPLANE_SIM_RELEASE_LINGER_S": "0"}, 0.0),
    ],
)
def test_the_read_report_linger_is_set_by_flag_or_environment(
    argv: list[str], env: dict[str, str], expected: float
) -> None:
    settings = agent_settings(parse_settings(CONTROL_PLANE + argv, env=env))
    assert settings.release_linger_s == expected


def test_a_negative_read_report_linger_is_refused() -> None:
    with pytest.raises(ValueError, match="release_linger_s"):
        parse_settings([*CONTROL_PLANE, "--release-linger-s", "-1"])


def test_the_agent_keeps_the_engines_other_settings() -> None:
    settings = agent_settings(
        parse_settings(
            [
                *CONTROL_PLANE,
                "--routing",
                "127.0.0.1:1, 127.0.0.1:2",
                "--load-interval-s",
                "2",
                "--load-heartbeat-s",
                "1",
            ]
        )
    )
    assert settings.metadata_target == "127.0.0.1:50051"
    assert settings.routing_targets == ("127.0.0.1:1", "127.0.0.1:2")
    # The heartbeat is never shorter than the sampling interval.
    assert (settings.load_interval_s, settings.load_heartbeat_s) == (2.0, 2.0)
