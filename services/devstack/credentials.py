"""The dev stack's credentials: a fresh bearer token per process, in files only its owner reads.

`kvplane dev-stack` runs the control plane in token mode, like a deployment: each engine
registers with its own node token (bound to its node id), the gateway calls routing with an
operator token, and the stack's own readiness probe uses another. Nothing is open, and the
tokens last as long as the run directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvplane.services.dev.token_set import new_token

# Operator principals of the stack: the gateway, and the stack's own probes.
GATEWAY = "gateway"
OPERATOR = "dev-operator"


@dataclass(frozen=True)
class DevCredentials:
    directory: Path

    def token_file(self, name: str) -> str:
        """The file holding `name`'s token, made on first use (mode 0600)."""
        path = self.directory / f"{name}.token"
        if not path.exists():
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(new_token())
        return str(path)

    def token(self, name: str) -> str:
        return Path(self.token_file(name)).read_text().strip()

    def services_config(self, node_ids: Sequence[str]) -> Path:
        """`kvplane serve`'s auth section: token mode, a node token per engine, two operators."""
        entries = [{"token_file": self.token_file(n), "kind": "node", "name": n} for n in node_ids]
        entries += [
            {"token_file": self.token_file(name), "kind": "operator", "name": name}
            for name in (GATEWAY, OPERATOR)
        ]
        path = self.directory / "services.yaml"
        path.write_text(json.dumps({"auth": {"mode": "token", "tokens": entries}}, indent=2))  # JSON is YAML
        return path

    def operator_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token(OPERATOR)}"),)
