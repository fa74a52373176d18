"""What every kvbridge server answers with: the one error answer
(``kvbridge.errors.error_body`` as a JSON response), and one server-sent-event line."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from kvbridge.errors import error_body

__all__ = ["error_response", "sse"]


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: Any = None, code: str | None = None) -> JSONResponse:
    """OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
