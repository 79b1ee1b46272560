"""One engine worker: llama-cpp-python's server on one model, on a Unix socket of the front's.

What this module owns: the worker's process entry, `python -m moed.serve.worker
SPEC INDEX`. SPEC is the JSON the front wrote (`WorkerSpec`): the engine options,
the server settings, this model's settings and the socket path of each worker
index. The app is moed.serve.app's (StreamedLlama, the response guard, the
error table), so a worker answers exactly as a one-process `moectl serve` would.

Invariant: the worker dies with the front (PR_SET_PDEATHSIG: SIGTERM), so no
engine, and none of its daemon leases, outlives the server that started it.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerSpec:
    """What the front tells every worker of one model (written as JSON into its run directory)."""

    engine: dict  # this model's moed.engines.options.EngineOptions fields
    server: dict  # llama_cpp.server ServerSettings, as JSON
    model: dict  # llama_cpp.server ModelSettings, as JSON
    sockets: list[str]  # the Unix socket of worker i
    verbose: bool = False

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f)

    @classmethod
    def read(cls, path: str) -> WorkerSpec:
        with open(path) as f:
            return cls(**json.load(f))


def _die_with_parent() -> None:
    from moed import libc

    libc.die_with_parent(signal.SIGTERM)


def main(argv: list[str]) -> int:
    _die_with_parent()
    spec, index = WorkerSpec.read(argv[0]), int(argv[1])
    import uvicorn
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from moed.engines.options import EngineOptions
    from moed.serve.app import create_app

    app = create_app(
        EngineOptions(**spec.engine),
        server_settings=ServerSettings.model_validate(spec.server),
        model_settings=[ModelSettings.model_validate(spec.model)],
    )
    uvicorn.run(app, uds=spec.sockets[index], log_level="info" if spec.verbose else "warning", access_log=spec.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
