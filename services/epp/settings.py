"""`epp:` in the settings file (KVPLANE_EPP__<FIELD>): the endpoint picker. What it shares with the
gateway (routing and its credentials, API keys, body limits, cache salts, tenant shares, fallback
engines) is the `gateway:` section's; the routes' signing key is `sidecar.route_key`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvplane.services.common.settings import Section


class EppSection(Section):
    # gRPC listen address of the ext_proc service (and its health service), host:port; 9002 is
    # the Gateway API Inference Extension's default.
    listen: str = "127.0.0.1:9002"
    # Where a request's tenant comes from: "api_key" (the gateway's API keys, checked by the picker
    # from the request's headers, before its body is read), or "header" (`tenant_header`, set by
    # the gateway's own auth filter; the gateway must remove any copy the client sent, since the
    # picker cannot tell them apart).
    tenant_source: Literal["api_key", "header"] = "api_key"
    tenant_header: str = "x-kvplane-tenant"
    # Where each decode engine's sidecar listens: on the engine's host at `sidecar_port` (one port
    # for every decode pod, as llm-d's sidecar uses 8000), unless `sidecars` names the engine's base
    # URL (e.g. http://10.0.0.5:8200) with the sidecar's host:port.
    sidecar_port: int = Field(8000, ge=1, le=65535)
    sidecars: dict[str, str] = Field(default_factory=dict)
    # Bytes per body chunk the picker sends back to Envoy (llm-d's picker uses 62000).
    body_chunk_bytes: int = Field(62_000, ge=1024)
    # Routes tried before a subset hint that names none of routing's choices is answered 503.
    subset_attempts: int = Field(3, ge=1)
    # HTTP listen address, host:port, of the answer endpoint: the sidecars report D's answers there
    # (`answers.py`), so Envoy's ext_proc filter need send the picker no response body
    # (`response_body_mode: NONE`, `response_trailer_mode: SKIP`). Empty: the picker reads D's
    # answers from Envoy's response phase (FULL_DUPLEX_STREAMED: every chunk through the picker).
    answers_listen: str = ""
    # The answer endpoint's base URL as the sidecars reach it (e.g. http://$(POD_IP):9003); empty:
    # http://<answers_listen> (whose host must then be an address the sidecars reach).
    answers_url: str = ""
