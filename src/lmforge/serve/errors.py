"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

# status -> OpenAI's error type for it (the openai client picks its exception by status).
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error"}


class ApiError(Exception):
    """A request refused (or failed) with an HTTP status and a one-line message."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        # One line, whatever produced it: clients log it as it comes.
        self.message = " ".join(message.split())
        self.status, self.param, self.code = status, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: OpenAI's error object."""
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` for ``status`` with ``message``."""
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
