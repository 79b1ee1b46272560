"""Run a test's body in a fresh fork of the test process: the e2e tests' engines start as users' do.

What this module owns: `run_forked(item)`, used by tests/e2e/conftest.py's
`pytest_pyfunc_call`. The fixtures are set up and torn down in the test process as
usual (daemons, models, temporary dirs: their owners stay there, so a daemon is
stopped even when the test body crashes); only the test function runs in a child
forked for it, which reports its outcome back through a pipe.

Why: a llama.cpp engine leaves state in its process (loaded libraries, ggml's
statics, Python caches around them), and an engine started after another one in the
same process can pass where a user's first engine aborts (issue 30: 12 of 12 cases
crashed alone, 20 passed after another file). The test process never runs a test
body, so it never holds engine state, and every body starts from the same process
state whatever ran before it, in any order.

Invariants:
- The child never returns into pytest: it reports and leaves with os._exit.
- Outcomes cross the pipe as JSON: passed, skipped (with the reason), xfailed, or
  failed with pytest's own rendering of the exception. A child that dies without
  reporting (a signal, an abort inside llama.cpp) fails the test with the signal's
  name; the test process carries on.
- The test process itself never computes with llama.cpp: ggml's OpenMP pool, once
  started in a process, deadlocks every fork of it that computes (libgomp does not
  survive fork). A fixture that needs an engine runs it with `call_forked`.
- A body that does not report within `BODY_TIMEOUT_S` is killed and fails as hung,
  so one deadlock cannot hold the suite past CI's limit.
- `MOED_TEST_IN_PROCESS=1` runs bodies in the test process (for a debugger).
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import sys
import time

import pytest
from _pytest._code import ExceptionInfo


def _child(item: pytest.Function, w: int) -> None:
    try:
        args = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
        item.obj(**args)
        outcome = {"kind": "passed"}
    except pytest.skip.Exception as e:
        outcome = {"kind": "skipped", "text": str(e.msg)}
    except pytest.xfail.Exception as e:
        outcome = {"kind": "xfailed", "text": str(e.msg)}
    except BaseException:  # noqa: BLE001  (whatever ends the body is its outcome)
        info = ExceptionInfo.from_current()
        outcome = {"kind": "failed", "text": str(info.getrepr(style="long", funcargs=False, truncate_locals=True))}
    data = json.dumps(outcome).encode()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    view = memoryview(data)
    while view:
        view = view[os.write(w, view) :]
    os._exit(0)


BODY_TIMEOUT_S = 900.0


def _read_all(r: int, pid: int, what: str) -> bytes:
    """Everything the child writes to `r` until it closes it, or kill it at the deadline."""
    chunks, deadline = [], time.monotonic() + BODY_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([r], [], [], max(0.0, left))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            pytest.fail(f"{what} did not finish within {BODY_TIMEOUT_S:.0f} s: killed (a deadlock?)", pytrace=False)
        chunk = os.read(r, 1 << 16)
        if not chunk:
            os.close(r)
            return b"".join(chunks)
        chunks.append(chunk)


def call_forked(fn, *args):
    """`fn(*args)` computed in a fork and its (picklable) result returned here: for fixtures
    that need an engine, so the test process never starts ggml's thread pool."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            try:
                data = pickle.dumps(("ok", fn(*args)))
            except BaseException as exc:  # noqa: BLE001  (re-raised in the parent)
                data = pickle.dumps(("error", repr(exc)))
            view = memoryview(data)
            while view:
                view = view[os.write(w, view) :]
        finally:
            os._exit(0)
    os.close(w)
    data = _read_all(r, pid, f"{getattr(fn, '__name__', fn)} in a fork")
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)}'s fork died without a result: {_death(status)}")
    kind, value = pickle.loads(data)
    if kind == "error":
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in its fork: {value}")
    return value


def _death(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by {signal.Signals(sig).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def run_forked(item: pytest.Function) -> None:
    """Run `item`'s test function in a forked child and raise its outcome here."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _child(item, w)
        finally:
            os._exit(70)  # _child always exits; this only guards against a bug in it
    os.close(w)
    data = _read_all(r, pid, "the test body")
    _, status = os.waitpid(pid, 0)
    if not data:
        pytest.fail(f"the test body's process died without reporting: {_death(status)}", pytrace=False)
    outcome = json.loads(data)
    kind, text = outcome["kind"], outcome.get("text", "")
    if kind == "skipped":
        pytest.skip(text)
    if kind == "xfailed":
        pytest.xfail(text)
    if kind == "failed":
        pytest.fail(text, pytrace=False)


def in_process() -> bool:
    return os.environ.get("MOED_TEST_IN_PROCESS") == "1"
