"""Settings of one simulated engine, from flags and KVPLANE_SIM_* environment variables."""

from __future__ import annotations

import argparse
import dataclasses
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvplane.connector.kv_events.source import KVEventsSource
from kvplane.connector.kv_events.vllm_config import local_source
from kvplane.connector.simengine.kv_events_config import KVEventsConfig
from kvplane.connector.simengine.side_channel import normalize_host
from kvplane.connector.simengine.timing_model import TimingModel
from kvplane.services.client.credentials import ClientCredentials
from kvplane.services.common.model.block_hashes import HASH_ALGOS

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")


@dataclass(frozen=True)
class SimEngineSettings:
    """Everything one sim-engine process needs. Times in seconds, sizes in bytes or tokens."""

    role: Role = "both"
    # vLLM's engine id, as it appears in remote_engine_id. Empty: a fresh one per start.
    engine_id: str = ""
    model: str = "kvplane-sim"
    http_host: str = "127.0.0.1"
    http_port: int = 8100
    side_channel_host: str = "127.0.0.1"
    # 0 picks a free port (the start-up line and /sim/state report it).
    side_channel_port: int = 5600
    # The address others reach this engine at (HTTP URL and remote_host) when it binds a
    # wildcard such as 0.0.0.0 in a container; empty: the bind hosts themselves.
    advertise_host: str = ""
    block_size: int = 16
    num_blocks: int = 4096
    bytes_per_block: int = 16384
    # The host tier: blocks of host memory, registered with NIXL beside the KV cache, that D
    # moves retained handles to when a request finds too few free blocks, instead of waiting
    # for the control plane to release them (0: no host tier).
    host_kv_blocks: int = 0
    # How fast a handle's blocks are copied to the host tier (the modelled device-to-host copy):
    # 25 GB/s, about what PCIe 4.0 x16 (32 GB/s) carries after protocol overhead.
    host_copy_bytes_per_s: float = 25e9
    # How long after its turn ended a handle moved to the host tier stays offered, seconds (never
    # less than D's TTL would have kept it): host memory is cheap enough to keep a conversation
    # through its longer gaps, and the tier's own size bounds it (the simulator's
    # `decode_host_ttl_s`).
    host_kv_ttl_s: float = 3600.0
    # Whether D copies each handle to the host tier as it keeps it (off every request's path, as
    # vLLM's OffloadingConnector stores blocks as they fill), so that a move frees its cache
    # blocks at once; false: the copy starts only when a move is wanted, and the blocks wait for it.
    host_copy_ahead: bool = True
    # How long a move waits for the control plane to store its relocation before D frees the
    # handle's cache blocks anyway, seconds: a turn that checked the handle out meanwhile then
    # fails their check and recomputes (safe), and an unreachable control plane never holds D's
    # memory. A relocation refused after that frees the handle (nobody can find it in the tier).
    relocation_wait_s: float = 2.0
    # How long D keeps a finished turn's blocks (vLLM's decoder_kv_blocks_ttl).
    decoder_kv_blocks_ttl: float = 480.0
    # How long P keeps blocks for D's read before freeing them anyway.
    prefill_lease_s: float = 30.0
    kv_recompute_threshold: int = 64
    # P declines a pull this close to D's expiry (vLLM's 5 s gate).
    expiry_guard_s: float = 5.0
    bidirectional: bool = True
    # vLLM's --enable-prefix-caching. Off, P keeps no history between turns, so it pulls every
    # token D holds instead of only D's tail beyond its own cache.
    enable_prefix_caching: bool = True
    # vLLM's --kv-events-config (kv_events_config.py): KV-cache events on ZMQ; off by default.
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    # vLLM's --prefix-caching-hash-algo: how the block hashes in those events are computed.
    prefix_caching_hash_algo: str = "sha256"
    timing: TimingModel = field(default_factory=TimingModel)
    seed: int = 0
    eos_probability: float = 0.0
    vocab_size: int = 151_936
    max_model_len: int = 32_768
    default_max_tokens: int = 16
    # Chat answers open with <think>, this many reasoning tokens, </think> (0: no reasoning).
    # A request turns it off with chat_template_kwargs {"enable_thinking": false}, as Qwen3 does.
    reasoning_tokens: int = 0
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 10.0
    # How long a request waits for free KV blocks before failing with 503.
    kv_wait_timeout_s: float = 30.0
    # Free blocks the engine asks the control plane to keep, on top of what waiting requests
    # need (0: ask only for waiting requests; memory is then released on demand, never ahead).
    kv_free_watermark_blocks: int = 0
    # host:port of kvplane's metadata service; set, the engine registers through the node agent.
    control_plane: str = ""
    # host:port of kvplane's eviction service; empty: the control-plane address (`serve all`).
    eviction: str = ""
    # Routing replicas (host:port, comma-separated) the node agent streams this engine's load to,
    # and its prefix cache from its KV events (--kv-events-config); empty: neither is streamed.
    routing: str = ""
    # Node id registered with the control plane; empty: the engine id.
    node_id: str = ""
    # Behave like vLLM with kvplane's connector module: digests on D's handles, prefix check on P.
    # Implied by control_plane; off, the engine is a plain vLLM NixlConnector.
    kvplane_connector: bool = False
    # With the connector: refuse (recompute) a pull whose handle carries no digests.
    require_digests: bool = True
    # Subtracted from D's deadline when a handle's wall-clock expiry is published (seconds).
    expiry_margin_s: float = 1.0
    # Seconds between samples of the engine's load; a change is reported this soon.
    load_interval_s: float = 0.5
    # Longest gap between two load reports while the load does not change, seconds.
    load_heartbeat_s: float = 10.0
    # Longest wait of a report that P read a retained handle's blocks for a publish to go with
    # (the node agent's `release_linger_s`); 0: reported at once, on its own.
    release_linger_s: float = 5.0
    # Credentials the node agent presents to the control plane (kvplane.services.client.credentials):
    # a bearer token or a file holding it; TLS: the servers' CA, and a client certificate for
    # mTLS; a mesh secret only where no mesh proxy adds it (development).
    auth_token: str = field(default="", repr=False)
    auth_token_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""
    mesh_secret: str = field(default="", repr=False)
    mesh_secret_file: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        for name in ("block_size", "num_blocks", "vocab_size", "max_model_len", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.host_kv_blocks < 0 or self.host_copy_bytes_per_s <= 0 or self.host_kv_ttl_s < 0:
            raise ValueError(
                "host_kv_blocks and host_kv_ttl_s must be non-negative and host_copy_bytes_per_s positive"
            )
        if self.release_linger_s < 0:
            raise ValueError("release_linger_s must not be negative")
        if self.relocation_wait_s <= 0:
            raise ValueError("relocation_wait_s must be positive")
        if self.kv_recompute_threshold < 0 or self.expiry_guard_s < 0 or self.reasoning_tokens < 0:
            raise ValueError(
                "kv_recompute_threshold, expiry_guard_s and reasoning_tokens must be non-negative"
            )
        if self.decoder_kv_blocks_ttl <= 0 or self.prefill_lease_s <= 0:
            raise ValueError("decoder_kv_blocks_ttl and prefill_lease_s must be positive")
        if not 0 <= self.http_port < 65536 or not 0 <= self.side_channel_port < 65536:
            raise ValueError("ports must be within 0..65535")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}")
        self.kv_events_source()  # refuses events its node agent could not read
        object.__setattr__(self, "side_channel_host", normalize_host(self.side_channel_host))
        object.__setattr__(self, "http_host", normalize_host(self.http_host))
        object.__setattr__(self, "advertise_host", normalize_host(self.advertise_host))

    def credentials(self) -> ClientCredentials:
        """What the node agent presents to the control plane."""
        return ClientCredentials(
            token=self.auth_token,
            token_file=self.auth_token_file,
            tls_ca_file=self.tls_ca_file,
            tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file,
            tls_server_name=self.tls_server_name,
            mesh_secret=self.mesh_secret,
            mesh_secret_file=self.mesh_secret_file,
        )

    def kv_events_source(self) -> KVEventsSource | None:
        """Where the node agent reads this engine's KV events, and how it predicts their hashes
        (the seed as vLLM resolves it, from this process's PYTHONHASHSEED); None when the engine
        publishes none (events or prefix caching off)."""
        events = self.kv_events_config
        if not events.enabled or not self.enable_prefix_caching:
            return None
        return local_source(
            events.endpoint,
            events.replay_endpoint,
            topic=events.topic,
            block_size=self.block_size,
            hash_algo=self.prefix_caching_hash_algo,
        )

    @property
    def advertised_side_channel_host(self) -> str:
        return self.advertise_host or self.side_channel_host

    @property
    def advertised_http_host(self) -> str:
        return self.advertise_host or self.http_host

    def resolved_engine_id(self) -> str:
        return self.engine_id or f"sim-{self.role}-{uuid.uuid4().hex[:12]}"

    def argv(self) -> list[str]:
        """The sim-engine's flags for these settings: those that differ from the defaults, as its
        parser (`build_arg_parser`) reads them back (the KVPLANE_SIM_* environment, where set, fills
        in the rest). Every command line that starts a sim-engine
        (`kvplane sim-engine ...`, `python -m kvplane.connector.simengine ...`) is built here.

        Secrets set here go on the command line, where other local users may read them: prefer
        `auth_token_file` and `mesh_secret_file`, or the KVPLANE_SIM_* environment.
        """
        defaults = SimEngineSettings()
        out: list[str] = []
        # The parser owns the flags' spelling; argparse lists its actions only in `_actions`.
        for action in build_arg_parser(env={})._actions:
            if not action.option_strings or action.dest == "help":
                continue
            value, default = _setting(self, action.dest), _setting(defaults, action.dest)
            if value == default:
                continue
            if isinstance(action, argparse.BooleanOptionalAction):
                out.append(action.option_strings[0 if value else 1])
            else:
                out += [action.option_strings[0], str(value)]
        return out

    def describe(self) -> str:
        """One line per setting, for the start-up log (nothing here is secret)."""
        lines = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            shown = ("'***'" if value else "''") if f.name in SECRET_FIELDS else repr(value)
            lines.append(f"  {f.name} = {shown}")
        return "\n".join(lines)


def _setting(settings: SimEngineSettings, dest: str) -> Any:
    """A flag's value: a field of the settings, or of their timing model."""
    return getattr(settings.timing, dest) if dest in _TIMING_FIELDS else getattr(settings, dest)


_TIMING_FIELDS = frozenset(f.name for f in dataclasses.fields(TimingModel))
# Never printed.
SECRET_FIELDS = frozenset({"auth_token", "mesh_secret"})
ENV_PREFIX = "KVPLANE_SIM_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


class SettingsError(ValueError):
    """A setting from the environment cannot be understood."""


def _env_defaults(env: Mapping[str, str]) -> dict[str, Any]:
    """KVPLANE_SIM_<FLAG> variables (``--decoder-kv-blocks-ttl``: KVPLANE_SIM_DECODER_KV_BLOCKS_TTL)."""
    d = SimEngineSettings()
    dests = [f.name for f in dataclasses.fields(d) if f.name != "timing"]
    dests += [f.name for f in dataclasses.fields(d.timing)]
    out: dict[str, Any] = {}
    for dest in dests:
        raw = env.get(ENV_PREFIX + dest.upper())
        if raw is None:
            continue
        current = getattr(d, dest, None)
        if isinstance(current, bool):
            if raw.strip().lower() not in _TRUE | _FALSE:
                raise SettingsError(f"{ENV_PREFIX}{dest.upper()} must be a boolean, not {raw!r}")
            out[dest] = raw.strip().lower() in _TRUE
        else:
            out[dest] = raw  # argparse converts string defaults with the flag's type
    return out


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.parse(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# What each flag of `kvplane sim-engine` sets, where its own add_argument says nothing.
FLAG_HELP: dict[str, str] = {
    "role": "prefill, decode, or both (P and D in one engine)",
    "model": "the model name it serves (and /v1/models lists)",
    "http_host": "address of the OpenAI-compatible HTTP server",
    "http_port": "port of the HTTP server",
    "side_channel_host": "address of the NIXL side channel (handshakes)",
    "side_channel_port": "port of the NIXL side channel; 0: a free one",
    "num_blocks": "KV-cache blocks of the engine",
    "host_kv_blocks": "host-tier blocks: D moves retained handles there when requests need blocks (0: none)",
    "host_copy_bytes_per_s": "modelled copy rate of a handle's blocks to the host tier, bytes per second",
    "host_kv_ttl_s": "seconds after its turn a handle moved to the host tier is offered (at least D's TTL)",
    "host_copy_ahead": "copy each handle to the host tier as it is kept, so a move need not wait for a copy",
    "relocation_wait_s": "seconds a move waits for its relocation to be stored; then D frees the blocks",
    "bytes_per_block": "bytes of KV per block (what a pull moves over NIXL)",
    "decoder_kv_blocks_ttl": "seconds D keeps a finished turn's blocks (vLLM's decoder_kv_blocks_ttl)",
    "prefill_lease_s": "seconds P keeps blocks for D's read before freeing them anyway",
    "kv_recompute_threshold": "fewer tokens than this are recomputed rather than pulled (vLLM's threshold)",
    "expiry_guard_s": "P declines a pull this close to D's expiry, seconds (vLLM's 5 s gate)",
    "bidirectional": "D retains a finished turn's KV for P to pull (vLLM's bidirectional_kv_xfer)",
    "enable_prefix_caching": "vLLM's prefix cache on P; off, P keeps no history between turns",
    "prefix_caching_hash_algo": "vLLM's --prefix-caching-hash-algo: the block hashes of the KV events",
    "prefill_base_s": "modelled prefill time of a prompt, fixed part, seconds (Qwen3-32B on H100)",
    "prefill_per_token_s": "modelled prefill time per computed token, seconds",
    "prefill_per_token_sq_s": "modelled prefill time per computed token squared, seconds",
    "decode_step_s": "modelled decode step, seconds",
    "decode_step_per_running_s": "added to a decode step per running request, seconds",
    "seed": "seed of the generated tokens",
    "eos_probability": "chance a generated token ends the answer early (0: answers run to max_tokens)",
    "vocab_size": "token ids are below this",
    "max_model_len": "longest prompt plus output, tokens",
    "default_max_tokens": "output tokens of a request that names no max_tokens",
    "handshake_timeout_s": "seconds a NIXL handshake may take",
    "transfer_timeout_s": "seconds a NIXL read may take",
    "kv_wait_timeout_s": "seconds a request waits for free KV blocks before a 503",
    "kv_free_watermark_blocks": "free blocks asked of the control plane beyond what waiting requests need",
    "node_id": "node id registered with kvplane (default: the engine id)",
    "kvplane_connector": "behave as vLLM with kvplane's connector: digests on D, prefix check on P "
    "(implied by --control-plane)",
    "require_digests": "with the connector: recompute rather than pull a handle without digests",
    "expiry_margin_s": "taken off D's deadline in a published handle's expiry, seconds",
    "load_interval_s": "seconds between samples of the engine's load",
    "load_heartbeat_s": "longest gap between two load reports of an unchanged load, seconds",
    "release_linger_s": "longest wait of the report that P read a handle for a publish to go with, seconds "
    "(0: at once)",
    "mesh_secret_file": "file holding the mesh proxy secret (development only)",
}


def _add_credential_flags(p: argparse.ArgumentParser, d: SimEngineSettings) -> None:
    """What the node agent presents to the control plane."""
    p.add_argument(
        "--auth-token", default=d.auth_token, help="bearer token for the control plane (prefer the file)"
    )
    p.add_argument("--auth-token-file", default=d.auth_token_file, help="file holding the bearer token")
    p.add_argument("--tls-ca-file", default=d.tls_ca_file, help="CA of the control plane's certificates")
    p.add_argument("--tls-cert-file", default=d.tls_cert_file, help="client certificate (mTLS)")
    p.add_argument("--tls-key-file", default=d.tls_key_file, help="client certificate's key (mTLS)")
    p.add_argument("--tls-server-name", default=d.tls_server_name, help="name to check the server against")
    p.add_argument("--mesh-secret", default=d.mesh_secret, help="mesh proxy secret (development only)")
    p.add_argument("--mesh-secret-file", default=d.mesh_secret_file)


def _describe(parser: argparse.ArgumentParser) -> None:
    """Every flag says what it sets and its default (%(default)s, an environment value included)."""
    for action in parser._actions:
        if action.dest == "help":
            continue
        text = action.help or FLAG_HELP.get(action.dest, "")
        secret = action.dest in ("auth_token", "mesh_secret")  # never printed, even from the environment
        if not secret and "default" not in text and action.default not in (None, "", argparse.SUPPRESS):
            text = f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        action.help = text.replace("%", "%%").replace("%%(default)s", "%(default)s")


def build_arg_parser(
    parser: argparse.ArgumentParser | None = None, env: Mapping[str, str] | None = None
) -> argparse.ArgumentParser:
    """Flags of `kvplane sim-engine`; pass a subparser to add them to it.

    Each flag's default can come from the environment as KVPLANE_SIM_<FLAG>; a flag wins.
    """
    p = parser or argparse.ArgumentParser(
        prog="kvplane sim-engine", description="Simulated vLLM engine with real NIXL"
    )
    d = SimEngineSettings()
    t = d.timing
    p.add_argument("--role", choices=ROLES, default=d.role)
    p.add_argument("--engine-id", default=d.engine_id, help="default: a fresh id per start")
    p.add_argument("--model", default=d.model)
    p.add_argument("--host", dest="http_host", default=d.http_host)
    p.add_argument("--port", dest="http_port", type=int, default=d.http_port)
    p.add_argument("--side-channel-host", default=d.side_channel_host)
    p.add_argument("--side-channel-port", type=int, default=d.side_channel_port)
    p.add_argument(
        "--advertise-host", default=d.advertise_host, help="address peers use (default: bind hosts)"
    )
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per block")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks)
    p.add_argument("--host-kv-blocks", type=int, default=d.host_kv_blocks)
    p.add_argument("--host-copy-bytes-per-s", type=float, default=d.host_copy_bytes_per_s)
    p.add_argument("--host-kv-ttl-s", type=float, default=d.host_kv_ttl_s)
    p.add_argument("--host-copy-ahead", action=argparse.BooleanOptionalAction, default=d.host_copy_ahead)
    p.add_argument("--relocation-wait-s", type=float, default=d.relocation_wait_s)
    p.add_argument("--bytes-per-block", type=int, default=d.bytes_per_block)
    p.add_argument("--decoder-kv-blocks-ttl", type=float, default=d.decoder_kv_blocks_ttl)
    p.add_argument("--prefill-lease-s", type=float, default=d.prefill_lease_s)
    p.add_argument("--kv-recompute-threshold", type=int, default=d.kv_recompute_threshold)
    p.add_argument("--expiry-guard-s", type=float, default=d.expiry_guard_s)
    p.add_argument("--bidirectional", action=argparse.BooleanOptionalAction, default=d.bidirectional)
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching
    )
    p.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=d.kv_events_config,
        help="vLLM's KV event publisher, as JSON (vLLM's keys, plus encoding: map or array)",
    )
    p.add_argument("--prefix-caching-hash-algo", choices=HASH_ALGOS, default=d.prefix_caching_hash_algo)
    p.add_argument("--prefill-base-s", type=float, default=t.prefill_base_s)
    p.add_argument("--prefill-per-token-s", type=float, default=t.prefill_per_token_s)
    p.add_argument("--prefill-per-token-sq-s", type=float, default=t.prefill_per_token_sq_s)
    p.add_argument("--decode-step-s", type=float, default=t.decode_step_s)
    p.add_argument("--decode-step-per-running-s", type=float, default=t.decode_step_per_running_s)
    p.add_argument("--speedup", type=float, default=t.speedup, help="divide all modelled times by this")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eos-probability", type=float, default=d.eos_probability)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument("--reasoning-tokens", type=int, default=d.reasoning_tokens, help="chat reasoning length")
    p.add_argument("--handshake-timeout-s", type=float, default=d.handshake_timeout_s)
    p.add_argument("--transfer-timeout-s", type=float, default=d.transfer_timeout_s)
    p.add_argument("--kv-wait-timeout-s", type=float, default=d.kv_wait_timeout_s)
    p.add_argument("--kv-free-watermark-blocks", type=int, default=d.kv_free_watermark_blocks)
    p.add_argument("--control-plane", default=d.control_plane, help="metadata service host:port")
    p.add_argument("--eviction", default=d.eviction, help="eviction host:port (default: --control-plane)")
    p.add_argument(
        "--routing",
        default=d.routing,
        help="routing replicas host:port[,host:port] the node agent streams this engine's load to, and "
        "its prefix cache from its KV events (default: none)",
    )
    p.add_argument("--node-id", default=d.node_id)
    p.add_argument("--kvplane-connector", action=argparse.BooleanOptionalAction, default=d.kvplane_connector)
    p.add_argument("--require-digests", action=argparse.BooleanOptionalAction, default=d.require_digests)
    p.add_argument("--expiry-margin-s", type=float, default=d.expiry_margin_s)
    p.add_argument("--load-interval-s", type=float, default=d.load_interval_s)
    p.add_argument("--load-heartbeat-s", type=float, default=d.load_heartbeat_s)
    p.add_argument("--release-linger-s", type=float, default=d.release_linger_s)
    _add_credential_flags(p, d)
    p.set_defaults(**_env_defaults(os.environ if env is None else env))
    _describe(p)
    return p


def settings_from_args(ns: argparse.Namespace) -> SimEngineSettings:
    timing = TimingModel(
        prefill_base_s=ns.prefill_base_s,
        prefill_per_token_s=ns.prefill_per_token_s,
        prefill_per_token_sq_s=ns.prefill_per_token_sq_s,
        decode_step_s=ns.decode_step_s,
        decode_step_per_running_s=ns.decode_step_per_running_s,
        speedup=ns.speedup,
    )
    names = {f.name for f in dataclasses.fields(SimEngineSettings)} - {"timing"}
    return SimEngineSettings(timing=timing, **{n: getattr(ns, n) for n in names})


def parse_settings(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> SimEngineSettings:
    return settings_from_args(build_arg_parser(env=env).parse_args(argv))
