"""A discrete-event simulator of a disaggregated fleet, running kvplane's own policies.

Entry point::

    from kvplane.bench.sim import BASELINES, SimConfig, simulator_for
    result = simulator_for(BASELINES["kvplane"], SimConfig()).run(turns, name="kvplane")
    result.summary.as_dict()

The routing policy (`kvplane.services.routing.policy`) and the retention
pipeline (`kvplane.services.eviction.policy`) are called in process with the
same frozen snapshots the services build; see `routers.py` and
`retention.py`. Costs are in `costs.py`, the event loop in `engine.py`.
"""

from kvplane.bench.sim.baselines import BASELINES, Baseline, RunOptions, simulator_for
from kvplane.bench.sim.cluster import ClusterSpec
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.sim.engine import SimConfig, Simulator
from kvplane.bench.sim.results import SimResult, SimSummary

__all__ = [
    "BASELINES",
    "Baseline",
    "ClusterSpec",
    "RunOptions",
    "SimConfig",
    "SimCosts",
    "SimResult",
    "SimSummary",
    "Simulator",
    "simulator_for",
]
