"""`sidecar:` in the settings file (KVPLANE_SIDECAR__<FIELD>): the decode-side sidecar beside one
decode engine. Its legs' deadlines and body limit are the gateway's (`gateway:` section)."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator

from kvplane.services.common.settings import Section
from kvplane.services.gateway.settings import engine_url_list


class SidecarSection(Section):
    # HTTP listen address, host:port: where Envoy sends the turns the picker routed to this D
    # (llm-d's sidecar listens on the pod's port 8000, the engine beside it on 8200).
    listen: str = "127.0.0.1:8000"
    # The decode engine beside the sidecar, its base URL.
    decode_url: str = "http://127.0.0.1:8200"
    # Key of the routes' HMAC (`signed_route.py`), shared by the picker and every sidecar. Empty:
    # no route verifies, and every turn is served by D alone as a recompute.
    route_key: SecretStr = SecretStr("")
    # A signed route is accepted for this long after the picker signed it, seconds.
    route_ttl_s: float = Field(30.0, gt=0)

    @field_validator("decode_url")
    @classmethod
    def _one_url(cls, value: str) -> str:
        return engine_url_list([value])[0]
