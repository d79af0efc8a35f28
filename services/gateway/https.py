"""The gateway's optional HTTPS: a server certificate from PEM files, re-read when they change.

The files are polled (their modification times) rather than watched, and a
change is loaded into the same TLS context: connections already open keep
their session, new ones get the new certificate. A file caught half-written
fails to load and is tried again at the next poll, the old certificate
serving meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl

log = logging.getLogger(__name__)

# Seconds between checks of the files.
POLL_S = 1.0


class ServerCertificate:
    """A server TLS context loaded from `cert_file` and `key_file`."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        # Raises at start-up: a gateway configured for HTTPS never serves without its certificate.
        self.context.load_cert_chain(cert_file, key_file)
        self._stamp = self._mtimes()

    def _mtimes(self) -> tuple[float, float]:
        try:
            return os.stat(self.cert_file).st_mtime, os.stat(self.key_file).st_mtime
        except OSError:
            return 0.0, 0.0

    def reload_if_changed(self) -> bool:
        """Loads the files again if they changed since the last load; True if it did."""
        stamp = self._mtimes()
        if stamp == self._stamp or stamp == (0.0, 0.0):
            return False
        try:
            self.context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            log.warning(
                "gateway TLS: %s not loaded (%s); the previous certificate still serves", self.cert_file, exc
            )
            return False
        self._stamp = stamp
        log.info("gateway TLS: certificate reloaded from %s", self.cert_file)
        return True

    async def watch(self) -> None:
        """Reloads the certificate whenever its files change, until cancelled."""
        while True:
            await asyncio.sleep(POLL_S)  # the polling period
            self.reload_if_changed()
