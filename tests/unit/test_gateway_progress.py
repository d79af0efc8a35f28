"""What a turn takes out of D's answers before the client sees them."""

from __future__ import annotations

from typing import Any

from kvplane.services.common.model.handles import KEY_DIGESTS
from kvplane.services.gateway.progress import TurnProgress, absorb, cached_tokens


def _chunk(**extra: Any) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": 0, "text": "ab", "token_ids": [7, 8]}], **extra}


def test_the_handle_is_taken_out_and_kept_for_the_report() -> None:
    progress = TurnProgress("pull")
    payload = _chunk(kv_transfer_params={"remote_engine_id": "d"})
    assert absorb(payload, progress, keep_token_ids=True)
    assert "kv_transfer_params" not in payload and progress.decode_params == {"remote_engine_id": "d"}
    assert payload["choices"][0]["token_ids"] == [7, 8]


def test_a_null_handle_is_stripped_but_not_kept() -> None:
    progress = TurnProgress("pull")
    payload = _chunk(kv_transfer_params=None)
    assert absorb(payload, progress, keep_token_ids=True)
    assert "kv_transfer_params" not in payload and progress.decode_params is None


def test_token_ids_the_client_did_not_ask_for_are_removed_but_counted() -> None:
    progress = TurnProgress("pull")
    first = {"prompt_token_ids": [1, 2, 3], **_chunk()}
    assert absorb(first, progress, keep_token_ids=False)
    assert first == {"id": "c", "choices": [{"index": 0, "text": "ab"}]}
    absorb(_chunk(), progress, keep_token_ids=False)
    assert progress.prompt_ids == [1, 2, 3] and progress.output_ids == [7, 8, 7, 8]
    # D holds KV for every token but the last one it generated.
    assert progress.retained_token_ids() == [1, 2, 3, 7, 8, 7]


def test_an_untouched_chunk_is_reported_unchanged() -> None:
    payload = {"id": "c", "choices": [{"index": 0, "text": "ab"}]}
    assert not absorb(payload, TurnProgress("pull"), keep_token_ids=False)


def test_cached_tokens_from_usage() -> None:
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 48}}}) == 48
    assert cached_tokens({"usage": {"prompt_tokens_details": None}}) == 0
    assert cached_tokens({}) == 0


def test_retained_ids_go_to_routing_only_for_a_handle_without_digests() -> None:
    def progress(params: dict[str, Any] | None) -> TurnProgress:
        p = TurnProgress("pull", prompt_ids=[1, 2, 3], decode_params=params)
        p.output_ids.extend([4, 5])
        return p

    without = {"remote_engine_id": "e-d0"}
    assert progress(without).retained_ids_for_routing(True) == [1, 2, 3, 4]
    assert progress({**without, KEY_DIGESTS: ""}).retained_ids_for_routing(True) == [1, 2, 3, 4]
    # Routing takes the digests D's connector sent and ignores retained ids.
    assert progress({**without, KEY_DIGESTS: "AQAAABAAAAA"}).retained_ids_for_routing(True) == []
    # Nothing is published for a failed turn or one without D's params.
    assert progress(without).retained_ids_for_routing(False) == []
    assert progress(None).retained_ids_for_routing(True) == []
