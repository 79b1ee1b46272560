"""Error codes on the wire and the exception types they become in Python.

Invariant: a code is never reused or renumbered; new codes are appended.
Every exception raised across the wire is a `MoedError` subclass whose `code`
names it, so `error_for(code, message)` rebuilds the same type on the client.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    INTERNAL = 1
    BAD_FRAME = 2           # undecodable bytes, unknown tag, oversize frame
    BAD_REQUEST = 3         # well-formed frame, invalid contents
    VERSION_MISMATCH = 4
    NOT_HELLO = 5           # first frame was not Hello
    UNKNOWN_MODEL = 6
    BAD_MODEL_FILE = 7      # not GGUF, truncated, no routed experts, shards disagree
    UNKNOWN_LAYER = 8
    UNKNOWN_EXPERT = 9
    UNKNOWN_LEASE = 10
    BUDGET_EXHAUSTED = 11   # waited up to the timeout, nothing could be evicted
    REQUEST_TOO_LARGE = 12  # can never fit in the budget
    READ_ERROR = 13         # the drive or file failed a read
    PERMISSION_DENIED = 14
    SHUTTING_DOWN = 15
    VERIFY_MISMATCH = 16    # verify mode: bytes read differ from the first read
    DAEMON_UNAVAILABLE = 17  # client side only: no daemon, or it went away
    MODEL_STALE = 18        # the file changed under an open model
    TOO_MANY_CLIENTS = 19   # max_clients connections are open already


class MoedError(Exception):
    """Base of every moed error; `code` is its wire code."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = ""):
        super().__init__(message or self.__class__.__name__)
        self.message = message


def _define(name: str, code: ErrorCode, doc: str) -> type[MoedError]:
    cls = type(name, (MoedError,), {"code": code, "__doc__": doc})
    cls.__module__ = __name__
    return cls


InternalError = _define("InternalError", ErrorCode.INTERNAL, "A bug in the daemon; it keeps serving.")
BadFrame = _define("BadFrame", ErrorCode.BAD_FRAME, "The frame could not be decoded.")
BadRequest = _define("BadRequest", ErrorCode.BAD_REQUEST, "The request's contents are invalid.")
VersionMismatch = _define("VersionMismatch", ErrorCode.VERSION_MISMATCH, "Client and daemon protocol versions differ.")
NotHello = _define("NotHello", ErrorCode.NOT_HELLO, "The first request on a connection must be Hello.")
UnknownModel = _define("UnknownModel", ErrorCode.UNKNOWN_MODEL, "No open model has that id.")
BadModelFile = _define("BadModelFile", ErrorCode.BAD_MODEL_FILE, "The file is not a usable MoE GGUF.")
UnknownLayer = _define("UnknownLayer", ErrorCode.UNKNOWN_LAYER, "The model has no routed experts in that layer.")
UnknownExpert = _define("UnknownExpert", ErrorCode.UNKNOWN_EXPERT, "The expert index is out of range.")
UnknownLease = _define("UnknownLease", ErrorCode.UNKNOWN_LEASE, "This connection holds no lease with that id.")
BudgetExhausted = _define("BudgetExhausted", ErrorCode.BUDGET_EXHAUSTED, "Nothing could be evicted before the timeout.")
RequestTooLarge = _define("RequestTooLarge", ErrorCode.REQUEST_TOO_LARGE, "The request can never fit in the budget.")
ReadError = _define("ReadError", ErrorCode.READ_ERROR, "Reading expert bytes from the model file failed.")
PermissionDenied = _define("PermissionDenied", ErrorCode.PERMISSION_DENIED, "The peer may not do this.")
ShuttingDown = _define("ShuttingDown", ErrorCode.SHUTTING_DOWN, "The daemon is stopping.")
VerifyMismatch = _define("VerifyMismatch", ErrorCode.VERIFY_MISMATCH, "Expert bytes differ from their first read.")
DaemonUnavailable = _define("DaemonUnavailable", ErrorCode.DAEMON_UNAVAILABLE, "No daemon answers on the socket.")
ModelStale = _define("ModelStale", ErrorCode.MODEL_STALE, "The model file changed; open it again.")
TooManyClients = _define("TooManyClients", ErrorCode.TOO_MANY_CLIENTS, "The daemon serves its maximum of clients.")

_BY_CODE: dict[int, type[MoedError]] = {
    cls.code: cls for cls in MoedError.__subclasses__()
}


def error_for(code: int, message: str) -> MoedError:
    """The exception for a wire code; unknown codes become InternalError."""
    return _BY_CODE.get(code, InternalError)(message)


__all__ = ["ErrorCode", "MoedError", "error_for"] + [c.__name__ for c in _BY_CODE.values()]
