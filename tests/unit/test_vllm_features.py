"""The connector's vLLM feature check, on stand-in classes shaped like vLLM's (no vLLM needed).

The same check against each release's real classes is in test_vllm_connector.py, which runs in
the vLLM environments.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import pytest

from kvplane.connector import vllm_features
from kvplane.connector.vllm_features import IncompatibleVllm, check_vllm, missing_features


class PullConnector:
    """The hooks with vLLM 0.32's and 0.33's signatures."""

    def get_num_new_matched_tokens(self, request: object, num_computed_tokens: int) -> None: ...
    def request_finished(self, request: object, block_ids: list[int]) -> None: ...
    def request_finished_all_groups(self, request: object, block_ids: object) -> None: ...
    def update_connector_output(self, connector_output: object) -> None: ...
    def build_connector_meta(self, scheduler_output: object) -> None: ...
    def update_state_after_alloc(self, request: object, blocks: object, num_external_tokens: int) -> None: ...
    def has_pending_block_frees(self) -> None: ...
    def shutdown(self) -> None: ...
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: object) -> None: ...


class Metadata:
    def __init__(self) -> None:
        self.reqs_to_send: dict[str, float] = {}
        self.scheduler_clock = 0.0
        self.reqs_in_batch: set[str] = set()


@dataclasses.dataclass
class Output:
    finished_sending: set[str] | None = None


def test_classes_with_every_feature_miss_nothing() -> None:
    worker = types.ModuleType("base_worker")
    worker.nixl_agent_config = object()  # type: ignore[attr-defined]
    assert missing_features(PullConnector, Metadata, Output, worker) == []


def test_each_missing_part_is_named_by_class_and_attribute() -> None:
    class OldConnector(PullConnector):
        request_finished_all_groups = None  # type: ignore[assignment]

    class OldMetadata:
        def __init__(self) -> None:
            self.reqs_to_send: dict[str, float] = {}

    @dataclasses.dataclass
    class OldOutput:
        finished_recving: set[str] | None = None

    worker = types.ModuleType("base_worker")
    assert missing_features(OldConnector, OldMetadata, OldOutput, worker) == [
        "OldConnector.request_finished_all_groups",
        "OldMetadata.scheduler_clock",
        "OldMetadata.reqs_in_batch",
        "OldOutput.finished_sending",
        "base_worker.nixl_agent_config",
    ]


def test_a_hook_whose_parameters_changed_is_named_with_both_signatures() -> None:
    class RenamedConnector(PullConnector):
        def update_state_after_alloc(
            self, request: object, num_external_tokens: int, blocks: object
        ) -> None: ...
        def request_finished(self, req: object, block_ids: list[int]) -> None: ...  # type: ignore[override]

    class ExtendedConnector(PullConnector):
        # A later parameter with a default is fine: the connector's calls still bind.
        def build_connector_meta(self, scheduler_output: object, extra: int = 0) -> None: ...

    assert missing_features(RenamedConnector, Metadata, Output) == [
        "RenamedConnector.request_finished(request, block_ids) [it takes (req, block_ids)]",
        "RenamedConnector.update_state_after_alloc(request, blocks, num_external_tokens) "
        "[it takes (request, num_external_tokens, blocks)]",
    ]
    assert missing_features(ExtendedConnector, Metadata, Output) == []


def test_worker_agent_factory_is_required_only_when_the_progress_thread_is_turned_off() -> None:
    assert missing_features(PullConnector, Metadata, Output, None) == []


def test_missing_feature_refuses_to_start_naming_it() -> None:
    with pytest.raises(IncompatibleVllm, match=r"vLLM 0\.40\.0: it lacks Metadata\.scheduler_clock"):
        check_vllm("0.40.0", ["Metadata.scheduler_clock"])


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0"])
def test_tested_releases_start_without_a_warning(version: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=vllm_features.__name__):
        check_vllm(version, [])
    assert caplog.records == []


def test_untested_release_with_every_feature_starts_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=vllm_features.__name__):
        check_vllm("0.34.1", [])
    messages: list[Any] = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert "vLLM 0.34.1" in messages[0] and "not tested" in messages[0]
