"""TLS and mTLS on the control plane's gRPC servers, with certificates made by a test CA:
the client certificate names the principal, a certificate from another CA is refused, rotated
certificates are served without a restart, and a sim-engine's node agent registers over mTLS."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from kvplane.services.client.credentials import ClientCredentials
from kvplane.services.common.model import convert
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import make_node
from tests.support.certificates import Issued, TestCa
from tests.support.deploy_validators import ROOT, is_kvplane_workload, load_deploy_checks
from tests.support.polling import eventually
from tests.support.simengine import engines, free_port, sim
from tests.support.trust import all_methods, plane_settings, raw_call, raw_channel, start_plane, target


@pytest.fixture
def ca(tmp_path: Path) -> TestCa:
    return TestCa(tmp_path / "ca")


@pytest.fixture
def server_cert(ca: TestCa) -> Issued:
    return ca.issue("server", server=True)


def _tls(ca: TestCa, server_cert: Issued) -> dict[str, object]:
    return {
        "tls": {
            "cert_file": server_cert.cert_file,
            "key_file": server_cert.key_file,
            "client_ca_file": ca.ca_file,
        }
    }


@pytest.fixture
async def mtls_plane(
    etcd: LocalEtcd, prefix: str, ca: TestCa, server_cert: Issued
) -> AsyncIterator[ServiceProcess]:
    settings = plane_settings(etcd, prefix, {"mode": "mtls"}, grpc=_tls(ca, server_cert))
    process = await start_plane(settings)
    try:
        yield process
    finally:
        await process.stop()


def _client(ca_file: str, issued: Issued | None = None) -> ClientCredentials:
    return ClientCredentials(
        tls_ca_file=ca_file,
        tls_cert_file=issued.cert_file if issued else "",
        tls_key_file=issued.key_file if issued else "",
        tls_server_name="localhost",
    )


async def _register(creds: ClientCredentials, address: str, node_id: str) -> grpc.StatusCode:
    async with creds.channel(address) as channel:
        try:
            await metadata_pb2_grpc.MetadataServiceStub(channel).RegisterNode(
                metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(make_node(node_id)), lease_ttl_s=30),
                timeout=5,
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_the_client_certificate_names_the_principal(mtls_plane: ServiceProcess, ca: TestCa) -> None:
    d0 = _client(ca.ca_file, ca.issue("node-d0", uris=("kvplane://node/d0",)))
    assert await _register(d0, target(mtls_plane), "d0") == grpc.StatusCode.OK
    # The certificate binds the node id: d0's certificate cannot register d1.
    assert await _register(d0, target(mtls_plane), "d1") == grpc.StatusCode.PERMISSION_DENIED
    ops = _client(ca.ca_file, ca.issue("ops", uris=("kvplane://operator/ops",)))
    async with ops.channel(target(mtls_plane)) as channel:
        nodes = await metadata_pb2_grpc.MetadataServiceStub(channel).ListNodes(
            metadata_pb2.ListNodesRequest()
        )
    assert [n.node.node_id for n in nodes.nodes] == ["d0"]


async def test_a_certificate_with_two_kvplane_identities_is_refused_whatever_their_order(
    mtls_plane: ServiceProcess, ca: TestCa
) -> None:
    # Which identity counted used to be the first one listed: an operator before a node won.
    for uris in (
        ("kvplane://operator/evil", "kvplane://node/d0"),
        ("kvplane://node/d0", "kvplane://operator/evil"),
    ):
        two = _client(ca.ca_file, ca.issue("two-ids", uris=uris))
        assert await _register(two, target(mtls_plane), "d0") == grpc.StatusCode.UNAUTHENTICATED


async def test_an_escaped_or_wildcard_name_in_a_certificate_names_nobody(
    mtls_plane: ServiceProcess, ca: TestCa
) -> None:
    # `d%2A` used to decode to the wildcard `d*`, which covered node d1; `%00` and `%2F` passed too.
    for uri in ("kvplane://node/d%2A", "kvplane://node/d*", "kvplane://node/d%00", "kvplane://node/d%2F1"):
        bad = _client(ca.ca_file, ca.issue("bad-name", uris=(uri,)))
        assert await _register(bad, target(mtls_plane), "d1") == grpc.StatusCode.UNAUTHENTICATED, uri


async def test_a_certificate_from_another_ca_or_none_at_all_is_refused(
    mtls_plane: ServiceProcess, ca: TestCa, tmp_path: Path
) -> None:
    other = TestCa(tmp_path / "other-ca", name="other-ca")
    forged = ca.ca_file, other.issue("forged-ops", uris=("kvplane://operator/ops",))
    for creds in (_client(forged[0], forged[1]), _client(ca.ca_file)):
        # The handshake fails: the call never reaches a method.
        assert await _register(creds, target(mtls_plane), "d0") == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(target(mtls_plane)) as plaintext:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await metadata_pb2_grpc.MetadataServiceStub(plaintext).ListNodes(
                metadata_pb2.ListNodesRequest(), timeout=5
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # A certificate of this CA that names no kvplane principal authenticates nobody.
    nobody = _client(ca.ca_file, ca.issue("nobody", uris=("spiffe://elsewhere/workload",)))
    with raw_channel(target(mtls_plane), nobody) as channel:
        for service, method in all_methods():
            outcome = await raw_call(channel, service, method, [b""])
            assert outcome.code == grpc.StatusCode.UNAUTHENTICATED, (method.name, outcome)


async def test_rotated_server_certificates_are_served_without_a_restart(
    mtls_plane: ServiceProcess, ca: TestCa, server_cert: Issued, tmp_path: Path
) -> None:
    ops = ca.issue("ops", uris=("kvplane://operator/ops",))
    # The server's certificate is replaced by one from a new CA; its client CA stays.
    new_ca = TestCa(tmp_path / "new-ca", name="new-ca")
    rotated = new_ca.issue("server-rotated", server=True)
    shutil.copyfile(rotated.cert_file, server_cert.cert_file)
    shutil.copyfile(rotated.key_file, server_cert.key_file)
    # A later modification time, whatever the file system's clock resolution.
    later = os.stat(server_cert.cert_file).st_mtime + 10
    os.utime(server_cert.cert_file, (later, later))
    os.utime(server_cert.key_file, (later, later))

    async def serves_the_new_certificate() -> bool:
        creds = ClientCredentials(
            tls_ca_file=new_ca.ca_file,
            tls_cert_file=ops.cert_file,
            tls_key_file=ops.key_file,
            tls_server_name="localhost",
        )
        async with creds.channel(target(mtls_plane)) as channel:
            try:
                await metadata_pb2_grpc.MetadataServiceStub(channel).ListNodes(
                    metadata_pb2.ListNodesRequest(), timeout=2
                )
            except grpc.aio.AioRpcError:
                return False
        return True

    await eventually(serves_the_new_certificate, what="the rotated certificate served")
    # Clients that trust only the old CA no longer accept the server.
    assert await _register(_client(ca.ca_file, ops), target(mtls_plane), "d0") == grpc.StatusCode.UNAVAILABLE


async def test_mesh_headers_are_believed_from_a_proxy_certificate_only(
    etcd: LocalEtcd, prefix: str, ca: TestCa, server_cert: Issued
) -> None:
    mesh = {"mode": "mesh", "mesh_experimental": True}
    process = await start_plane(plane_settings(etcd, prefix, mesh, grpc=_tls(ca, server_cert)))
    try:
        headers = (("x-kvplane-role", "node"), ("x-kvplane-node", "d0"))
        node = convert.node_to_pb(make_node("d0"))
        request = metadata_pb2.RegisterNodeRequest(node=node, lease_ttl_s=30)
        codes = []
        for uri in ("kvplane://mesh/sidecar", "kvplane://node/d9"):
            creds = _client(ca.ca_file, ca.issue(uri.rsplit("/", 1)[1], uris=(uri,)))
            async with creds.channel(target(process)) as channel:
                try:
                    await metadata_pb2_grpc.MetadataServiceStub(channel).RegisterNode(
                        request, metadata=headers, timeout=5
                    )
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
        assert codes == [grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED]
    finally:
        await process.stop()


async def test_a_sim_engine_registers_over_mtls_with_its_certificate(
    mtls_plane: ServiceProcess, ca: TestCa, tmp_path: Path
) -> None:
    d = ca.issue("sim-d", uris=("kvplane://node/sim-d",))
    settings = sim(
        role="decode",
        node_id="sim-d",
        side_channel_port=free_port(),
        control_plane=target(mtls_plane),
        load_interval_s=0.1,
        tls_ca_file=ca.ca_file,
        tls_cert_file=d.cert_file,
        tls_key_file=d.key_file,
        tls_server_name="localhost",
    )
    ops = _client(ca.ca_file, ca.issue("ops", uris=("kvplane://operator/ops",)))
    stack = contextlib.ExitStack()
    try:
        # Started off the event loop, which serves the control plane meanwhile.
        await asyncio.to_thread(stack.enter_context, engines(tmp_path, {"D": settings}))
        async with ops.channel(target(mtls_plane)) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)

            async def registered() -> bool:
                nodes = (await stub.ListNodes(metadata_pb2.ListNodesRequest())).nodes
                return any(n.node.node_id == "sim-d" and n.load.total_kv_blocks > 0 for n in nodes)

            await eventually(registered, timeout_s=30, what="the sim-engine registered over mTLS")
    finally:
        await asyncio.to_thread(stack.close)


async def test_the_gateways_routing_client_routes_over_mtls_with_its_certificate(
    mtls_plane: ServiceProcess, ca: TestCa
) -> None:
    from kvplane.services.client import RoutingClient, RoutingUnavailable
    from kvplane.services.gateway.app import routing_credentials
    from kvplane.services.gateway.settings import GatewaySection

    gateway_cert = ca.issue("gateway", uris=("kvplane://operator/gateway",))
    section = GatewaySection(
        routing=[target(mtls_plane)],
        routing_tls_ca_file=ca.ca_file,
        routing_tls_cert_file=gateway_cert.cert_file,
        routing_tls_key_file=gateway_cert.key_file,
        routing_tls_server_name="localhost",
    )
    async with RoutingClient(
        section.routing, credentials=routing_credentials(section), timeout_s=5
    ) as client:
        # Authenticated as the operator over mTLS, Route ran: its answer is about nodes (none yet).
        with pytest.raises(RoutingUnavailable, match="no prefill/decode pair"):
            await client.route("c", "tiny", prompt_tokens=10, tenant="acme")


async def _kvplane_health(*args: str) -> tuple[int, str]:
    """`kvplane health ARGS` as a Kubernetes exec probe runs it: its exit status and stderr."""
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "kvplane"),
        "health",
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVPLANE_")},
    )
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_the_health_command_probes_an_mtls_server_with_a_client_certificate(
    mtls_plane: ServiceProcess, ca: TestCa, server_cert: Issued
) -> None:
    probe = ["--tls-ca-file", ca.ca_file, "--tls-server-name", "localhost", "--timeout-s", "10"]
    # The server's own certificate (issued for client auth too) is what the chart's probe presents.
    mutual = ["--tls-cert-file", server_cert.cert_file, "--tls-key-file", server_cert.key_file]
    assert await _kvplane_health(target(mtls_plane), *probe, *mutual) == (0, "")
    assert await _kvplane_health(
        target(mtls_plane), *probe, *mutual, "--service", "kvplane.v1.RoutingService"
    ) == (
        0,
        "",
    )
    # Without a client certificate, without TLS, or naming no service the server has: not healthy.
    code, err = await _kvplane_health(target(mtls_plane), *probe)
    assert code == 1 and "UNAVAILABLE" in err
    code, err = await _kvplane_health(target(mtls_plane), "--timeout-s", "10")
    assert code == 1 and "UNAVAILABLE" in err
    code, err = await _kvplane_health(target(mtls_plane), *probe, *mutual, "--service", "no.Such")
    assert code == 1 and "NOT_FOUND" in err


async def test_a_running_client_presents_its_rotated_certificate_without_a_new_channel(
    mtls_plane: ServiceProcess, ca: TestCa, tmp_path: Path
) -> None:
    # The client starts with a certificate the server refuses (another CA), as one that expired
    # would be; its files are then replaced with a good one, as a Secret volume is updated.
    stranger = TestCa(tmp_path / "stranger", name="stranger").issue("ops", uris=("kvplane://operator/ops",))
    cert_file, key_file = tmp_path / "client.pem", tmp_path / "client-key.pem"
    shutil.copyfile(stranger.cert_file, cert_file)
    shutil.copyfile(stranger.key_file, key_file)
    creds = ClientCredentials(
        tls_ca_file=ca.ca_file,
        tls_cert_file=str(cert_file),
        tls_key_file=str(key_file),
        tls_server_name="localhost",
    )
    async with creds.channel(target(mtls_plane)) as channel:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)

        async def list_nodes() -> grpc.StatusCode:
            try:
                await stub.ListNodes(metadata_pb2.ListNodesRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        assert await list_nodes() == grpc.StatusCode.UNAVAILABLE
        good = ca.issue("ops", uris=("kvplane://operator/ops",))
        for source, dest in ((good.cert_file, cert_file), (good.key_file, key_file)):
            shutil.copyfile(source, dest)
            later = dest.stat().st_mtime + 5  # whatever the file system's clock resolution
            os.utime(dest, (later, later))

        async def served() -> bool:
            return await list_nodes() == grpc.StatusCode.OK

        # The same stub, on the same channel object: it made a new connection from the new files.
        await eventually(served, what="the rotated client certificate accepted")


def _chart_containers(values_file: str) -> dict[str, dict[str, Any]]:
    """The containers of the chart rendered with one of its CI values files, by workload."""
    pytest.importorskip("helm_python", reason="deploy validators not installed: pip install -e '.[dev]'")
    checks = load_deploy_checks()
    values = yaml.safe_load((ROOT / "deploy/helm/kvplane/ci" / values_file).read_text())
    docs = checks.render_chart(values, "kvp", "kvplane")
    return {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
        for d in docs
        if is_kvplane_workload(d)
    }


def _secret_volume(directory: Path, ca: TestCa, issued: Issued) -> Path:
    """A Secret in the kubernetes.io/tls layout plus ca.crt, as the kubelet mounts it."""
    directory.mkdir(parents=True)
    shutil.copyfile(ca.ca_file, directory / "ca.crt")
    shutil.copyfile(issued.cert_file, directory / "tls.crt")
    shutil.copyfile(issued.key_file, directory / "tls.key")
    return directory


async def test_the_charts_mtls_wiring_serves_its_clients_and_passes_its_own_probe(
    etcd: LocalEtcd, prefix: str, ca: TestCa, tmp_path: Path
) -> None:
    from kvplane.services.client import RoutingClient, RoutingUnavailable
    from kvplane.services.gateway.app import routing_credentials
    from kvplane.services.gateway.settings import GatewaySection

    containers = _chart_containers("mtls-values.yaml")
    routing, gateway = containers["kvp-kvplane-routing"], containers["kvp-kvplane-gateway"]
    # The services' Secret names the Services clients dial and the routing replicas' own names;
    # the gateway's names its principal.
    names = ("kvp-kvplane-routing", "*.kvp-kvplane-routing-pods.kvplane.svc")
    server_dir = _secret_volume(tmp_path / "server", ca, ca.issue("svc", server=True, dns=names))
    gateway_dir = _secret_volume(
        tmp_path / "gateway", ca, ca.issue("gw", uris=("kvplane://operator/gateway",))
    )

    def env(container: dict[str, Any], mounted_at: Path) -> dict[str, str]:
        return {
            e["name"]: e["value"].replace("/etc/kvplane-tls", str(mounted_at))
            for e in container["env"]
            if isinstance(e.get("value"), str)
        }

    served = env(routing, server_dir)
    tls = {
        "cert_file": served["KVPLANE_GRPC__TLS__CERT_FILE"],
        "key_file": served["KVPLANE_GRPC__TLS__KEY_FILE"],
        "client_ca_file": served["KVPLANE_GRPC__TLS__CLIENT_CA_FILE"],
    }
    process = await start_plane(
        plane_settings(etcd, prefix, {"mode": served["KVPLANE_AUTH__MODE"]}, grpc={"tls": tls})
    )
    try:
        # The liveness probe exactly as rendered, but for the test's port and where the files lie.
        command = [
            a.replace("/etc/kvplane-tls", str(server_dir))
            for a in routing["livenessProbe"]["exec"]["command"]
        ]
        assert command[:2] == ["kvplane", "health"]
        args = [f"localhost:{process.grpc_port}" if a.startswith("localhost:") else a for a in command[2:]]
        assert await _kvplane_health(*args) == (0, "")

        # The gateway's routing client from the chart's environment, as the gateway builds it.
        dialled = env(gateway, gateway_dir)
        section = GatewaySection(
            routing=[target(process)],
            **{
                name.removeprefix("KVPLANE_GATEWAY__").lower(): value
                for name, value in dialled.items()
                if name.startswith("KVPLANE_GATEWAY__ROUTING_TLS_")
            },
        )
        async with RoutingClient(
            section.routing, credentials=routing_credentials(section), timeout_s=5
        ) as client:
            # Authenticated as the chart's gateway principal: Route ran, and found no engines yet.
            with pytest.raises(RoutingUnavailable, match="no prefill/decode pair"):
                await client.route("c", "tiny", prompt_tokens=10, tenant="acme")
    finally:
        await process.stop()
