"""A conversation's home routing replica is the same in every process, and spreads conversations."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvplane.services.client.routing_client import home_replica

CONVERSATIONS = [(tenant, f"conversation-{i}") for tenant in ("acme", "globex", "") for i in range(20)]


def test_another_process_picks_the_same_home_replicas() -> None:
    script = (
        "import json, sys\n"
        "from kvplane.services.client.routing_client import home_replica\n"
        "pairs = json.loads(sys.argv[1])\n"
        "print(json.dumps([home_replica(t, c, 3) for t, c in pairs]))\n"
    )
    # Another hash seed: Python's own hash() would pick differently there.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(CONVERSATIONS)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert json.loads(out.stdout) == [home_replica(t, c, 3) for t, c in CONVERSATIONS]


def test_conversations_spread_over_every_replica_and_tenants_are_part_of_the_key() -> None:
    for replicas in (1, 2, 3, 5):
        homes = [home_replica(t, c, replicas) for t, c in CONVERSATIONS]
        assert set(homes) == set(range(replicas))
    # The same conversation name under two tenants is two conversations.
    assert any(
        home_replica("acme", f"conversation-{i}", 5) != home_replica("globex", f"conversation-{i}", 5)
        for i in range(20)
    )
