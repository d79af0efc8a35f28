"""Per-tenant cache salts and a tenant's share of prompt tokens in flight."""

from __future__ import annotations

import pytest

from kvplane.services.gateway.cache_salt import CacheSalts
from kvplane.services.gateway.openai_errors import RequestRejected
from kvplane.services.gateway.tenant_share import TenantShares


def test_each_tenant_gets_its_own_salt_naming_no_tenant() -> None:
    salts = CacheSalts.create("tenant", "k", {})
    a, b = salts.salt("acme"), salts.salt("globex")
    assert a and b and a != b and "acme" not in a
    assert salts.salt("acme") == a  # stable: the tenant's turns share their cache


def test_the_salt_depends_on_the_key_so_no_client_can_compute_it() -> None:
    one, other = CacheSalts.create("tenant", "k1", {}), CacheSalts.create("tenant", "k2", {})
    assert one.salt("acme") != other.salt("acme")
    # Without a configured key each gateway draws its own.
    one, other = CacheSalts.create("tenant", "", {}), CacheSalts.create("tenant", "", {})
    assert one.salt("acme") != other.salt("acme")


def test_tenants_of_one_group_share_a_salt_and_others_stay_alone() -> None:
    salts = CacheSalts.create("group", "k", {"acme": "g1", "initech": "g1", "globex": "g2"})
    assert salts.salt("acme") == salts.salt("initech") != salts.salt("globex")
    assert salts.salt("umbrella") not in (salts.salt("acme"), salts.salt("globex"))
    # A tenant alone is not confused with a group of the same name.
    named = CacheSalts.create("group", "k", {"x": "acme"})
    assert named.salt("x") != named.salt("acme")


def test_off_sets_no_salt() -> None:
    assert CacheSalts.create("off", "k", {}).salt("acme") is None


def test_a_tenant_past_its_share_is_refused_until_its_turns_finish() -> None:
    shares = TenantShares(100)
    with shares.hold("acme", 60):
        with pytest.raises(RequestRejected) as refused, shares.hold("acme", 41):
            pass
        assert refused.value.status == 429
        with shares.hold("globex", 100):  # another tenant's share is its own
            pass
    with shares.hold("acme", 100):
        assert shares.in_flight("acme") == 100
    assert shares.in_flight("acme") == 0


def test_zero_means_unbounded() -> None:
    with TenantShares(0).hold("acme", 10**9):
        pass
