"""What ReportTurn does beside learning: the handle D retained, and a failed turn's held prefill.

The engine's connector publishes its handles itself (it announces each one's id in D's
params): one writer per handle, and nothing here waits for it. The named fallback is a D
without kvplane's connector, which announces no handle and publishes nothing: then an
operator's report is the only source of its handle, published from D's params. A failed
turn's P may hold blocks for D that nobody will read: they are released
(`prefill_release.py`).

Reports arrive as domain values (`TurnReport`); the service converts from protobuf.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kvplane.connector import digests as token_digests
from kvplane.services.common.model import validation
from kvplane.services.common.model.errors import (
    InvalidArgument,
    NodeNotRegistered,
    PermissionDenied,
    StoreUnavailable,
)
from kvplane.services.common.model.handles import (
    KEY_CONVERSATION,
    KEY_DIGESTS,
    KEY_HANDLE_ID,
    KEY_TENANT,
    CacheHandle,
    HandleFormatError,
    VllmHandle,
    retained_handle,
)
from kvplane.services.common.model.nodes import Node
from kvplane.services.common.runtime.auth import Principal, PrincipalKind
from kvplane.services.common.store import Store
from kvplane.services.common.store.cluster_view import ClusterView
from kvplane.services.routing.endpoints import bare_host
from kvplane.services.routing.prefill_release import prefill_hold, release_prefill
from kvplane.services.routing.router import TurnReport
from kvplane.services.routing.settings import RoutingSection
from kvplane.services.routing.state.routes import RouteRecord

log = logging.getLogger(__name__)


def _now_ms() -> int:
    return int(time.time() * 1000)


class TurnReports:
    """ReportTurn's handle and prefill-release work, over the store and the replica's view."""

    def __init__(self, store: Store, view: ClusterView, settings: RoutingSection) -> None:
        self.store = store
        self.view = view
        self.settings = settings

    async def record(
        self,
        principal: Principal,
        tenant: str,
        conversation: str,
        request: TurnReport,
        route: RouteRecord | None,
    ) -> str:
        """The id of the handle D retained (empty: none known yet), and a failed turn's P released."""
        handle_id = ""
        if request.success and request.decode_kv_transfer_params_json:
            params = _decode_params(request.decode_kv_transfer_params_json, tenant, conversation)
            if principal.kind is PrincipalKind.TENANT or _announced_handle_id(params):
                # The engine's connector publishes its handles itself (it announces each one's id
                # in D's params): one writer per handle, and nothing here waits for it. A tenant
                # could name any blocks on any engine here, and so make P read another tenant's
                # KV: handles from tenant callers are only ever taken from the engine.
                handle_id = self._published_by_engine(tenant, conversation, params)
            else:
                # The named fallback: D without kvplane's connector announces no handle and
                # publishes nothing, so the operator's report is the only source of its handle.
                handle_id = await self._publish_from_report(tenant, conversation, params, request)
        if not request.success and request.prefill_kv_transfer_params_json:
            await self._release_prefill(request, route, principal, tenant, conversation)
        return handle_id

    async def _release_prefill(
        self,
        request: TurnReport,
        route: RouteRecord | None,
        principal: Principal,
        tenant: str,
        conversation: str,
    ) -> None:
        """Frees the blocks a failed turn's P holds for D (prefill_release.py). A tenant may ask
        only for a route this replica made for it, to that node; the gateway for any turn."""
        hold = prefill_hold(request.prefill_kv_transfer_params_json, request.prefill_node_id, self.view.nodes)
        own = route is not None and (route.tenant, route.conversation, route.prefill_node_id) == (
            tenant,
            conversation,
            request.prefill_node_id,
        )
        if hold is None or not (own or principal.kind is PrincipalKind.OPERATOR):
            return
        try:
            await release_prefill(self.store, hold, tenant, conversation)
        except StoreUnavailable as exc:
            # P's own lease frees the blocks later: the report itself must not fail for this.
            log.warning("could not queue the release of %s's held prefill: %s", hold.node_id, exc)

    def _published_by_engine(self, tenant: str, conversation: str, params: dict[str, Any]) -> str:
        """The id of the handle D's connector announced for this turn if the view holds it
        already, else empty: the engine publishes asynchronously, and the next turn's Route
        (which names the handle it awaits) is what waits for it, not the report."""
        wanted = _announced_handle_id(params)
        current = self.view.handle(tenant, conversation)
        return wanted if wanted and current is not None and current.handle.handle_id == wanted else ""

    async def _publish_from_report(
        self, tenant: str, conversation: str, params: dict[str, Any], request: TurnReport
    ) -> str:
        """Publishes the handle of a D that announces none (no kvplane connector) from its params."""
        handle = self._handle_from_report(tenant, conversation, params, request)
        outcome = await self.store.publish_handle(handle)
        return outcome.handle.handle_id

    def _handle_from_report(
        self, tenant: str, conversation: str, params: dict[str, Any], request: TurnReport
    ) -> CacheHandle:
        field = "decode_kv_transfer_params_json"
        try:
            vllm = VllmHandle.from_kv_transfer_params(params)
        except HandleFormatError as exc:
            raise InvalidArgument(field, str(exc)) from None
        if not vllm.remote_block_ids or not vllm.remote_block_ids[0] or vllm.remote_num_tokens <= 0:
            raise InvalidArgument(field, "retains no blocks")
        # Stored bare (metadata validation); vLLM brackets IPv6 itself.
        vllm = _with_host(vllm, bare_host(vllm.remote_host))
        holder = self._holder_for_engine(vllm.remote_engine_id)
        if request.model and request.model != holder.fingerprint.model:
            raise InvalidArgument(
                "model", f"is {request.model!r} but the holder serves {holder.fingerprint.model!r}"
            )
        digests = None
        encoded = params.get(KEY_DIGESTS)
        if isinstance(encoded, str) and encoded:
            try:
                digests = token_digests.decode(encoded)
            except token_digests.DigestFormatError as exc:
                raise InvalidArgument(f"{field}.{KEY_DIGESTS}", str(exc)) from None
        elif request.retained_token_ids:
            retained = request.retained_token_ids[: vllm.remote_num_tokens]
            digests = token_digests.digest_tokens(retained, holder.block_size)
        now = _now_ms()
        handle = retained_handle(
            vllm,
            tenant=tenant,
            conversation=conversation,
            handle_id=uuid.uuid4().hex,
            now_unix_ms=now,
            life_s=self.settings.decode_kv_ttl_s,
            expiry_margin_s=self.settings.expiry_margin_s,
            bytes_per_block=holder.block_size * holder.kv_bytes_per_token,
            model=holder.fingerprint.model,
            digests=digests,
            holder_node_id=holder.node_id,
            holder_incarnation=holder.incarnation,
        )
        # The same bounds PublishHandles applies: no method stores less checked input.
        return validation.cache_handle(handle, field, now_unix_ms=now)

    def _holder_for_engine(self, engine_id: str) -> Node:
        for record in self.view.nodes.values():
            if record.node.engine_id == engine_id:
                return record.node
        raise NodeNotRegistered(f"no registered node has engine id {engine_id!r}")


def _announced_handle_id(params: Mapping[str, Any]) -> str:
    """The id of the handle D's kvplane connector announced in its params (it publishes it)."""
    wanted = params.get(KEY_HANDLE_ID)
    return wanted if isinstance(wanted, str) else ""


def _decode_params(text: str, tenant: str, conversation: str) -> dict[str, Any]:
    """D's finish-time kv_transfer_params, checked against the caller's turn."""
    field = "decode_kv_transfer_params_json"
    try:
        params = json.loads(text)
    except ValueError:
        raise InvalidArgument(field, "is not JSON") from None
    if not isinstance(params, dict):
        raise InvalidArgument(field, "must be a JSON object")
    # The engine's connector echoes the tenant it was given; a mismatch means
    # the caller is reporting someone else's turn.
    for key, mine in ((KEY_TENANT, tenant), (KEY_CONVERSATION, conversation)):
        if key in params and params[key] != mine:
            raise PermissionDenied(f"{field}: {key} does not match the caller's turn")
    return params


def _with_host(vllm: VllmHandle, host: str) -> VllmHandle:
    return vllm if host == vllm.remote_host else replace(vllm, remote_host=host)
