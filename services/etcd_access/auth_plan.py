"""What `kvplane etcd-setup` must change in etcd's auth, from what etcd holds now. Pure: no I/O.

The plan brings etcd to one state, whatever it starts from, so running it again changes nothing:
the role `kvplane` with read and write on the prefix and no other permission; each process user
present, without a password, holding that role and no other; `root` present with the root role;
auth enabled. A permission or role found beyond those is revoked: a process's certificate must
not reach more than kvplane's keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvplane.services.etcd_access.principals import ROLE, ROOT_ROLE, ROOT_USER, KeyRange


@dataclass(frozen=True, slots=True)
class Permission:
    """One key permission of a role, as etcd's Auth API gives it."""

    # etcd's Permission.Type: READ, WRITE or READWRITE.
    perm_type: str
    key: bytes
    range_end: bytes


@dataclass(frozen=True, slots=True)
class AuthState:
    """What etcd's Auth API answered: users with their roles, roles with their permissions."""

    users: Mapping[str, frozenset[str]]
    roles: Mapping[str, tuple[Permission, ...]]
    auth_enabled: bool


@dataclass(frozen=True, slots=True)
class AddRole:
    role: str

    def describe(self) -> str:
        return f"add role {self.role}"


@dataclass(frozen=True, slots=True)
class RevokePermission:
    role: str
    permission: Permission

    def describe(self) -> str:
        p = self.permission
        return f"revoke {p.perm_type} on [{p.key!r}, {p.range_end!r}) from role {self.role}"


@dataclass(frozen=True, slots=True)
class GrantPermission:
    role: str
    keys: KeyRange

    def describe(self) -> str:
        return f"grant READWRITE on the prefix {self.keys.key.decode()} to role {self.role}"


@dataclass(frozen=True, slots=True)
class AddUser:
    """A user without a password: its client certificate's CN is how it signs in."""

    user: str

    def describe(self) -> str:
        return f"add user {self.user} (no password: its client certificate's CN)"


@dataclass(frozen=True, slots=True)
class GrantRole:
    user: str
    role: str

    def describe(self) -> str:
        return f"grant role {self.role} to user {self.user}"


@dataclass(frozen=True, slots=True)
class RevokeRole:
    user: str
    role: str

    def describe(self) -> str:
        return f"revoke role {self.role} from user {self.user}"


@dataclass(frozen=True, slots=True)
class EnableAuth:
    def describe(self) -> str:
        return "enable auth"


Step = AddRole | RevokePermission | GrantPermission | AddUser | GrantRole | RevokeRole | EnableAuth


def plan(state: AuthState, keys: KeyRange, users: Sequence[str]) -> list[Step]:
    """The steps, in the order etcd accepts them, from `state` to kvplane's (empty: nothing to do)."""
    steps: list[Step] = []
    if ROLE not in state.roles:
        steps.append(AddRole(ROLE))
    held = state.roles.get(ROLE, ())
    for permission in held:
        if (permission.key, permission.range_end) != (keys.key, keys.range_end):
            steps.append(RevokePermission(ROLE, permission))
    wanted = Permission("READWRITE", keys.key, keys.range_end)
    if wanted not in held:
        # Granting the same range again replaces its type (a READ becomes READWRITE).
        steps.append(GrantPermission(ROLE, keys))
    for user in users:
        steps += _user_steps(state, user, ROLE)
    steps += _user_steps(state, ROOT_USER, ROOT_ROLE, revoke_others=False)
    if not state.auth_enabled:
        steps.append(EnableAuth())
    return steps


def _user_steps(state: AuthState, user: str, role: str, *, revoke_others: bool = True) -> list[Step]:
    steps: list[Step] = []
    roles = state.users.get(user)
    if roles is None:
        steps.append(AddUser(user))
        roles = frozenset()
    if revoke_others:
        steps += [RevokeRole(user, other) for other in sorted(roles - {role})]
    if role not in roles:
        steps.append(GrantRole(user, role))
    return steps
