"""The sidecar reports D's answer to the picker (`sidecar/answer_report.py`, `epp/answers.py`): what
the sidecar holds back and reports, how the picker takes a report (once, signed), and a turn whose
report never comes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvplane.services.epp.answers import PendingAnswers, answers_app
from kvplane.services.epp.exchange import Exchange
from kvplane.services.epp.picker_state import PickerState
from kvplane.services.epp.response_phase import ResponseRelay
from kvplane.services.sidecar.answer_report import (
    ANSWER_MAC_HEADER,
    ANSWERS_PATH,
    AnswerAccount,
    AnswerReport,
    answer_mac,
    post_report,
)
from kvplane.services.sidecar.prefill_report import PrefillReport
from kvplane.services.sidecar.signed_route import PREFILL_REPORT_HEADER, ROUTE_HEADER, SignedRoute, verify
from tests.unit.test_epp_exchange import AUTH, KEY, ROUTE, body, headers, routed_to, state  # noqa: F401

URL = "http://127.0.0.1:9"
EVENTS = (
    b'data: {"choices": [{"text": "a"}]}\n\n'
    b'data: {"choices": [{"text": "b", "finish_reason": "length"}], '
    b'"kv_transfer_params": {"kvplane_handle_id": "h", "remote_num_tokens": 42}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.fixture
def answering(state: PickerState) -> PickerState:  # noqa: F811 (the imported fixture)
    return dataclasses.replace(state, answers=PendingAnswers(60.0), answers_url=URL)


def recorded(picker: PickerState) -> list[tuple[bool, Any]]:
    """Every turn the picker reports: its success and progress."""
    out: list[tuple[bool, Any]] = []

    def finish(turn: Any, route: Any, progress: Any, success: bool, error: str = "") -> None:
        progress.error = progress.error or error  # as the reporter records it
        out.append((success, progress))

    picker.turns.reporter.finish = finish  # type: ignore[method-assign]
    return out


def response_headers(status: bytes, prefill: str = "") -> Any:
    values = [base_pb2.HeaderValue(key=":status", raw_value=status)]
    if prefill:
        values.append(base_pb2.HeaderValue(key=PREFILL_REPORT_HEADER, raw_value=prefill.encode()))
    return ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=values)))


async def routed(picker: PickerState, conversation: str, stream: bool = True) -> tuple[Exchange, SignedRoute]:
    routed_to(picker, ROUTE)
    exchange = Exchange(picker)
    await exchange.handle(headers(**AUTH, **{"x-conversation-id": conversation}))
    raw = json.dumps({"model": "m", "prompt": [1, 2], "stream": stream}).encode()
    answer = await exchange.handle(body(raw))
    mutation = answer[0].request_headers.response.header_mutation
    token = {h.header.key: h.header.raw_value for h in mutation.set_headers}[ROUTE_HEADER].decode()
    # The route is signed for the body the picker sends on (the admitted one).
    sent = b"".join(m.request_body.response.body_mutation.streamed_response.body for m in answer[1:])
    return exchange, verify(KEY, token, body=sent, now=0.0)


def prefill() -> PrefillReport:
    return PrefillReport(
        {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}, {"b": [9]}, 0.01
    )


async def test_the_route_names_the_answer_endpoint_and_the_turn_waits_for_its_report(
    answering: PickerState,
) -> None:
    reports = recorded(answering)
    exchange, signed = await routed(answering, "c-1")
    assert signed.answer_to == URL and signed.answer_id and not signed.keep_ids
    relay = exchange.relay
    assert isinstance(relay, ResponseRelay) and relay.answer_id == signed.answer_id
    answered = await exchange.handle(response_headers(b"200", prefill().encode()))
    mutation = answered[0].response_headers.response.header_mutation
    # The body reaches the client as the sidecar wrote it: its length holds.
    assert list(mutation.remove_headers) == [PREFILL_REPORT_HEADER]
    # Envoy's stream for the request ends before D's answer does: the turn waits for its report.
    exchange.close()
    assert reports == [] and len(answering.answers or ()) == 1

    assert answering.answers is not None
    taker = answering.answers.take(signed.answer_id)
    assert taker is relay
    taker.take_report(
        AnswerReport(signed.answer_id, True, 0.25, {"kvplane_handle_id": "h", "remote_num_tokens": 42})
    )
    [(success, progress)] = reports
    assert success and progress.decode_params["kvplane_handle_id"] == "h"
    # TTFT: the picker's own time to route the turn, then the sidecar's to D's first token.
    assert progress.ttft_s == pytest.approx(relay.routed - relay.turn.arrival + 0.25)
    assert progress.sources is not None and progress.sources.computed == 2
    assert answering.turns.reporter.awaited(relay.turn) == ("h", 42)


async def test_a_report_that_comes_before_the_answers_headers_counts_the_p_leg_once(
    answering: PickerState,
) -> None:
    reports = recorded(answering)
    exchange, signed = await routed(answering, "c-2", stream=False)
    counted = answering.turns.metrics.prompt_tokens.labels("computed")
    before = counted._value.get()
    assert exchange.relay is not None
    exchange.relay.take_report(AnswerReport(signed.answer_id, True, 0.5, None, prefill=prefill()))
    await exchange.handle(response_headers(b"200", prefill().encode()))
    exchange.close()
    assert [s for s, _ in reports] == [True]
    assert counted._value.get() - before == 2
    assert len(answering.answers or ()) == 0


async def test_a_sidecar_that_answered_an_error_is_reported_failed_without_waiting(
    answering: PickerState,
) -> None:
    reports = recorded(answering)
    exchange, _ = await routed(answering, "c-3")
    await exchange.handle(response_headers(b"503"))
    await exchange.handle(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True)))
    exchange.close()
    assert [s for s, _ in reports] == [False]
    assert len(answering.answers or ()) == 0


async def test_a_turn_whose_answer_never_began_is_reported_failed_when_envoy_ends(
    answering: PickerState,
) -> None:
    reports = recorded(answering)
    exchange, _ = await routed(answering, "c-4")
    exchange.close()
    assert [s for s, _ in reports] == [False]


async def test_a_report_that_never_comes_fails_the_turn_at_its_deadline(answering: PickerState) -> None:
    reports = recorded(answering)
    exchange, signed = await routed(answering, "c-5")
    await exchange.handle(response_headers(b"200"))
    exchange.close()
    pending = answering.answers
    assert pending is not None
    pending.expire(now=0.0)
    assert reports == []
    pending.expire(now=1e12)
    [(success, progress)] = reports
    assert not success and "no report" in progress.error
    assert pending.take(signed.answer_id) is None


@pytest.fixture
async def endpoint(answering: PickerState) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    assert answering.answers is not None
    async with (
        TestServer(answers_app(answering.answers, KEY), host="127.0.0.1") as server,
        aiohttp.ClientSession() as session,
    ):
        yield str(server.make_url("")), session


async def test_the_endpoint_takes_a_signed_report_once(
    answering: PickerState, endpoint: tuple[str, aiohttp.ClientSession]
) -> None:
    url, session = endpoint
    reports = recorded(answering)
    exchange, signed = await routed(answering, "c-6")
    await exchange.handle(response_headers(b"200"))
    report = AnswerReport(signed.answer_id, True, 0.1, {"kvplane_handle_id": "h2"})
    assert await post_report(session, url, KEY, report, 5.0)
    assert [s for s, _ in reports] == [True]
    # Taken once: the same report again finds no turn.
    assert not await post_report(session, url, KEY, report, 5.0)
    assert len(reports) == 1


@pytest.mark.parametrize(
    ("raw", "mac", "status"),
    [
        (b'{"id": "x"}', "00", 401),  # not signed with the route key
        (b"[1, 2", answer_mac(KEY, b"[1, 2"), 400),  # signed, not a report
        (AnswerReport("nobody", True, 0.1, None).encode(), None, 404),  # no turn awaits it
    ],
)
async def test_the_endpoint_refuses_what_is_not_a_report_it_awaits(
    endpoint: tuple[str, aiohttp.ClientSession], raw: bytes, mac: str | None, status: int
) -> None:
    url, session = endpoint
    given = mac if mac is not None else answer_mac(KEY, raw)
    async with session.post(
        url.rstrip("/") + ANSWERS_PATH, data=raw, headers={ANSWER_MAC_HEADER: given}
    ) as resp:
        assert resp.status == status


def account(
    keep_ids: bool = False, collect_ids: bool = False, ids: bool = False, prompt_known: bool = False
) -> AnswerAccount:
    signed = SignedRoute(
        ROUTE,
        ids,
        answer_to=URL,
        answer_id="a-1",
        keep_ids=keep_ids,
        collect_ids=collect_ids,
        prompt_known=prompt_known,
    )
    return AnswerAccount(signed, prefill(), arrival=0.0)


def test_the_sidecar_holds_the_answers_end_until_its_report_and_shows_no_handle() -> None:
    a = account()
    shown = b"".join(a.feed(EVENTS[i : i + 5]) for i in range(0, len(EVENTS), 5)) + a.close()
    # The first token went on at once; the handle's event and [DONE] wait for the report.
    assert shown == b'data: {"choices": [{"text": "a"}]}\n\n'
    assert b"kv_transfer_params" not in a.held and a.held.endswith(b"data: [DONE]\n\n")
    report = a.report()
    assert report.finished and report.answer_id == "a-1" and report.ttft_s is not None
    assert report.decode_params == {"kvplane_handle_id": "h", "remote_num_tokens": 42}
    assert report.prefill == prefill()


def test_a_stream_that_ends_before_done_is_reported_unfinished() -> None:
    a = account()
    cut = EVENTS.index(b"data: [DONE]")
    shown = a.feed(EVENTS[:cut]) + a.close()
    # The first token went on; the handle's event is held; with no [DONE] the report says the
    # answer did not end, before any error is named.
    assert shown == b'data: {"choices": [{"text": "a"}]}\n\n' and b"[DONE]" not in a.held
    assert not a.finished
    assert not a.report().finished and a.report().decode_params is not None


def test_output_ids_are_collected_only_when_the_route_asks_and_the_client_keeps_its_own() -> None:
    stream = (
        b'data: {"choices": [{"text": "a", "token_ids": [7]}]}\n\n'
        b'data: {"choices": [{"text": "b", "token_ids": [8]}], '
        b'"kv_transfer_params": {"kvplane_handle_id": "h"}}\n\n'
        b"data: [DONE]\n\n"
    )
    collected = account(collect_ids=True, ids=True)
    shown = collected.feed(stream)
    assert collected.report().output_ids == [7, 8] and b"token_ids" not in shown + collected.held
    kept = account(keep_ids=True, collect_ids=False, ids=True)
    shown = kept.feed(stream)
    assert kept.report().output_ids == [] and b'"token_ids":[7]' in shown.replace(b" ", b"")


def test_the_prompts_ids_are_reported_only_to_a_picker_that_lacks_them() -> None:
    answer = {
        "choices": [{"text": "ab", "token_ids": [7, 8], "prompt_token_ids": [1, 2, 3]}],
        "kv_transfer_params": {"kvplane_handle_id": "h"},
    }
    lacking = account(keep_ids=True, ids=True)
    lacking.whole(json.loads(json.dumps(answer)))
    assert lacking.report().prompt_ids == [1, 2, 3]
    knowing = account(keep_ids=True, ids=True, prompt_known=True)
    shown = json.loads(knowing.whole(json.loads(json.dumps(answer))))
    # The client still gets them; the picker, which routed on them, is not sent them again.
    assert shown["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    assert knowing.report().prompt_ids is None


def test_a_whole_answer_loses_its_handle_and_is_reported() -> None:
    a = account()
    answer = {"choices": [{"text": "ab"}], "kv_transfer_params": {"kvplane_handle_id": "h"}}
    shown = json.loads(a.whole(answer))
    assert "kv_transfer_params" not in shown and shown["choices"][0]["text"] == "ab"
    assert a.report().finished and a.report().decode_params == {"kvplane_handle_id": "h"}


def test_a_report_survives_its_encoding_and_garbage_is_refused() -> None:
    report = AnswerReport("a", True, 0.5, {"x": 1}, [1, 2], [3], prefill(), "")
    assert AnswerReport.decode(report.encode()) == report
    for raw in (
        b"{",
        b"[]",
        b'{"id": 1}',
        json.dumps({**json.loads(report.encode()), "output_ids": "x"}).encode(),
    ):
        with pytest.raises(ValueError):
            AnswerReport.decode(raw)
