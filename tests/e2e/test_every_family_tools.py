"""The engine's tools on every architecture make-model writes: a trace with the look-ahead's
predictions (`moectl trace`), and substitution, at an evicting budget.

The arch matrix checks each family's bytes and logits; this checks that what sits on
top of the engine (its observers, the predictor's recording, the routing rewrite) has
nothing family-specific left out: every step of the trace has every layer's routes,
the look-ahead predicted the layers it can (all but the first, and never a hash-routed
one), and substitution ran without stopping a graph.
"""

from __future__ import annotations

import numpy as np
import pytest

from moed.modelgen import makemodel
from tests.e2e.conftest import LLAMA_KW

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")

N_PREDICT = 4


@pytest.mark.parametrize("arch", sorted(makemodel.ARCHS))
def test_trace_and_substitution_run_on_every_family(arch, model_factory, start_daemon, tmp_path):
    from moed.engines.llama_cpp import StreamedLlama
    from moed.engines.tracing import record_trace
    from moed.traces import Trace

    path = model_factory(arch=arch)
    client = start_daemon("256KiB").client("tools")
    llm = StreamedLlama(str(path), client=client, subst=0.5, **LLAMA_KW)
    try:
        steps = record_trace(llm, ["the expert model reads"], str(tmp_path / "t.npz"), n_predict=N_PREDICT)
        stats = llm.stream_stats()
        hashed = llm.streamer.lookahead.predictor.hashed
        layers = list(llm.streamer.source.moe_layers)
        evictions = client.stats()["evictions"]
    finally:
        llm.close()
        client.close()
    trace = Trace.load(str(tmp_path / "t.npz"))
    assert steps == trace.n_steps == 1 + N_PREDICT  # the prompt, then each generated token
    assert evictions > 0
    assert "subst_per_token" in stats  # substitution ran (how often depends on what was resident)
    predicted = [i for i, layer in enumerate(layers) if i > 0 and layer not in hashed]
    assert trace.ids.shape[1] == len(layers) and (trace.ids >= 0).all()  # every layer routed every token
    assert trace.ahead1 is not None
    decode = np.flatnonzero(trace.token_kinds == ord("D"))
    assert len(decode) == N_PREDICT
    for t in decode:  # the look-ahead predicted every layer it can, on every family
        assert all((trace.ahead1[t, i] >= 0).any() for i in predicted), (arch, int(t))
