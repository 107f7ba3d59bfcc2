"""OpenAI-style error bodies, and the handlers that make every failure one.

Every error the server sends is ``{"error": {"message", "type", "param", "code"}}`` with a
4xx status for the client's mistakes; a 5xx means a bug in updraft or a dead engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("updraft.serve")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.status, error.message, error.param, error.code),
        status_code=error.status,
        headers=error.headers,
    )


def validation_error(error: RequestValidationError) -> APIError:
    """One 400 for all of pydantic's complaints, naming the first field at fault."""
    problems = error.errors()
    if not problems:
        return APIError(400, "invalid request body")
    first = problems[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "cannot parse it")
        return APIError(400, f"request body is not valid JSON: {reason}")
    messages = []
    for problem in problems[:3]:
        path = ".".join(str(part) for part in problem.get("loc", ())[1:])
        messages.append(f"{path or 'request body'}: {problem.get('msg', 'invalid')}")
    if len(problems) > 3:
        messages.append(f"and {len(problems) - 3} more")
    loc = first.get("loc", ())
    param = str(loc[1]) if len(loc) > 1 else None
    return APIError(400, "; ".join(messages), param=param)


def install_error_handlers(app: FastAPI, counted: Callable[[int], None]) -> None:
    """Every error becomes an OpenAI error body; ``counted`` sees each one's status."""

    def respond(error: APIError) -> JSONResponse:
        counted(error.status)
        return error_response(error)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return respond(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type and media_type != "application/json":
            message = f"Content-Type must be application/json, got {media_type[:80]!r}"
            return respond(APIError(415, message))
        return respond(validation_error(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return respond(APIError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def bug(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(APIError(500, f"internal server error: {type(error).__name__}"))
