"""The expiry buckets that shared leases are granted by (`kvplane.services.common.store.leases`)."""

from __future__ import annotations

from kvplane.services.common.store.leases import MAX_BUCKET_S, bucket_s


def test_a_bucket_is_an_eighth_of_the_life_left() -> None:
    assert bucket_s(40_000) == 5
    assert bucket_s(240_000) == 30


def test_a_long_life_gets_the_largest_bucket_and_a_short_one_a_second() -> None:
    # A handle kept 480 s (routing's default) shares one lease a minute, not one every 15 s.
    assert bucket_s(480_000) == MAX_BUCKET_S == 60
    assert bucket_s(3_600_000) == MAX_BUCKET_S
    assert bucket_s(5_000) == 1
    assert bucket_s(0) == 1
