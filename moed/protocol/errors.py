"""Error codes on the wire and the exception types they become in Python.

Invariant: a code is never reused or renumbered; new codes are appended, and a
code that is retired stays in `RETIRED_CODES` so it is never handed out again.
Every exception raised across the wire is a `MoedError` subclass whose `code`
names it, so `error_for(code, message)` rebuilds the same type on the client.
"""

from __future__ import annotations

import enum

# Codes once assigned and since retired, with what they meant: never reused.
RETIRED_CODES: dict[int, str] = {
    15: "SHUTTING_DOWN: never raised (a stopping daemon closes its connections instead)",
}


class ErrorCode(enum.IntEnum):
    INTERNAL = 1
    BAD_FRAME = 2  # undecodable bytes, unknown tag, oversize frame
    BAD_REQUEST = 3  # well-formed frame, invalid contents
    VERSION_MISMATCH = 4
    NOT_HELLO = 5  # first frame was not Hello
    UNKNOWN_MODEL = 6
    BAD_MODEL_FILE = 7  # not GGUF, truncated, no routed experts, shards disagree
    UNKNOWN_LAYER = 8
    UNKNOWN_EXPERT = 9
    UNKNOWN_LEASE = 10
    BUDGET_EXHAUSTED = 11  # waited up to the timeout, nothing could be evicted
    REQUEST_TOO_LARGE = 12  # can never fit in the budget
    READ_ERROR = 13  # the drive or file failed a read
    PERMISSION_DENIED = 14
    # 15 is retired (RETIRED_CODES): never reuse it.
    VERIFY_MISMATCH = 16  # verify mode: bytes read differ from the first read
    DAEMON_UNAVAILABLE = 17  # client side only: no daemon, or it went away
    MODEL_STALE = 18  # the file changed under an open model
    TOO_MANY_CLIENTS = 19  # max_clients connections are open already
    TOO_BUSY = 20  # this tenant already has the most requests of a kind in flight
    TIMED_OUT = 21  # the connection sent no Hello (or nothing) for too long; it is closed
    LEASE_LOST = 22  # client side only: a local lease's slot changed before its release
    READ_TIMEOUT = 23  # an acquire's reads did not finish before its timeout (a slow or stalled drive)
    LAYOUT_UNAVAILABLE = 24  # the model's experts are not in the layout the engine asked for (repacked or plain)


class MoedError(Exception):
    """Base of every moed error; `code` is its wire code."""

    code: ErrorCode = ErrorCode.INTERNAL
    # The facts an error of this type may carry besides its message: they travel in the
    # Error reply's `detail` and are attributes on the client (None when not sent).
    DETAIL: tuple[str, ...] = ()

    def __init__(self, message: str = "", **detail: int | str):
        super().__init__(message or self.__class__.__name__)
        self.message = message
        self.detail = {k: v for k, v in detail.items() if k in self.DETAIL}
        for name in self.DETAIL:
            setattr(self, name, self.detail.get(name))


class InternalError(MoedError):
    """A bug in the daemon; it keeps serving."""

    code = ErrorCode.INTERNAL


class BadFrame(MoedError):
    """The frame could not be decoded."""

    code = ErrorCode.BAD_FRAME


class BadRequest(MoedError):
    """The request's contents are invalid."""

    code = ErrorCode.BAD_REQUEST


class VersionMismatch(MoedError):
    """Client and daemon protocol versions differ."""

    code = ErrorCode.VERSION_MISMATCH


class NotHello(MoedError):
    """The first request on a connection must be Hello."""

    code = ErrorCode.NOT_HELLO


class UnknownModel(MoedError):
    """No open model has that id."""

    code = ErrorCode.UNKNOWN_MODEL


class BadModelFile(MoedError):
    """The file is not a usable MoE GGUF."""

    code = ErrorCode.BAD_MODEL_FILE


class UnknownLayer(MoedError):
    """The model has no routed experts in that layer."""

    code = ErrorCode.UNKNOWN_LAYER


class UnknownExpert(MoedError):
    """The expert index is out of range."""

    code = ErrorCode.UNKNOWN_EXPERT


class UnknownLease(MoedError):
    """This connection holds no lease with that id."""

    code = ErrorCode.UNKNOWN_LEASE


class BudgetExhausted(MoedError):
    """Nothing could be evicted before the timeout."""

    code = ErrorCode.BUDGET_EXHAUSTED


class RequestTooLarge(MoedError):
    """The request can never fit in the budget."""

    code = ErrorCode.REQUEST_TOO_LARGE


class ReadError(MoedError):
    """Reading expert bytes from the model file failed (or failed recently: quarantined).

    `model` (its path), `model_id`, `layer`, `expert`, `part` and `errno` say which read
    and what the kernel answered, when the daemon knows."""

    code = ErrorCode.READ_ERROR
    DETAIL = ("model", "model_id", "layer", "expert", "part", "errno")


class PermissionDenied(MoedError):
    """The peer may not do this."""

    code = ErrorCode.PERMISSION_DENIED


class VerifyMismatch(MoedError):
    """Expert bytes differ from their first read."""

    code = ErrorCode.VERIFY_MISMATCH


class DaemonUnavailable(MoedError):
    """No daemon answers on the socket."""

    code = ErrorCode.DAEMON_UNAVAILABLE


class ModelStale(MoedError):
    """The model file changed; open it again."""

    code = ErrorCode.MODEL_STALE


class TooManyClients(MoedError):
    """The daemon serves its maximum of clients."""

    code = ErrorCode.TOO_MANY_CLIENTS


class TooBusy(MoedError):
    """This tenant already has the most requests of this kind in flight; retry later.

    `busy` says what: "opens" (model opens in flight, which finish by themselves:
    `Client.open_model` waits for them), "models" (max_models open and in use)."""

    code = ErrorCode.TOO_BUSY
    DETAIL = ("busy",)
    busy: str | None


class TimedOut(MoedError):
    """The connection sent no Hello, or nothing at all, for too long; the daemon closed it."""

    code = ErrorCode.TIMED_OUT


class LeaseLost(MoedError):
    """A local lease's slot was refilled before it was released (the daemon had closed the
    connection and its holds outlived the grace): what was read from it may be wrong."""

    code = ErrorCode.LEASE_LOST


class ReadTimeout(MoedError):
    """The reads an acquire waited on did not finish before its timeout: the drive is slow
    or stalled. Nothing is held; the reads go on, and a later acquire may find them done."""

    code = ErrorCode.READ_TIMEOUT


class LayoutUnavailable(MoedError):
    """The model's expert bytes are not in the layout the engine computes on: a plain file
    asked for repacked kernels, a repacked file for plain ones, or a file repacked for
    another CPU's llama.cpp (`moectl align --repack` makes one for this CPU)."""

    code = ErrorCode.LAYOUT_UNAVAILABLE


_BY_CODE: dict[int, type[MoedError]] = {cls.code: cls for cls in MoedError.__subclasses__()}


def error_for(code: int, message: str, detail: dict | None = None) -> MoedError:
    """The exception for a wire code (with the facts its type carries); unknown codes
    become InternalError."""
    cls = _BY_CODE.get(code, InternalError)
    return cls(message, **{k: v for k, v in (detail or {}).items() if k in cls.DETAIL})


__all__ = ["RETIRED_CODES", "ErrorCode", "MoedError", "error_for"] + [c.__name__ for c in _BY_CODE.values()]
