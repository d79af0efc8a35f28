"""The eviction service's retention policy, as its settings section configures it.

The section itself (`EvictionSection`, `settings.py` beside this module) is composed into the
process settings (kvplane.services.settings) with every other service's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvplane.services.eviction.policy import RetentionPipeline
from kvplane.services.eviction.policy.base import PolicyConfigError
from kvplane.services.eviction.settings import EvictionSection


def policy_config(section: EvictionSection) -> dict[str, Any] | None:
    """The policy mapping: `policy` inline, else the file's, else None (the built-in default)."""
    if section.policy is not None:
        return section.policy
    if not section.policy_file:
        return None
    loaded = yaml.safe_load(Path(section.policy_file).read_text())
    if not isinstance(loaded, dict):
        raise PolicyConfigError(f"{section.policy_file}: expected a mapping at the top level")
    return loaded


def retention_pipeline(section: EvictionSection) -> RetentionPipeline:
    return RetentionPipeline.from_config(policy_config(section))
