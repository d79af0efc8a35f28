"""One typed settings object for every kvplane process: every section, composed in one place.

Sources, lowest to highest precedence: defaults, a YAML file (--config or
KVPLANE_CONFIG), environment variables (KVPLANE_<SECTION>__<FIELD>, e.g.
KVPLANE_ETCD__ENDPOINTS='["10.0.0.1:2379"]'), then command-line flags.

The shared sections are `common/settings.py`'s; each service's is in its own folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvplane.services.common.settings import AuthSection, EtcdSection, GrpcSection, TelemetrySection
from kvplane.services.epp.settings import EppSection
from kvplane.services.eviction.settings import EvictionSection
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.metadata.settings import MetadataSection
from kvplane.services.routing.settings import RoutingSection
from kvplane.services.settings_errors import SettingsError, describe
from kvplane.services.sidecar.settings import SidecarSection


class KvplaneSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVPLANE_", env_nested_delimiter="__", extra="forbid")

    grpc: GrpcSection = Field(default_factory=GrpcSection)
    etcd: EtcdSection = Field(default_factory=EtcdSection)
    telemetry: TelemetrySection = Field(default_factory=TelemetrySection)
    auth: AuthSection = Field(default_factory=AuthSection)
    metadata: MetadataSection = Field(default_factory=MetadataSection)
    eviction: EvictionSection = Field(default_factory=EvictionSection)
    routing: RoutingSection = Field(default_factory=RoutingSection)
    gateway: GatewaySection = Field(default_factory=GatewaySection)
    epp: EppSection = Field(default_factory=EppSection)
    sidecar: SidecarSection = Field(default_factory=SidecarSection)

    @model_validator(mode="after")
    def _mtls_needs_a_client_ca(self) -> KvplaneSettings:
        if self.auth.mode == "mtls" and not (self.grpc.tls.cert_file and self.grpc.tls.client_ca_file):
            raise ValueError("auth.mode mtls needs grpc.tls: cert_file, key_file and client_ca_file")
        return self

    @classmethod
    def load(cls, config_file: str | None = None, overrides: dict[str, Any] | None = None) -> KvplaneSettings:
        """Defaults < file < environment < `overrides` (from flags).

        Raises SettingsError, whose message is one line, for settings that do not load.
        """
        path = config_file or os.environ.get("KVPLANE_CONFIG")
        file_values: dict[str, Any] = {}
        if path:
            try:
                loaded = yaml.safe_load(Path(path).read_text())
            except (OSError, yaml.YAMLError) as exc:
                raise SettingsError(f"settings file {path}: {' '.join(str(exc).split())}") from None
            if not isinstance(loaded, dict):
                raise SettingsError(f"settings file {path}: expected a mapping at the top level")
            file_values = loaded
        try:
            env_values = cls().model_dump(exclude_unset=True)
            merged = _merge(_merge(file_values, env_values), overrides or {})
            return cls.model_validate(merged)
        except ValidationError as exc:
            raise SettingsError(describe(exc, cls)) from None

    def masked_json(self) -> str:
        """The effective settings with secrets masked, for the start-up log."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
