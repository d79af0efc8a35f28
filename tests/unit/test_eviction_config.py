"""The eviction settings section and policies configured by name from YAML."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.services.eviction.config import retention_pipeline
from kvplane.services.eviction.policy.base import PolicyConfigError
from kvplane.services.eviction.policy.max_age import MaxAge
from kvplane.services.eviction.policy.node_budget import NodeBudget
from kvplane.services.eviction.settings import EvictionSection
from kvplane.services.settings import KvplaneSettings

POLICY_YAML = """
policies:
  - name: max_age
    engine_ttl_s: 1800
    margin_s: 60
  - name: node_budget
    high_fraction: 0.6
    low_fraction: 0.5
value:
  prefill_tokens_per_s: 12000
gaps:
  quantiles: {0.1: 20, 0.5: 60, 0.9: 300}
"""


def test_policies_are_built_by_name_from_a_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY_YAML)
    pipeline = retention_pipeline(EvictionSection(policy_file=str(path)))
    assert [p.name for p in pipeline.policies] == ["max_age", "node_budget"]
    assert isinstance(pipeline.policies[0], MaxAge) and pipeline.policies[0].limit_s == 1740
    assert isinstance(pipeline.policies[1], NodeBudget) and pipeline.policies[1].high_fraction == 0.6
    assert pipeline.values.params.prefill_tokens_per_s == 12000
    assert pipeline.values.gaps.prior_distribution.quantile(0.5) == pytest.approx(60, rel=0.2)


def test_inline_policy_wins_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY_YAML)
    section = EvictionSection(policy_file=str(path), policy={"policies": [{"name": "low_value"}]})
    assert [p.name for p in retention_pipeline(section).policies] == ["low_value"]


def test_no_policy_configured_gives_the_default_pipeline() -> None:
    # No headroom watermarks by default: memory is released when a node asks for it.
    default = retention_pipeline(EvictionSection())
    assert [p.name for p in default.policies] == ["max_age", "demand", "low_value"]


@pytest.mark.parametrize("text", ["- just a list", "policies:\n  - name: unheard_of\n"])
def test_a_bad_policy_file_is_rejected(tmp_path: Path, text: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyConfigError):
        retention_pipeline(EvictionSection(policy_file=str(path)))


def test_the_section_is_part_of_the_process_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLANE_EVICTION__LEASE_TTL_S", "7")
    settings = KvplaneSettings.load(None, {"eviction": {"release_concurrency": 32}})
    assert settings.eviction.lease_ttl_s == 7
    assert settings.eviction.release_concurrency == 32
