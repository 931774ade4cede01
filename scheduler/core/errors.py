"""Errors a request can end with, carrying what the HTTP layer needs for the OpenAI error envelope."""

from __future__ import annotations


class RequestError(Exception):
    """A request failed or was refused. `status` is the HTTP status, `code` a stable machine-readable
    reason, `param` the request field at fault (if any)."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 error_type: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.error_type = error_type or ("invalid_request_error" if status < 500 else "server_error")
        self.retry_after_s = retry_after_s

    def __deepcopy__(self, memo: dict[int, object]) -> RequestError:
        return self  # never changed once made: a copy of a request may share it


class AdmissionRejected(RequestError):
    """Refused at admission: nothing was reserved, no worker or transport ever saw the request."""


def context_length_exceeded(message: str, param: str = "messages") -> AdmissionRejected:
    return AdmissionRejected(400, "context_length_exceeded", message, param=param)


def overloaded(message: str, retry_after_s: int = 1) -> AdmissionRejected:
    return AdmissionRejected(503, "overloaded", message, error_type="service_unavailable",
                             retry_after_s=retry_after_s)
