"""`gateway:` in the settings file (KVPLANE_GATEWAY__<FIELD> in the environment): the OpenAI front,
its routing replicas and fallback engines, its limits and its keys."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from kvplane.services.common.runtime.secret_files import read_secret_file
from kvplane.services.common.settings import Section


def engine_url_list(value: Any) -> list[str]:
    """Engine base URLs from a list, a JSON list, or one string of comma-separated URLs.

    Each must be an absolute http(s) URL with a host; a malformed entry is an error naming it,
    never silently dropped (a typo would otherwise leave one engine fewer to fail over to).
    """
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"not a JSON list of URLs: {text!r} ({exc})") from None
        else:
            value = [] if not text else [part.strip() for part in text.split(",")]
    if not isinstance(value, list | tuple):
        raise ValueError(f"expected a URL, a list of URLs or comma-separated URLs, got {value!r}")
    urls: list[str] = []
    for entry in value:
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"empty or non-string entry {entry!r} in the URL list {value!r}")
        url = entry.strip()
        try:
            parts = urlsplit(url)
            port = parts.port  # raises on a port that is not a number in range
        except ValueError as exc:
            raise ValueError(f"{url!r} is not a valid URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s) URL with a host (e.g. http://10.0.0.5:8100)")
        if parts.query or parts.fragment or port == 0:
            raise ValueError(f"{url!r} is not an engine base URL (no query, fragment or port 0)")
        if url.rstrip("/") in (u.rstrip("/") for u in urls):
            raise ValueError(f"{url!r} is listed twice")
        urls.append(url)
    return urls


class GatewayKey(Section):
    token: SecretStr
    tenant: str


class GatewaySection(Section):
    # HTTP listen address of the OpenAI-compatible front, host:port.
    listen: str = "127.0.0.1:8080"
    # Routing service replicas, host:port each.
    routing: list[str] = Field(default_factory=lambda: ["127.0.0.1:50051"])
    # Routing in the gateway's own process (`colocated_routing.py`): the gateway is itself a
    # routing replica, fed by etcd (`etcd`) and by the engines' streams on `grpc.listen`, and
    # routes its turns without a gRPC hop; `routing` and the routing_* credentials go unused.
    # It needs `auth`, as `kvplane serve` does: the engines' streams are authenticated.
    routing_in_process: bool = False
    # Credentials the gateway presents to routing (`kvplane.services.gateway.app.routing_credentials`):
    # an operator token (or a file holding it); TLS to routing with its CA, and a client certificate
    # for mTLS.
    routing_token: SecretStr = SecretStr("")
    routing_token_file: str = ""
    routing_tls_ca_file: str = ""
    routing_tls_cert_file: str = ""
    routing_tls_key_file: str = ""
    routing_tls_server_name: str = ""

    # A Route's whole deadline, seconds. Above routing's check-out timeout (1 s): a Route cut short
    # may already have taken the handle.
    routing_timeout_s: float = Field(2.0, gt=0)
    # A routing replica silent this long has its health checked (a frozen process still accepts
    # TCP, so only a deadline tells), and the Route goes to the next replica as well, first answer
    # wins (hedging covers speed). Seconds.
    routing_hedge_after_s: float = Field(0.2, gt=0)
    # The health check's deadline: it judges liveness, not speed. A replica that is refused or
    # errs is suspect at once; one that stays silent this long is frozen or gone, and is skipped
    # by every later turn until it answers (with none left, turns fall back at once). A replica
    # that is only busy answers within it. Seconds.
    routing_liveness_timeout_s: float = Field(2.0, gt=0)
    routing_attempts: int = Field(2, ge=1)
    # API keys clients present (Authorization: Bearer, or x-api-key), each mapped to its tenant.
    api_keys: list[GatewayKey] = Field(default_factory=list)
    # More API keys, from a file holding a JSON or YAML list of {token, tenant} (a Kubernetes
    # Secret volume), read again when it changes: keys are added, rotated and revoked without a
    # restart.
    api_keys_file: str = ""
    # Development only: the tenant of requests that carry no key at all. Empty: such requests get 401.
    default_tenant: str = ""
    # Used while routing is unreachable: engines that recompute every turn, P and D each a list of
    # base URLs (a YAML list, or one string of comma-separated URLs, e.g. from the environment).
    # Turns rotate over each list. Both empty: 503. One URL each: the single fallback pair.
    fallback_prefill_url: Annotated[list[str], NoDecode] = Field(default_factory=list)
    fallback_decode_url: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # A fallback engine whose leg just failed (refused, reset, timed out) is skipped for this long
    # while another is configured, seconds; then tried again.
    fallback_suspect_s: float = Field(5.0, gt=0)

    @field_validator("fallback_prefill_url", "fallback_decode_url", mode="before")
    @classmethod
    def _url_list(cls, value: Any) -> Any:
        return engine_url_list(value)

    @model_validator(mode="after")
    def _fallback_engines_in_pairs(self) -> GatewaySection:
        if bool(self.fallback_prefill_url) != bool(self.fallback_decode_url):
            raise ValueError(
                "fallback_prefill_url and fallback_decode_url go together: set both (a turn needs a "
                "P and a D) or neither"
            )
        return self

    @model_validator(mode="after")
    def _one_salt_key_source(self) -> GatewaySection:
        if self.cache_salt_key.get_secret_value() and self.cache_salt_key_file:
            raise ValueError("set cache_salt_key or cache_salt_key_file, not both")
        return self

    def salt_key(self) -> str:
        """The cache-salt key: `cache_salt_key`, or the content of `cache_salt_key_file`."""
        if self.cache_salt_key_file:
            return read_secret_file(self.cache_salt_key_file, "gateway.cache_salt_key_file")
        return self.cache_salt_key.get_secret_value()

    # The gateway's event loop: on uvloop (libuv) a turn took about a sixth less of the gateway's CPU
    # than on asyncio's own loop (kvplane.bench.gateway_bench); `asyncio` is there to rule it out.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    # Let routing send a turn to the D that holds its conversation's KV alone, with no P leg
    # (decision prefill_on_decode; routing's policy says when: `prefill_on_decode` there, which
    # weighs what the turn saves against what its prefill adds to the answers streaming from D).
    # Off: every turn goes through P, as on engines whose D must never prefill.
    prefill_on_decode: bool = True
    # Deadlines of the engine legs, seconds. The decode leg's idle limit applies between chunks.
    prefill_timeout_s: float = Field(30.0, gt=0)
    decode_timeout_s: float = Field(600.0, gt=0)
    decode_idle_timeout_s: float = Field(60.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    report_timeout_s: float = Field(2.0, gt=0)
    # An engine base URL offering vLLM's /tokenize, for the token ids of text prompts. Empty: none.
    tokenize_url: str = ""
    # Served model name -> a local directory of that model's tokenizer files (what vLLM loads:
    # tokenizer.json, tokenizer_config.json, the chat template): the gateway then tokenizes that
    # model's text and chat prompts in its own process, as vLLM does, instead of asking
    # `tokenize_url` on every turn (`local_tokenizer.py`; needs kvplane's tokenizer extra). A
    # directory that cannot be loaded stops the gateway at start. Empty: every model asks the engine.
    tokenizers: dict[str, str] = Field(default_factory=dict)
    # Served model names for /v1/models. Empty: asks the fallback decode engine, if any.
    models: list[str] = Field(default_factory=list)
    # Largest request body accepted, bytes: refused from Content-Length before reading, and while
    # reading. 0: sized from max_model_len, 32 bytes a token of context (a prompt at the context
    # length as token ids or JSON-escaped text) plus 1 MiB for the rest of the body; 16 MiB while
    # max_model_len is unknown. Set it for bodies that carry more (images as data URLs).
    max_body_bytes: int = Field(0, ge=0)
    # A request head (request line and headers) must arrive within this, seconds; also the idle
    # keep-alive limit of a client connection.
    header_timeout_s: float = Field(10.0, gt=0)
    # A request body must arrive within this once its head is in, seconds.
    body_timeout_s: float = Field(30.0, gt=0)
    # Deepest nesting of JSON arrays and objects accepted in a body.
    max_json_depth: int = Field(32, ge=2)
    # Most JSON values (numbers, strings, arrays, objects) a body may hold, counted before it is
    # parsed, so that no body costs more to parse than a prompt at the context length. 0: twice
    # max_model_len plus 65,536 (twice 2^20 plus 65,536 while max_model_len is unknown).
    max_json_values: int = Field(0, ge=0)
    # The engines' vocabulary size, to refuse out-of-range token ids up front; 0: unknown (ids < 2^32).
    vocab_size: int = Field(0, ge=0)
    # The engines' context length in tokens, to refuse up front what D would reject; 0: unknown.
    max_model_len: int = Field(0, ge=0)
    # Top-level body fields forwarded to the engines besides those vLLM 0.32 and 0.33 accept on
    # the endpoint (`engine_fields.py`), for engines with extensions that read more. Every other
    # field is dropped before a turn's legs, counted in kvplane_gateway_dropped_fields_total (the
    # names at debug level). `kv_transfer_params` is removed whatever this says. Empty: none.
    pass_through_fields: list[str] = Field(default_factory=list)
    # vLLM's prefix-cache isolation (`cache_salt`): "tenant" (each tenant its own cache), "group"
    # (tenants in one `tenant_groups` group share theirs) or "off" (one cache for all: timing then
    # tells one tenant what another recently sent).
    cache_salt: Literal["tenant", "group", "off"] = "tenant"
    # Key of the salt's HMAC, so that a salt names no tenant. Gateways sharing engines must share
    # it, else each salts differently and their turns miss each other's cache. Empty: random.
    cache_salt_key: SecretStr = SecretStr("")
    # A file holding that key instead (a Secret volume), read at start-up; not both.
    cache_salt_key_file: str = ""
    # Tenant -> group name, for cache_salt "group"; a tenant in no group is alone.
    tenant_groups: dict[str, str] = Field(default_factory=dict)
    # Most prompt tokens one tenant may have in flight at once: a bound on the KV its turns hold on
    # any engine between the P and D legs. 0: unbounded.
    max_inflight_tokens_per_tenant: int = Field(1 << 20, ge=0)
    # Most request-body bytes one tenant may have being read and parsed at once, counted by each
    # body's Content-Length (a body without one counts as max_body_bytes): past it a request is
    # refused (429) before its body is read, so one tenant's bodies cannot fill the memory of the
    # gateway or the picker, or queue up every other tenant's parses behind theirs. 0: four times
    # the body limit.
    max_body_bytes_per_tenant: int = Field(0, ge=0)
    # HTTPS: the server certificate and its key (PEM files, re-read when they change). Empty: HTTP.
    tls_cert_file: str = ""
    tls_key_file: str = ""
