"""Cache handles: a decode engine's retained blocks for one conversation.

A handle has two parts. `VllmHandle` carries every key of the engine's
`kv_transfer_params` losslessly, so the dict that reaches the prefill engine
is exactly the one the decode engine emitted. `CacheHandle` adds what the
control plane needs: owner, holder, wall-clock expiry, size and digests.

`retained_handle` is the one builder of the handle D publishes after a turn: the vLLM
connector and the sim-engine call it through `EngineHandles.finished` (at the finish, on D's
clock), and routing's report fallback calls it for a D without kvplane's connector.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvplane.connector.digests import KEY_TAIL_DIGEST, TokenDigests, digest_tokens, tail_digest
from kvplane.connector.digests import encode as encode_digests

# Keys vLLM's NixlConnector puts in a handle (PROTOCOL.md). Everything else
# in the dict is carried in `extra` and passed through untouched.
VLLM_HANDLE_KEYS = frozenset(
    {
        "do_remote_decode",
        "do_remote_prefill",
        "remote_engine_id",
        "remote_request_id",
        "remote_block_ids",
        "remote_num_tokens",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_blocks_expiry_time",
        "remote_registration_generation",
        "transfer_mode",
    }
)

# Our own keys inside kv_transfer_params. The router writes them on the way
# to the engines; the engine's connector reads them back at finish.
KEY_TENANT = "kvplane_tenant"
KEY_CONVERSATION = "kvplane_conversation"
KEY_HANDLE_ID = "kvplane_handle_id"
# On D's request: false when D need not keep the turn's KV for the next turn (routing's
# RouteResponse.skip_decode_retention); D's connector then frees the blocks at once and
# publishes nothing. Absent: D keeps them, as vLLM's bidirectional transfer does.
KEY_RETAIN = "kvplane_retain"
KEY_DIGESTS = "kvplane_digests"
KVPLANE_KEYS = frozenset({KEY_TENANT, KEY_CONVERSATION, KEY_HANDLE_ID, KEY_DIGESTS})
# The prefill engine's own report, in the params it returns: prompt tokens whose KV it read from the
# holder over NIXL. Its usage's `cached_tokens` also counts its own prefix-cache hits.
KEY_PULLED_TOKENS = "kvplane_pulled_tokens"
# Beside it: how long that pull took on P (ms), as P measured it. Routing learns its pull costs
# from it (the gateway reports it as the turn's transfer_ms).
KEY_PULL_MS = "kvplane_pull_ms"
# And how long the prompt waited on P before P started computing it, its pull left out (ms), as P
# measured it. Routing takes it and the pull off the P leg's time to learn P's compute alone: its
# own estimate of the wait is off by as much as the queue is long.
KEY_QUEUED_MS = "kvplane_queued_ms"
# vLLM's key for a symmetric P2P source (its OffloadingConnector's P2P tier): where a host-tier
# handle of a vLLM decode engine is read from, by block hash.
KEY_REMOTE_KV_SOURCE = "remote_kv_source"


class HandleFormatError(ValueError):
    """kv_transfer_params that are not a usable handle."""


class KvTier(enum.Enum):
    """The memory a holder keeps a handle's blocks in."""

    DEVICE = "device"  # the engine's KV cache
    HOST = "host"  # the engine's host memory, registered for remote reads


class HandleState(enum.Enum):
    RETAINED = "retained"
    CHECKED_OUT = "checked_out"
    RELEASED = "released"


class ReleaseReason(enum.Enum):
    """Why a handle left `retained` without being checked out."""

    REQUESTED = "requested"
    SUPERSEDED = "superseded"
    MAX_AGE = "max_age"
    NODE_BUDGET = "node_budget"
    TENANT_BUDGET = "tenant_budget"
    LOW_VALUE = "low_value"
    CONVERSATION_ENDED = "conversation_ended"
    HOLDER_DOWN = "holder_down"
    DRAIN = "drain"
    FREED_BY_ENGINE = "freed_by_engine"
    # Checked out, but no prefill engine read it within the claim deadline.
    CLAIM_UNUSED = "claim_unused"


@dataclass(frozen=True, slots=True)
class VllmHandle:
    """The engine's handle keys. Optional keys stay `None` when absent."""

    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: tuple[tuple[int, ...], ...]
    remote_num_tokens: int
    remote_host: str
    remote_port: int
    tp_size: int = 1
    dcp_size: int | None = None
    pp_size: int | None = None
    # D's perf_counter deadline, in D's clock. Never compare it with wall time.
    remote_blocks_expiry_time: float | None = None
    remote_registration_generation: int | None = None
    transfer_mode: str = ""
    # Other keys the engine sent, passed through untouched.
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        """Blocks in the first KV-cache group (all groups cover the same tokens)."""
        return len(self.remote_block_ids[0]) if self.remote_block_ids else 0

    @classmethod
    def from_kv_transfer_params(cls, params: Mapping[str, Any]) -> VllmHandle:
        """Parse a decode engine's finish-time `kv_transfer_params`."""
        try:
            groups = params["remote_block_ids"]
            if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
                raise HandleFormatError("remote_block_ids must be a list of lists of ints")
            block_ids = tuple(tuple(_int(b, "remote_block_ids") for b in g) for g in groups)
            expiry = params.get("remote_blocks_expiry_time")
            if expiry is not None:
                if (
                    not isinstance(expiry, int | float)
                    or isinstance(expiry, bool)
                    or not math.isfinite(expiry)
                ):
                    raise HandleFormatError("remote_blocks_expiry_time must be a finite number or null")
                expiry = float(expiry)
            extra = {k: v for k, v in params.items() if k not in VLLM_HANDLE_KEYS and k not in KVPLANE_KEYS}
            return cls(
                remote_engine_id=_str(params["remote_engine_id"], "remote_engine_id"),
                remote_request_id=_str(params["remote_request_id"], "remote_request_id"),
                remote_block_ids=block_ids,
                remote_num_tokens=_int(params["remote_num_tokens"], "remote_num_tokens"),
                remote_host=_str(params["remote_host"], "remote_host"),
                remote_port=_int(params["remote_port"], "remote_port"),
                tp_size=_int(params.get("tp_size", 1), "tp_size"),
                dcp_size=_opt_int(params.get("dcp_size"), "dcp_size"),
                pp_size=_opt_int(params.get("pp_size"), "pp_size"),
                remote_blocks_expiry_time=expiry,
                remote_registration_generation=_opt_int(
                    params.get("remote_registration_generation"), "remote_registration_generation"
                ),
                transfer_mode=_str(params.get("transfer_mode") or "", "transfer_mode"),
                extra=extra,
            )
        except KeyError as exc:
            raise HandleFormatError(f"kv_transfer_params lacks {exc.args[0]!r}") from None

    def to_kv_transfer_params(self) -> dict[str, Any]:
        """The engine's dict, as it was emitted (without do_remote_* flags)."""
        out: dict[str, Any] = dict(self.extra)
        out.update(
            remote_engine_id=self.remote_engine_id,
            remote_request_id=self.remote_request_id,
            remote_block_ids=[list(g) for g in self.remote_block_ids],
            remote_num_tokens=self.remote_num_tokens,
            remote_host=self.remote_host,
            remote_port=self.remote_port,
            tp_size=self.tp_size,
            remote_blocks_expiry_time=self.remote_blocks_expiry_time,
        )
        if self.dcp_size is not None:
            out["dcp_size"] = self.dcp_size
        if self.pp_size is not None:
            out["pp_size"] = self.pp_size
        if self.remote_registration_generation is not None:
            out["remote_registration_generation"] = self.remote_registration_generation
        if self.transfer_mode:
            out["transfer_mode"] = self.transfer_mode
        return out

    def extra_json(self) -> str:
        return json.dumps(dict(self.extra), sort_keys=True, separators=(",", ":")) if self.extra else ""


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise HandleFormatError(f"{name} must be a string")
    return value


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HandleFormatError(f"{name} must be an integer")
    return value


def _opt_int(value: Any, name: str) -> int | None:
    return None if value is None else _int(value, name)


@dataclass(frozen=True, slots=True)
class CacheHandle:
    """A published handle: the engine's keys plus ownership, life and size."""

    handle_id: str
    tenant: str
    conversation: str
    holder_node_id: str
    holder_incarnation: str
    vllm: VllmHandle
    wall_expiry_unix_ms: int
    retained_bytes: int = 0
    digests: TokenDigests | None = None
    published_unix_ms: int = 0
    model: str = ""
    tier: KvTier = KvTier.DEVICE
    # Publish only: the id of the conversation's handle this one is (the same KV, moved by its
    # holder); see handle.proto.
    relocates_handle_id: str = ""

    @property
    def num_tokens(self) -> int:
        return self.vllm.remote_num_tokens

    def life_left_ms(self, now_unix_ms: int) -> int:
        return self.wall_expiry_unix_ms - now_unix_ms

    def with_id(self, handle_id: str) -> CacheHandle:
        return replace(self, handle_id=handle_id)

    def prefill_kv_transfer_params(self) -> dict[str, Any]:
        """The P leg's dict for a pull: the engine's handle, flags for P."""
        out = self.vllm.to_kv_transfer_params()
        out["do_remote_decode"] = True
        out["do_remote_prefill"] = False
        return out


@dataclass(frozen=True, slots=True)
class Claim:
    """A check-out in flight, recorded with a short lease."""

    claim_id: str
    handle: CacheHandle
    route_id: str
    claimed_unix_ms: int


@dataclass(frozen=True, slots=True)
class PendingRelease:
    """A release command waiting for its node to acknowledge it."""

    command_id: str
    handle: CacheHandle
    reason: ReleaseReason
    decided_unix_ms: int


def fresh_prefill_params() -> dict[str, Any]:
    """Turn-1 P-leg params: "my KV will be read after I finish"."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


# -- the one builder of the handle D publishes after a turn ----------------------------------------


def routed_to(request_params: Mapping[str, Any]) -> tuple[str, str] | None:
    """The tenant and conversation kvplane's router wrote into a request's params; None when the
    request was not routed by kvplane (its blocks then follow vLLM's own rules only)."""
    tenant = request_params.get(KEY_TENANT)
    conversation = request_params.get(KEY_CONVERSATION)
    if not (isinstance(tenant, str) and tenant and isinstance(conversation, str) and conversation):
        return None
    return tenant, conversation


def retained_handle(
    vllm: VllmHandle,
    *,
    tenant: str,
    conversation: str,
    handle_id: str,
    now_unix_ms: int,
    life_s: float,
    expiry_margin_s: float,
    bytes_per_block: int,
    model: str,
    digests: TokenDigests | None,
    holder_node_id: str = "",
    holder_incarnation: str = "",
) -> CacheHandle:
    """D's retained blocks as the handle to publish. `life_s`: how long D keeps them from
    `now_unix_ms` (seconds); the wall expiry is that less `expiry_margin_s`. An empty holder is
    stamped by the node agent that publishes it (its node and incarnation)."""
    return CacheHandle(
        handle_id=handle_id,
        tenant=tenant,
        conversation=conversation,
        holder_node_id=holder_node_id,
        holder_incarnation=holder_incarnation,
        vllm=vllm,
        wall_expiry_unix_ms=now_unix_ms + int((life_s - expiry_margin_s) * 1000),
        retained_bytes=vllm.num_blocks * bytes_per_block,
        digests=digests,
        published_unix_ms=now_unix_ms,
        model=model,
    )


@dataclass(frozen=True, slots=True)
class FinishedHandle:
    """What a decode engine holds, and publishes, for a request that finished keeping its blocks."""

    handle_id: str
    retained_bytes: int
    # None when kvplane did not route the request, or when its params are no handle (`problem`).
    handle: CacheHandle | None
    problem: str = ""


@dataclass(frozen=True, slots=True)
class EngineHandles:
    """How one decode engine turns finished requests into handles: the vLLM connector and the
    sim-engine each hold one, so both publish exactly the same handle for the same blocks."""

    model: str
    block_size: int  # tokens per block
    bytes_per_block: int
    # Taken off D's expiry in the published wall-clock expiry, seconds.
    expiry_margin_s: float

    def finished(
        self,
        params: MutableMapping[str, Any],
        request_params: Mapping[str, Any],
        all_token_ids: Sequence[int],
        *,
        new_id: str,
        now_unix_s: float,
        engine_clock_s: float,
    ) -> FinishedHandle:
        """At a finish that keeps blocks for a next turn. Stamps `params`, the ones D returns,
        with kvplane's handle id (the router's, else `new_id`), the digests of the tokens whose KV
        the blocks hold (the first `remote_num_tokens` of prompt + output, `all_token_ids`) and
        their tail digest; then builds the handle. `engine_clock_s` is D's `perf_counter` now,
        the clock of `remote_blocks_expiry_time`."""
        handle_id = str(request_params.get(KEY_HANDLE_ID) or new_id)
        retained = list(all_token_ids[: params.get("remote_num_tokens") or 0])
        found = digest_tokens(retained, self.block_size)
        params[KEY_HANDLE_ID] = handle_id
        params[KEY_DIGESTS] = encode_digests(found)
        params[KEY_TAIL_DIGEST] = tail_digest(retained, self.block_size)
        wire = dict(params)
        groups = params.get("remote_block_ids")
        retained_bytes = 0
        if isinstance(groups, list | tuple) and groups and all(isinstance(g, list | tuple) for g in groups):
            # Inside vLLM the block ids are a tuple of lists; on the wire, JSON lists.
            wire["remote_block_ids"] = [list(g) for g in groups]
            retained_bytes = self.bytes_per_block * len(groups[0])
        owner = routed_to(request_params)
        if owner is None:
            return FinishedHandle(handle_id, retained_bytes, None)
        try:
            vllm = VllmHandle.from_kv_transfer_params(wire)
        except HandleFormatError as exc:
            return FinishedHandle(handle_id, retained_bytes, None, str(exc))
        expiry = vllm.remote_blocks_expiry_time
        handle = retained_handle(
            vllm,
            tenant=owner[0],
            conversation=owner[1],
            handle_id=handle_id,
            now_unix_ms=int(now_unix_s * 1000),
            life_s=expiry - engine_clock_s if expiry is not None else 0.0,
            expiry_margin_s=self.expiry_margin_s,
            bytes_per_block=self.bytes_per_block,
            model=self.model,
            digests=found,
        )
        return FinishedHandle(handle_id, retained_bytes, handle)
