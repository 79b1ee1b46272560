"""The life of `moectl serve`: start the workers, serve on one port, drain, stop.

What this module owns: the order of things in the front process.

0. the command line (moed.cli.serve) validates the settings and `exec_front`s a
   fresh interpreter for the front (same pid), without llama.cpp loaded;
1. startup: a private run directory (0700) for the workers' specs and sockets;
   every model's workers started (moed.serve.supervisor) and every one answering
   before the port is bound, so a client that can connect is served; a worker
   that cannot start fails the server with its exit status (its log is above it);
2. serve: the front (moed.serve.front) on uvicorn, on the one listening socket;
   metrics on their own port if asked;
3. shutdown on SIGTERM or SIGINT: uvicorn stops accepting and lets in-flight
   requests finish for `grace_s` (then cancels them), the pools refuse what still
   waits, every worker gets SIGTERM (SIGKILL after the grace), the run directory
   is removed, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn

import uvicorn

from moed.serve.front import Front
from moed.serve.metrics import ServeMetrics
from moed.serve.pool import WorkerPool, WorkerSlot
from moed.serve.supervisor import Backoff, WorkerFailed, WorkerSupervisor
from moed.serve.worker import WorkerSpec


@dataclass(frozen=True)
class ServedModel:
    """One model of the server: its alias, its llama_cpp.server settings (JSON), its worker count
    and its engine options (moed.engines.options.EngineOptions fields, its dataclasses.asdict:
    the command's flags with the model's own from the config, checked by moed.cli.serve)."""

    alias: str
    settings: dict
    workers: int = 1
    engine: dict = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ServePlan:
    host: str
    port: int
    models: list[ServedModel]
    socket_path: str | None  # the daemon's (every model's engine options name it)
    server: dict  # llama_cpp.server ServerSettings, as JSON (what every worker runs)
    queue_bound: int = 16
    queue_timeout_s: float | None = 300.0
    grace_s: float = 10.0
    api_key: str | None = None
    metrics_listen: tuple[str, int] | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    verbose: bool = False
    backoff: Backoff = Backoff()


class _Server(uvicorn.Server):
    """uvicorn's server, but a SIGTERM it drained for ends in exit 0, not in the signal re-raised;
    `on_exit` runs at the first stop signal (the drain starts)."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        saved = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)


def _pools(plan: ServePlan, run_dir: str) -> tuple[dict[str, WorkerPool], list[WorkerSupervisor]]:
    interrupting = bool(plan.server.get("interrupt_requests"))
    pools, supervisors = {}, []
    for m_index, model in enumerate(plan.models):
        sockets = [os.path.join(run_dir, f"m{m_index}-w{i}.sock") for i in range(model.workers)]
        spec_path = os.path.join(run_dir, f"m{m_index}.json")
        WorkerSpec(model.engine, plan.server, model.settings, sockets, plan.verbose).write(spec_path)
        slots = [WorkerSlot(i, path) for i, path in enumerate(sockets)]
        pool = WorkerPool(model.alias, slots, plan.queue_bound, interrupting, plan.queue_timeout_s)
        pools[model.alias] = pool
        supervisors += [WorkerSupervisor(pool, slot, spec_path, plan.backoff) for slot in slots]
    return pools, supervisors


async def _all_ready(supervisors: list[WorkerSupervisor]) -> bool:
    try:
        await asyncio.gather(*(s.ready() for s in supervisors))
        return True
    except WorkerFailed as exc:
        print(f"moectl serve: {exc}", file=sys.stderr, flush=True)
        return False


def _front_server(plan: ServePlan, front: Front, supervisors: list[WorkerSupervisor]) -> _Server:
    config = uvicorn.Config(
        front,
        host=plan.host,
        port=plan.port,
        ssl_keyfile=plan.ssl_keyfile,
        ssl_certfile=plan.ssl_certfile,
        log_level="info" if plan.verbose else "warning",
        access_log=plan.verbose,
        timeout_graceful_shutdown=int(plan.grace_s),
        lifespan="on",
    )

    def drain() -> None:  # a worker that ends during the drain is not restarted
        for s in supervisors:
            s.drain()

    return _Server(config, on_exit=drain)


async def _serve(plan: ServePlan, run_dir: str) -> int:
    pools, supervisors = _pools(plan, run_dir)
    for s in supervisors:
        s.start()
    try:
        if not await _all_ready(supervisors):
            return 1
        metrics = ServeMetrics(pools)
        metrics_server = metrics.serve(*plan.metrics_listen) if plan.metrics_listen else None
        _announce(plan)
        await _front_server(plan, Front(pools, metrics, plan.api_key), supervisors).serve()
        if metrics_server is not None:
            metrics_server.shutdown()
        for pool in pools.values():
            pool.close()
        return 0
    finally:
        await asyncio.gather(*(s.stop(plan.grace_s) for s in supervisors))


def _announce(plan: ServePlan) -> None:
    names = ", ".join(f"{m.alias} ({m.workers} worker{'s' if m.workers != 1 else ''})" for m in plan.models)
    metrics = (
        f"; metrics on http://{plan.metrics_listen[0]}:{plan.metrics_listen[1]}/metrics" if plan.metrics_listen else ""
    )
    print(
        f"moectl serve: {names} on http://{plan.host}:{plan.port}/v1 (moed at {plan.socket_path}){metrics}",
        file=sys.stderr,
        flush=True,
    )


def run(plan: ServePlan) -> int:
    """Serve until SIGTERM or SIGINT (see module); the exit status."""
    run_dir = tempfile.mkdtemp(prefix="moectl-serve-")
    try:
        return asyncio.run(_serve(plan, run_dir))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def exec_front(plan: ServePlan) -> NoReturn:
    """Become a fresh `python -m moed.serve.lifecycle PLAN` (same pid), never returning.

    The command line validated the settings with llama-cpp-python's own classes,
    which load llama.cpp (~26 MiB private); the front needs none of it, so it
    starts over without it. The plan travels as a JSON file (0600: it may hold
    the API key) that the new image reads and removes.
    """
    fd, path = tempfile.mkstemp(prefix="moectl-serve-plan-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(dataclasses.asdict(plan), f)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "moed.serve.lifecycle", path])


def _read_plan(path: str) -> ServePlan:
    with open(path) as f:
        data = json.load(f)
    os.unlink(path)
    data["models"] = [ServedModel(**m) for m in data["models"]]
    data["backoff"] = Backoff(**data["backoff"])
    if data["metrics_listen"] is not None:
        data["metrics_listen"] = tuple(data["metrics_listen"])
    return ServePlan(**data)


if __name__ == "__main__":
    sys.exit(run(_read_plan(sys.argv[1])))


__all__ = ["ServePlan", "ServedModel", "exec_front", "run"]
