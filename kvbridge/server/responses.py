"""The one error answer every kvbridge server sends: ``kvbridge.errors.error_body`` as a
JSON response."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from kvbridge.errors import error_body

__all__ = ["error_response"]


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: Any = None, code: str | None = None) -> JSONResponse:
    """OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""
    return JSONResponse(error_body(message, type_, param, code), status_code=status)
