"""API errors in the OpenAI envelope, shared by web (answers) and model processes (replies)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error a client sees: HTTP status plus the OpenAI ``error`` object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def envelope(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_reply(self) -> dict[str, Any]:
        """The form carried on a reply stream (see residency.messages)."""
        return {**self.envelope(), "status": self.status, "retry_after": self.retry_after}

    @classmethod
    def from_reply(cls, data: dict[str, Any]) -> ApiError:
        err = data.get("error", {})
        return cls(
            int(data.get("status", 500)),
            str(err.get("message", "error")),
            type=str(err.get("type", "server_error")),
            param=err.get("param"),
            code=err.get("code"),
            retry_after=data.get("retry_after"),
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(name: str) -> ApiError:
    return ApiError(
        404, f"The model '{name}' does not exist", param="model", code="model_not_found"
    )


def slots_pinned(name: str, pool: str) -> ApiError:
    return ApiError(
        409,
        f"cannot load '{name}': every resident of the {pool} pool is pinned",
        type="conflict_error",
        code="slots_pinned",
    )


def model_too_large(name: str, need: int, largest: int) -> ApiError:
    mib = 1 << 20
    return ApiError(
        409,
        f"cannot load '{name}': it needs {need / mib:.0f} MiB and the largest device budget is "
        f"{largest / mib:.0f} MiB (raise [worker] device_budget_mb, or lower the model's n_ctx, "
        "parallel or n_gpu_layers)",
        type="conflict_error",
        code="model_too_large",
    )


def memory_pinned(name: str, need: int) -> ApiError:
    return ApiError(
        409,
        f"cannot load '{name}': it needs {need / (1 << 20):.0f} MiB and pinned models hold the "
        "memory it would need on every device",
        type="conflict_error",
        code="memory_pinned",
    )


def queue_full(name: str, depth: int, retry_after: int = 1) -> ApiError:
    return ApiError(
        429,
        f"too many requests waiting for '{name}' ({depth}); retry later",
        type="rate_limit_error",
        code="queue_full",
        retry_after=retry_after,
    )


def pushed_out(name: str, depth: int, retry_after: int = 1) -> ApiError:
    """A queued request made room in a full queue for a user within its share (its own user
    was above its share): the 429 a full queue gives."""
    return ApiError(
        429,
        f"too many requests waiting for '{name}' ({depth}); this request was one of its user's "
        "beyond its fair share of the queue, and made room for another user's; retry later",
        type="rate_limit_error",
        code="queue_full",
        retry_after=retry_after,
    )


def model_not_resident(name: str, state: str) -> ApiError:
    """A caller that may not cause loads asked for a model that is not loaded (nor loading)."""
    return ApiError(
        409,
        f"model '{name}' is not loaded (it is {state}) and this API key may not load models; "
        "use a model that is loaded, or ask an admin for a key that may load",
        param="model",
        code="model_not_resident",
    )


def not_ready(message: str, retry_after: int = 2) -> ApiError:
    return ApiError(503, message, type="server_error", code="not_ready", retry_after=retry_after)


def deadline_exceeded(name: str, deadline_s: float) -> ApiError:
    """A request not finished within ``server.request_deadline_s`` of its submit: stopped
    (or never started) and answered with this."""
    return ApiError(
        504,
        f"the request for '{name}' did not finish within its deadline ({deadline_s:g}s, "
        "server.request_deadline_s); ask for fewer tokens or retry later",
        type="server_error",
        code="deadline_exceeded",
    )


def model_stalled(name: str, stall_s: float) -> ApiError:
    """The process serving ``name`` was killed by the stall watchdog: its generation made no
    progress for ``stall_s`` (``worker.stall_s``). Not retried: the request may be what hangs."""
    return ApiError(
        500,
        f"the process serving '{name}' made no progress for {stall_s:g}s while running this "
        "request (worker.stall_s) and was killed; the request is not retried",
        type="server_error",
        code="model_stalled",
    )


def client_closed(name: str) -> ApiError:
    """The client went away before its reply began: its request was withdrawn. Nobody reads
    this answer (it ends the web thread's wait)."""
    return ApiError(
        499,
        f"the client closed the connection; the request for '{name}' was withdrawn",
        type="server_error",
        code="client_closed",
    )
