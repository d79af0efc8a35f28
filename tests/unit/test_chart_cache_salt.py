"""Every gateway replica the chart renders salts with one key, from one Secret.

Gateways with different `cache_salt_key`s salt the same tenant differently, and vLLM then keeps
two prefix caches for it: the same prompt hits through one gateway and misses through another.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Any

import pytest

from tests.support.deploy_validators import load_deploy_checks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("helm_python") is None,
    reason="helm_python not installed: pip install -e '.[dev]'",
)
ENV = "KVPLANE_GATEWAY__CACHE_SALT_KEY"


@pytest.fixture(scope="module")
def checks() -> ModuleType:
    return load_deploy_checks()


def _salt_refs(docs: list[dict[str, Any]]) -> list[dict[str, str]]:
    (gateway,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-gateway")]
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    return [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == ENV]


def test_replicas_read_one_key_from_a_secret_the_chart_renders(checks: ModuleType) -> None:
    docs = checks.render_chart({"gateway": {"replicas": 3}}, "kvp", "llm")
    (ref,) = _salt_refs(docs)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert ref == {"name": "kvp-kvplane-cache-salt", "key": "cache-salt-key"}
    key = secrets[ref["name"]]["stringData"][ref["key"]]
    assert len(key) >= 32


def test_a_secret_named_in_the_values_is_used_and_none_is_made(checks: ModuleType) -> None:
    docs = checks.render_chart(
        {"gateway": {"cacheSaltKeySecret": {"name": "salt", "key": "k"}}}, "kvp", "llm"
    )
    assert _salt_refs(docs) == [{"name": "salt", "key": "k"}]
    assert not any(d["kind"] == "Secret" and d["metadata"]["name"].endswith("cache-salt") for d in docs)


def test_the_variable_the_chart_sets_is_the_gateways_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvplane.services.settings import KvplaneSettings

    monkeypatch.setenv(ENV, "shared-key-0123456789")
    settings = KvplaneSettings.load(None, {})
    assert settings.gateway.cache_salt_key.get_secret_value() == "shared-key-0123456789"
