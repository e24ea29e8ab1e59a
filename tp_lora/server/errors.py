"""OpenAI-style errors of the HTTP front end: {"error": {"message", "type", "param", "code"}} with the HTTP status."""
from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

from tp_lora.server.channel import SHUTTING_DOWN


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "invalid_request_error", 413: "invalid_request_error",
                415: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable"}.get(self.status, "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.status}}, status_code=self.status, headers=self.headers)


def status_of(error: str) -> int:
    """HTTP status of an error the engine reported for a request."""
    if error.startswith("unknown adapter"):
        return 404
    if error.startswith(SHUTTING_DOWN):
        return 503
    if "failed to load" in error:
        return 500
    return 400
