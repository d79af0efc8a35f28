"""etcd by name: several endpoints, each resolved by DNS, with failover when
the member in use is down, frozen or unresolvable (a real 3-member cluster)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from kvplane.services.common.model.errors import StoreUnavailable
from kvplane.services.common.store import Store
from kvplane.services.common.store.settings import StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcdCluster
from tests.conftest import make_node
from tests.integration.test_etcd_tls import TlsEtcd, tls_etcd  # noqa: F401 (a fixture)
from tests.support.factories import make_handle
from tests.support.polling import eventually


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalEtcdCluster]:
    with LocalEtcdCluster(3) as c:
        yield c


@pytest.fixture
def by_name(cluster: LocalEtcdCluster) -> Iterator[list[str]]:
    """Every member as localhost:port; members stopped by a test are back after it."""
    yield [f"localhost:{m.client_port}" for m in cluster.members]
    for m in cluster.members:
        m.resume()
        if m.proc is None:
            m.start()


@contextlib.asynccontextmanager
async def _store(endpoints: list[str]) -> AsyncIterator[Store]:
    s = Store(
        StoreSettings(
            endpoints=tuple(endpoints), prefix=f"/kvplane-test/{uuid.uuid4().hex}/", request_timeout_s=1.0
        )
    )
    await s.connect()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def store(by_name: list[str]) -> AsyncIterator[Store]:
    async with _store(by_name) as s:
        yield s


async def _a_turn_of_work(store: Store, conversation: str) -> None:
    node = make_node(f"d-{conversation}")
    await store.register_node(node, 30)
    await store.publish_handle(make_handle(node, conversation=conversation))
    record = await store.get_handle_record("acme", conversation)
    assert record is not None
    await store.check_out("acme", conversation, expected=record)


def _member_in_use(store: Store, cluster: LocalEtcdCluster) -> int:
    member = store.etcd.member
    assert member is not None
    return [m.client_port for m in cluster.members].index(member.port)


async def test_endpoints_given_by_name_reach_the_cluster(store: Store, cluster: LocalEtcdCluster) -> None:
    await _a_turn_of_work(store, "c1")
    assert store.etcd.member is not None and store.etcd.member.host == "localhost"


async def test_killing_the_member_in_use_fails_over_without_a_failed_call(
    by_name: list[str], cluster: LocalEtcdCluster
) -> None:
    # A follower first in the list: the cluster keeps its leader, so no
    # call has to wait out an election.
    follower = next(i for i in range(3) if i != cluster.leader())
    async with _store([by_name[follower], *(e for i, e in enumerate(by_name) if i != follower)]) as s:
        await _a_turn_of_work(s, "before")
        assert _member_in_use(s, cluster) == follower
        cluster.members[follower].kill()

        await _a_turn_of_work(s, "after")
        assert _member_in_use(s, cluster) != follower


async def test_killing_the_leader_in_use_loses_only_the_election(
    by_name: list[str], cluster: LocalEtcdCluster
) -> None:
    leader = cluster.leader()
    async with _store([by_name[leader], *(e for i, e in enumerate(by_name) if i != leader)]) as s:
        await _a_turn_of_work(s, "before")
        cluster.members[leader].kill()

        # Writes wait for the two left to elect a leader (etcd's election
        # timeout); the store moves to one of them and carries on.
        store = s
        done = await eventually(
            lambda: _works(store, "after"), timeout_s=15, what="a turn after the leader died"
        )
        assert done
        assert _member_in_use(s, cluster) != leader


async def _works(store: Store, conversation: str) -> bool:
    await _a_turn_of_work(store, conversation)
    return True


async def test_a_frozen_member_is_left_for_one_that_answers(
    by_name: list[str], cluster: LocalEtcdCluster
) -> None:
    follower = next(i for i in range(3) if i != cluster.leader())
    async with _store([by_name[follower], *(e for i, e in enumerate(by_name) if i != follower)]) as s:
        await _a_turn_of_work(s, "before")
        cluster.members[follower].pause()

        # The first call waits out its deadline on the frozen member; the read
        # is asked again of the next member, and the writes are re-sent there.
        await _a_turn_of_work(s, "after")
        assert _member_in_use(s, cluster) != follower


async def test_a_member_down_at_start_is_skipped(by_name: list[str], cluster: LocalEtcdCluster) -> None:
    cluster.members[0].kill()
    async with _store(by_name) as s:
        await _a_turn_of_work(s, "c1")
        assert _member_in_use(s, cluster) != 0


async def test_a_name_that_does_not_resolve_is_skipped(by_name: list[str], cluster: LocalEtcdCluster) -> None:
    async with _store(["no-such-member.invalid:2379", *by_name]) as s:
        await _a_turn_of_work(s, "c1")
        assert s.etcd.member is not None and s.etcd.member.host == "localhost"


async def test_a_watch_broken_by_a_dead_member_resumes_on_another(
    store: Store, cluster: LocalEtcdCluster
) -> None:
    revision = await store.revision()
    watched = store.keys.nodes_prefix()
    stream = store.watch_prefix(watched, revision + 1)
    await anext(stream)  # the watch is live
    killed = _member_in_use(store, cluster)
    cluster.members[killed].kill()
    with pytest.raises(StoreUnavailable):
        async for _ in stream:
            pass

    node = make_node("d-watched")
    await store.register_node(node, 30)
    seen = [ev async for ev in _first_batch_with_events(store.watch_prefix(watched, revision + 1))]
    assert [ev.key for ev in seen] == [store.keys.node(node.node_id)]
    assert _member_in_use(store, cluster) != killed


async def _first_batch_with_events(stream: AsyncIterator[list]) -> AsyncIterator:  # type: ignore[type-arg]
    async for batch in stream:
        if batch:
            for ev in batch:
                yield ev
            return


async def test_names_work_over_tls_with_the_certificate_checked_against_the_name(
    tls_etcd: TlsEtcd,  # noqa: F811 (the fixture)
) -> None:
    port = tls_etcd.endpoint.rsplit(":", 1)[1]
    settings = StoreSettings(
        endpoints=("no-such-member.invalid:2379", f"localhost:{port}"),
        prefix=f"/kvplane-test/{uuid.uuid4().hex}/",
        credentials=tls_etcd.credentials(),
    )
    async with Store(settings) as s:
        # The module's TLS etcd may still be starting when the first test reaches it.
        assert await eventually(lambda: _works(s, "c-tls"), timeout_s=15, what="a turn of work over TLS")
        assert s.etcd.member is not None and s.etcd.member.host == "localhost"
