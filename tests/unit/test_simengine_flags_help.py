"""`kvplane sim-engine --help` describes every flag with its default, and never prints a secret."""

from __future__ import annotations

from kvplane.connector.simengine.settings import build_arg_parser


def test_every_flag_says_what_it_sets() -> None:
    parser = build_arg_parser(env={})
    undescribed = [a.option_strings[0] for a in parser._actions if a.dest != "help" and not a.help]
    assert undescribed == []
    text = " ".join(parser.format_help().split())
    assert "--port HTTP_PORT port of the HTTP server (default: 8100)" in text


def test_a_token_from_the_environment_is_never_shown() -> None:
    env = {"KVPLANE_SIM_AUTH_TOKEN": "token-from-env-0123", "KVPLANE_SIM_HTTP_PORT": "9001"}
    text = build_arg_parser(env=env).format_help()
    assert "token-from-env-0123" not in text
    assert "(default: 9001)" in " ".join(text.split())  # other environment defaults are shown


def test_routing_targets_go_through_the_command_line_to_the_agent() -> None:
    from kvplane.connector.simengine.settings import SimEngineSettings, settings_from_args

    settings = SimEngineSettings(routing="r0:50051,r1:50051")
    assert settings.argv() == ["--routing", "r0:50051,r1:50051"]
    parsed = build_arg_parser(env={}).parse_args(settings.argv())
    assert settings_from_args(parsed).routing == "r0:50051,r1:50051"
