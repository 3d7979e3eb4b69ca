"""What a client sees when its request fails on the server's side.

Such an error says what to do and names the request's id; it never carries an exception's
text or a traceback (a remote Ray error holds the other process's traceback, paths and
values): the ingress logs those with the same id, where the operator finds them. Refusals of
a request itself (a 4xx) are `ApiError`s raised while parsing, in `openai_requests`.
"""
from __future__ import annotations

from kvtier.errors import KvtierError
from kvtier.frontend.openai_requests import ApiError, ErrorType

MAX_MESSAGE_CHARS = 500  # an instance's message about one answer, as a client sees it


class AnswerFailed(KvtierError):
    """An instance ended one answer (only that one) because sampling or stopping it failed;
    `message` is safe to show. The instance serves on: this is no stall, and no reason to
    send the answer elsewhere (it would fail there the same way)."""

    def __init__(self, message: object) -> None:
        text = str(message).strip() or "the answer could not be sampled"
        self.message = text[:MAX_MESSAGE_CHARS]
        super().__init__(self.message)


def _server(status: int, message: str, code: str | None = None) -> ApiError:
    return ApiError(status, message, err_type=ErrorType.SERVER, code=code)


def generation_failed(request_id: str) -> ApiError:
    """A 503: the serve graph could not answer (an instance or the router failed)."""
    return _server(503, f"generation failed on the server (request id {request_id}); retry "
                        f"the request, and if it keeps failing, report the request id to the "
                        f"server's operator")


def unavailable(request_id: str) -> ApiError:
    """A 503: the request's instance stalled or stopped and no other one is live
    (`redispatch.InstanceUnavailable`)."""
    return _server(503, f"no instance can serve the request now (request id {request_id}); "
                        f"retry shortly, and if it keeps failing, report the request id to the "
                        f"server's operator", code="no_instance_available")


def answer_failed(request_id: str, failure: AnswerFailed) -> ApiError:
    """A 500: an instance could not sample this request's answer (its other requests went on)."""
    return _server(500, f"{failure.message} (request id {request_id}); retry with other "
                        f"sampling settings (temperature, top_p, top_k, min_p, penalties), "
                        f"or report the request id to the server's operator",
                   code="answer_failed")


def timed_out(request_id: str, timeout_s: float) -> ApiError:
    """A 504: the request ran past the server's `request_timeout_s` and was stopped."""
    return _server(504, f"the request took longer than this server's request timeout of "
                        f"{timeout_s:g} s and was stopped (request id {request_id}); ask for "
                        f"fewer tokens (max_tokens, n) or a shorter prompt, or ask the "
                        f"server's operator to raise request_timeout_s", code="timeout")


def unreadable(request_id: str) -> ApiError:
    """A 500: reading the request hit a bug in the server (not in the request)."""
    return _server(500, f"the server failed to read the request (request id {request_id}); "
                        f"report the request id to the server's operator")
