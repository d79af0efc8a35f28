"""`kvplane etcd-setup`'s calls: what etcd's Auth API holds, and the plan applied to it.

It speaks etcd's own gRPC Auth service (aetcd's generated stubs; aetcd's client has no auth
calls), over a channel made as the store makes its own (`open_channel`: TLS, and the client
certificate or user of the settings' etcd section). Before auth is enabled anyone may change
users and roles; afterwards only root may, so the settings must name root's certificate
(or user). Every step is safe to repeat: what is already there is not asked for again, and a
step that another run did first ("already exists") counts as done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from aetcd import rpc
from aetcd.rpc import auth_pb2

from kvplane.services.common.store.etcd import open_channel
from kvplane.services.common.store.etcd_credentials import EtcdCredentials
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
    Step,
)
from kvplane.services.etcd_access.principals import ROLE, ROOT_USER

log = logging.getLogger(__name__)

_TYPE_NAMES = {value: name for name, value in auth_pb2.Permission.Type.items()}


class SetupFailed(Exception):
    """etcd refused or did not answer a call: the message says which and why."""


def channel_to(endpoint: str, credentials: EtcdCredentials) -> grpc.aio.Channel:
    """A channel to one etcd member, as the store opens its own."""
    return open_channel(endpoint.removeprefix("http://").removeprefix("https://"), credentials)


class EtcdAuth:
    """etcd's Auth API on one channel, each call under `timeout_s`."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float) -> None:
        self._stub = rpc.AuthStub(channel)
        self._timeout_s = timeout_s

    async def _call(self, what: str, method: Callable[..., Any], request: Any) -> Any:
        try:
            return await method(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            hint = ""
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                hint = f" (auth is on: connect as {ROOT_USER}, with its client certificate)"
            raise SetupFailed(f"etcd refused to {what}: {exc.code().name}: {exc.details()}{hint}") from exc

    async def state(self, users: Sequence[str]) -> AuthState:
        """The users named (and root) with their roles, kvplane's role with its permissions."""
        listed = await self._call("list users", self._stub.UserList, rpc.AuthUserListRequest())
        held: dict[str, frozenset[str]] = {}
        for user in [*users, ROOT_USER]:
            if user in listed.users:
                reply = await self._call(
                    f"get user {user}", self._stub.UserGet, rpc.AuthUserGetRequest(name=user)
                )
                held[user] = frozenset(reply.roles)
        roles_listed = await self._call("list roles", self._stub.RoleList, rpc.AuthRoleListRequest())
        roles: dict[str, tuple[Permission, ...]] = {}
        if ROLE in roles_listed.roles:
            reply = await self._call(
                f"get role {ROLE}", self._stub.RoleGet, rpc.AuthRoleGetRequest(role=ROLE)
            )
            roles[ROLE] = tuple(
                Permission(_TYPE_NAMES[p.permType], bytes(p.key), bytes(p.range_end)) for p in reply.perm
            )
        return AuthState(users=held, roles=roles, auth_enabled=await self._auth_enabled())

    async def _auth_enabled(self) -> bool:
        try:
            reply = await self._stub.AuthStatus(rpc.AuthStatusRequest(), timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise SetupFailed(
                    f"etcd refused to say whether auth is on: {exc.code().name}: {exc.details()}"
                ) from exc
        else:
            return bool(reply.enabled)
        # etcd 3.4 has no AuthStatus (3.5 added it); its Authenticate says when auth is off.
        try:
            await self._stub.Authenticate(
                rpc.AuthenticateRequest(name=ROOT_USER, password=""), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if "not enabled" in (exc.details() or ""):
                return False
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise SetupFailed(f"etcd did not answer: {exc.code().name}: {exc.details()}") from exc
            # Any other refusal checked the password ("authentication failed"): auth is on.
        return True

    async def apply(self, step: Step) -> None:
        """One step; one that another run already took counts as done."""
        try:
            await self._apply(step)
        except SetupFailed as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.aio.AioRpcError) and "already exists" in (cause.details() or ""):
                log.info("already done: %s", step.describe())
                return
            raise

    async def _apply(self, step: Step) -> None:
        what = step.describe()
        stub = self._stub
        if isinstance(step, AddRole):
            await self._call(what, stub.RoleAdd, rpc.AuthRoleAddRequest(name=step.role))
        elif isinstance(step, RevokePermission):
            request = rpc.AuthRoleRevokePermissionRequest(
                role=step.role, key=step.permission.key, range_end=step.permission.range_end
            )
            await self._call(what, stub.RoleRevokePermission, request)
        elif isinstance(step, GrantPermission):
            perm = rpc.Permission(
                permType=auth_pb2.Permission.READWRITE, key=step.keys.key, range_end=step.keys.range_end
            )
            await self._call(
                what, stub.RoleGrantPermission, rpc.AuthRoleGrantPermissionRequest(name=step.role, perm=perm)
            )
        elif isinstance(step, AddUser):
            request = rpc.AuthUserAddRequest(
                name=step.user, options=auth_pb2.UserAddOptions(no_password=True)
            )
            await self._call(what, stub.UserAdd, request)
        elif isinstance(step, GrantRole):
            await self._call(
                what, stub.UserGrantRole, rpc.AuthUserGrantRoleRequest(user=step.user, role=step.role)
            )
        elif isinstance(step, RevokeRole):
            await self._call(
                what, stub.UserRevokeRole, rpc.AuthUserRevokeRoleRequest(name=step.user, role=step.role)
            )
        elif isinstance(step, EnableAuth):
            # Enabling auth that is on already changes nothing (etcd answers OK).
            await self._call(what, stub.AuthEnable, rpc.AuthEnableRequest())
        else:  # pragma: no cover - the Step union is exhaustive
            raise AssertionError(step)
