"""HTTP errors with OpenAI-style bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 500: "internal_error", 503: "service_unavailable"}


class HTTPError(Exception):
    """Raised anywhere in a route; the app turns it into the JSON body and status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    info = ErrorInfo(message=message, type=_TYPES.get(status, "error"), param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(err: HTTPError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param), status_code=err.status,
                        headers=err.headers)
