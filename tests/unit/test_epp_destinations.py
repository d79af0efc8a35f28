"""Where a picked turn goes: D's sidecar, within Envoy's subset hint."""

from __future__ import annotations

from kvplane.services.epp.destinations import allowed, sidecar_address, subset_hint


def test_the_sidecar_is_on_ds_host_at_the_sidecar_port_unless_named() -> None:
    assert sidecar_address("http://10.0.0.5:8200", 8000, {}) == "10.0.0.5:8000"
    assert sidecar_address("http://[fd00::5]:8200", 8000, {}) == "[fd00::5]:8000"
    assert (
        sidecar_address("http://[::1]:8200", 8000, {"http://[::1]:8200": "127.0.0.1:9100"})
        == "127.0.0.1:9100"
    )


def test_the_subset_hint_is_read_as_gie_writes_it() -> None:
    listed = {
        "envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": ["10.0.0.5:8000", "10.0.0.6:8000"]}
    }
    assert subset_hint(listed) == {"10.0.0.5:8000", "10.0.0.6:8000"}
    joined = {
        "envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": "10.0.0.5:8000, 10.0.0.6:8000"}
    }
    assert subset_hint(joined) == {"10.0.0.5:8000", "10.0.0.6:8000"}
    assert subset_hint({}) is None


def test_without_a_hint_every_destination_is_allowed() -> None:
    assert allowed("10.0.0.5:8000", None)
    assert allowed("10.0.0.5:8000", {"10.0.0.5:8000"})
    assert not allowed("10.0.0.7:8000", {"10.0.0.5:8000"})
