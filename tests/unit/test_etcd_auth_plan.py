"""What `kvplane etcd-setup` changes, from what etcd holds: everything on an empty etcd, nothing on
one already prepared, and only what differs otherwise (more permissions or roles are taken back)."""

from __future__ import annotations

from kvplane.services.etcd_access.auth_plan import (
    AddRole,
    AddUser,
    AuthState,
    EnableAuth,
    GrantPermission,
    GrantRole,
    Permission,
    RevokePermission,
    RevokeRole,
    plan,
)
from kvplane.services.etcd_access.principals import (
    PROCESS_USERS,
    ROLE,
    ROOT_ROLE,
    ROOT_USER,
    prefix_range,
    process_users,
)

KEYS = prefix_range("/kvplane/v1/")
USERS = process_users()
PREPARED = AuthState(
    users={**{u: frozenset({ROLE}) for u in USERS}, ROOT_USER: frozenset({ROOT_ROLE})},
    roles={ROLE: (Permission("READWRITE", KEYS.key, KEYS.range_end),)},
    auth_enabled=True,
)


def test_the_prefix_range_covers_the_prefix_and_nothing_else() -> None:
    assert (KEYS.key, KEYS.range_end) == (b"/kvplane/v1/", b"/kvplane/v10")


def test_one_user_per_process_kind_that_opens_the_store() -> None:
    assert set(PROCESS_USERS) == {"metadata", "routing", "eviction", "gateway"}
    assert len(set(USERS)) == len(USERS) and ROOT_USER not in USERS


def test_an_empty_etcd_gets_the_role_the_users_root_and_auth_in_that_order() -> None:
    steps = plan(AuthState(users={}, roles={}, auth_enabled=False), KEYS, USERS)
    assert steps[:2] == [AddRole(ROLE), GrantPermission(ROLE, KEYS)]
    for user in USERS:
        assert steps.index(AddUser(user)) < steps.index(GrantRole(user, ROLE))
    assert steps[-3:] == [AddUser(ROOT_USER), GrantRole(ROOT_USER, ROOT_ROLE), EnableAuth()]


def test_a_prepared_etcd_needs_nothing() -> None:
    assert plan(PREPARED, KEYS, USERS) == []


def test_a_permission_beyond_the_prefix_is_revoked_and_a_narrower_type_widened() -> None:
    wider = Permission("READ", b"/", b"\0")
    read_only = Permission("READ", KEYS.key, KEYS.range_end)
    state = AuthState(users=PREPARED.users, roles={ROLE: (wider, read_only)}, auth_enabled=True)
    assert plan(state, KEYS, USERS) == [RevokePermission(ROLE, wider), GrantPermission(ROLE, KEYS)]


def test_a_process_user_holding_another_role_loses_it_root_keeps_its_own() -> None:
    routing = PROCESS_USERS["routing"]
    users = {**PREPARED.users, routing: frozenset({ROLE, "root"}), ROOT_USER: frozenset({ROOT_ROLE, "x"})}
    state = AuthState(users=users, roles=PREPARED.roles, auth_enabled=True)
    assert plan(state, KEYS, USERS) == [RevokeRole(routing, "root")]


def test_an_existing_root_without_its_role_gets_it_and_auth_is_enabled_when_off() -> None:
    users = {**PREPARED.users, ROOT_USER: frozenset()}
    state = AuthState(users=users, roles=PREPARED.roles, auth_enabled=False)
    assert plan(state, KEYS, USERS) == [GrantRole(ROOT_USER, ROOT_ROLE), EnableAuth()]


def test_an_empty_prefix_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="whole keyspace"):
        prefix_range("")
