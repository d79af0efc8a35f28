"""The one place where kvplane's errors become gRPC status codes.

Servicer methods are wrapped with `rpc_method`: it authenticates the caller,
maps each exception type to a canonical code with a human message, and turns
anything unexpected into INTERNAL (never UNKNOWN).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from kvplane.services.common.model.errors import (
    HandleNotRetained,
    InvalidArgument,
    KvplaneError,
    NodeNotRegistered,
    NotFound,
    NotLeader,
    PermissionDenied,
    StoreUnavailable,
    Unauthenticated,
)
from kvplane.services.common.runtime.server import Context

log = logging.getLogger(__name__)

STATUS_BY_ERROR: tuple[tuple[type[KvplaneError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (HandleNotRetained, grpc.StatusCode.FAILED_PRECONDITION),
    (NodeNotRegistered, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (NotLeader, grpc.StatusCode.UNAVAILABLE),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for error_type, code in STATUS_BY_ERROR:
        if isinstance(exc, error_type):
            return code, str(exc)
    # No type names or tracebacks to the caller: the log has them.
    return grpc.StatusCode.INTERNAL, "internal error"


F = TypeVar("F", bound=Callable[..., Any])


def rpc_method(fn: F) -> F:
    """Maps errors raised by a unary or server-streaming servicer method."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self: Any, request: Any, context: Context) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except Exception as exc:
                await _abort(exc, context, fn.__name__)

        return stream  # type: ignore[return-value]

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: Context) -> Any:
        try:
            return await fn(self, request, context)
        except Exception as exc:
            await _abort(exc, context, fn.__name__)

    return unary  # type: ignore[return-value]


async def _abort(exc: Exception, context: Context, method: str) -> None:
    """Ends the call with the status `exc` maps to; context.abort's own exception passes through."""
    if _is_abort(exc):
        raise exc
    if not isinstance(exc, KvplaneError):
        log.exception("unexpected error in %s", method, exc_info=exc)
    code, message = status_for(exc)
    await context.abort(code, message)


def _is_abort(exc: BaseException) -> bool:
    # context.abort raises an internal exception type; let it through.
    return type(exc).__name__ == "AbortError" or isinstance(exc, grpc.aio.AbortError)
