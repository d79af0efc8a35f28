"""The gateway over HTTPS: it serves its configured certificate, and a new one as soon as the files change."""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from pydantic import SecretStr

from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.gateway.app import Gateway
from kvplane.services.gateway.settings import GatewayKey, GatewaySection
from tests.support.certificates import TestCa
from tests.support.polling import eventually


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Gateway, TestCa, Path, Path]]:
    ca = TestCa(tmp_path / "ca")
    first = ca.issue("gateway-1", server=True)
    cert, key = tmp_path / "gateway.pem", tmp_path / "gateway-key.pem"
    shutil.copy(first.cert_file, cert)
    shutil.copy(first.key_file, key)
    gateway = Gateway(
        GatewaySection(
            listen=f"127.0.0.1:{free_port()}",
            routing=[f"127.0.0.1:{free_port()}"],
            api_keys=[GatewayKey(token=SecretStr("k" * 20), tenant="acme")],
            tls_cert_file=str(cert),
            tls_key_file=str(key),
        ),
        Telemetry.disabled("kvplane-gateway"),
    )
    await gateway.start()
    try:
        yield gateway, ca, cert, key
    finally:
        await gateway.stop()


async def _served_subject(gateway: Gateway, ca_file: str) -> str:
    """The common name of the certificate a fresh TLS connection is shown (verified against the CA)."""
    context = ssl.create_default_context(cafile=ca_file)
    _, writer = await asyncio.open_connection(
        "127.0.0.1", gateway.port, ssl=context, server_hostname="localhost"
    )
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    cert = x509.load_der_x509_certificate(der)
    return str(cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value)


async def test_the_gateway_serves_https_with_its_certificate(
    served: tuple[Gateway, TestCa, Path, Path],
) -> None:
    gateway, ca, _, _ = served
    assert gateway.url.startswith("https://")
    assert await _served_subject(gateway, ca.ca_file) == "gateway-1"
    # Plain HTTP to the HTTPS port gets no answer.
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.get(gateway.url.replace("https://", "http://") + "/health") as resp:
                await resp.read()


async def test_a_renewed_certificate_is_served_without_a_restart(
    served: tuple[Gateway, TestCa, Path, Path],
) -> None:
    gateway, ca, cert, key = served
    renewed = ca.issue("gateway-2", server=True)
    # Written as a deployment rotates a Secret: new files moved into place.
    for source, target in ((renewed.key_file, key), (renewed.cert_file, cert)):
        shutil.copy(source, f"{target}.new")
        os.replace(f"{target}.new", target)

    async def renewed_served() -> bool:
        return await _served_subject(gateway, ca.ca_file) == "gateway-2"

    await eventually(renewed_served, timeout_s=20, what="the renewed certificate to be served")
