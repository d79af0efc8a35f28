"""Envoy's ext_proc messages, as the picker reads and writes them.

Envoy sends header values as bytes (`raw_value`; older releases `value`); the picker's answers set
headers over any the client sent (OVERWRITE_IF_EXISTS_OR_ADD: Envoy's default would append a second
value beside a forged one), and bodies go back in FULL_DUPLEX_STREAMED mode as `streamed_response`
chunks, the last one marked.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeAlias

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from multidict import CIMultiDict

from kvplane.services.gateway.openai_errors import error_body

# A ProcessingResponse (the generated stubs carry no types).
Response: TypeAlias = Any

_OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.Value("OVERWRITE_IF_EXISTS_OR_ADD")


def header_map(headers: Any) -> CIMultiDict[str]:
    """An `HttpHeaders.headers` map, its names looked up ignoring case as HTTP's are (pseudo-headers
    included)."""
    out: CIMultiDict[str] = CIMultiDict()
    for h in headers.headers:
        value = h.raw_value.decode("utf-8", "surrogateescape") if h.raw_value else h.value
        out[h.key] = value
    return out


def mutation(set_headers: Mapping[str, str], remove: Iterable[str] = ()) -> Any:
    return ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
            )
            for k, v in set_headers.items()
        ],
        remove_headers=list(remove),
    )


def request_headers(
    set_headers: Mapping[str, str], remove: Iterable[str], metadata: Mapping[str, Any]
) -> Response:
    """The answer to the request's headers: the destination set, the route cache cleared."""
    dynamic = struct_pb2.Struct()
    dynamic.update(dict(metadata))
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(
            response=ep.CommonResponse(clear_route_cache=True, header_mutation=mutation(set_headers, remove))
        ),
        dynamic_metadata=dynamic,
    )


def response_headers(set_headers: Mapping[str, str], remove: Iterable[str]) -> Response:
    return ep.ProcessingResponse(
        response_headers=ep.HeadersResponse(
            response=ep.CommonResponse(header_mutation=mutation(set_headers, remove))
        )
    )


def body_chunks(body: bytes, chunk_bytes: int, *, response: bool) -> Iterator[Response]:
    """`body` as streamed chunks of at most `chunk_bytes`, the last marked end of stream."""
    for offset in range(0, max(len(body), 1), chunk_bytes):
        end = offset + chunk_bytes >= len(body)
        yield body_chunk(body[offset : offset + chunk_bytes], end, response=response)


def body_chunk(chunk: bytes, end: bool, *, response: bool) -> Response:
    streamed = ep.BodyResponse(
        response=ep.CommonResponse(
            body_mutation=ep.BodyMutation(
                streamed_response=ep.StreamedBodyResponse(body=chunk, end_of_stream=end)
            )
        )
    )
    if response:
        return ep.ProcessingResponse(response_body=streamed)
    return ep.ProcessingResponse(request_body=streamed)


def immediate(status: int, message: str, param: str | None = None, *, body: bytes = b"") -> Response:
    """A local answer instead of the upstream's: OpenAI's error JSON (or `body`, an engine's own)."""
    payload = body or orjson.dumps(error_body(status, message, param=param))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=mutation({"content-type": "application/json"}),
            body=payload,
            details=f"kvplane_epp_{status}",
        )
    )


def trailers(*, response: bool) -> Response:
    if response:
        return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
    return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
