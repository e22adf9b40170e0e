"""The HTTP front's refusal, raised wherever a request body is read (validation, tools)."""

from __future__ import annotations


class HttpError(Exception):
    """A request the HTTP front refuses before it reaches the router's validation."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        self.status, self.kind, self.param = status, kind, param
        super().__init__(message)
