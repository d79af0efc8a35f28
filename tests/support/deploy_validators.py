"""deploy/scripts/validate/deploy_checks.py, the offline deployment validator, as a module for tests
(it is a script, not part of the kvplane package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_deploy_checks() -> ModuleType:
    path = ROOT / "deploy" / "scripts" / "validate" / "deploy_checks.py"
    spec = importlib.util.spec_from_file_location("deploy_checks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
