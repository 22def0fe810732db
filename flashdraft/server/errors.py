"""The error a request gets back: OpenAI's `{"error": {...}}` object, naming the offending field."""

from __future__ import annotations


class APIError(Exception):
    """An error returned to the client as OpenAI's `{"error": {...}}` object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
