"""deploy/scripts/validate/deploy_checks, the offline deployment validator, as a package for tests
(it is a script's package, not part of the kvplane distribution)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "deploy" / "scripts" / "validate" / "deploy_checks"


def load_deploy_checks() -> ModuleType:
    """The package `deploy_checks`, loaded once from its folder (its modules import one another)."""
    loaded = sys.modules.get("deploy_checks")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(
        "deploy_checks", PACKAGE / "__init__.py", submodule_search_locations=[str(PACKAGE)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["deploy_checks"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["deploy_checks"]
        raise
    return module


def is_kvplane_workload(doc: dict[str, Any]) -> bool:
    """The chart's kvplane processes and engines: its Deployments and routing's StatefulSet (etcd's
    StatefulSet runs etcd, not kvplane)."""
    if doc["kind"] == "Deployment":
        return True
    return doc["kind"] == "StatefulSet" and doc["metadata"]["name"].endswith("-routing")
