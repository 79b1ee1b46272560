"""One BLAS thread while llama.cpp computes: numpy's BLAS must not spin beside ggml's threads.

What this module owns: the limit on the BLAS thread pools numpy loaded (OpenBLAS in
numpy's wheels), held to one thread for the length of each llama_decode of a
streamed engine, and put back after, so the rest of the user's process keeps its
own setting.

Why: the engine's numpy work inside a decode (the gate-ahead predictor's router
products at each layer's router input, substitution) calls BLAS. OpenBLAS runs a
25 x 2048 by 2048 x 128 product on its own threads and leaves them spinning after
it returns, on the cores ggml's threads are computing on. Measured on a 25-token
prompt of the Qwen3-30B geometry, 2 vCPUs, 2 llama.cpp threads (bench/RESULTS.md,
issue 32): ggml's compute took 3.24 s with the predictor's BLAS free to use 2
threads against 1.94 s held to one, and the predictor's products 0.31 s against
0.018 s. threadpoolctl does the limiting (it finds each loaded BLAS and calls its
own set_num_threads); entering and leaving costs about 8 us, once a decode.
"""

from __future__ import annotations

import contextlib
from typing import Any

_controller: Any = None


def one_thread() -> contextlib.AbstractContextManager:
    """A context that holds every BLAS numpy loaded to one thread (nothing without threadpoolctl)."""
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # the llama extra brings it; a bare install only loses the limit
            _controller = False
        else:
            _controller = ThreadpoolController()
    if _controller is False:
        return contextlib.nullcontext()
    return _controller.limit(limits=1, user_api="blas")
