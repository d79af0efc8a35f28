"""Where a turn is routed: the `Router` (snapshot → plan → account → learn) and its ports.

- `router.py`: the `Router`, shared by the routing service and the simulator.
- `ports.py`: what it reads and calls outside itself (cluster, check-out, clock), as Protocols.
- `turns.py`: its inputs and outputs, domain values (no protobuf).
"""

from kvplane.services.routing.router.ports import Clock, ClusterReader, HandleCheckOut
from kvplane.services.routing.router.router import NoRoute, Router
from kvplane.services.routing.router.turns import AwaitedHandle, RouteOutcome, TurnReport, TurnRequest

__all__ = [
    "AwaitedHandle",
    "Clock",
    "ClusterReader",
    "HandleCheckOut",
    "NoRoute",
    "RouteOutcome",
    "Router",
    "TurnReport",
    "TurnRequest",
]
