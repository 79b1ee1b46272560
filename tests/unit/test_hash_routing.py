"""DeepSeek V4's routing in the predictor: sqrtsoftplus gating and the hash (token id) layers."""

from __future__ import annotations

import numpy as np
import pytest

from moed.engines.lookahead import Lookahead
from moed.engines.predictor import GATING_SQRT_SOFTPLUS, GatePredictor, Router, gate, load_routers, top
from tests.unit.test_lookahead import LAYERS, Drive, counts_add_up, routers, run_step

VOCAB, K = 50, 2


def test_sqrt_softplus_is_ggmls():
    x = np.array([[-30.0, -3.0, -0.5, 0.0, 0.5, 3.0, 19.9, 20.0, 20.5, 60.0]], np.float32)
    want = np.sqrt(np.where(x > 20, x.astype(np.float64), np.log1p(np.exp(x.astype(np.float64)))))
    got = gate(x, GATING_SQRT_SOFTPLUS)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    assert got[0, 0] == 0.0  # ggml's logf(1 + expf(x)), not log1p: 1 + expf(-30) is 1 in float
    assert got[0, -1] == np.sqrt(np.float32(60.0))  # above 20 ggml takes x itself: no exp overflow
    s = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    np.testing.assert_array_equal(top(gate(s, GATING_SQRT_SOFTPLUS), 4), top(s, 4))  # monotone


def hashed_routers(hashed: tuple[int, ...]) -> dict[int, Router]:
    rng = np.random.default_rng(7)
    table = np.argsort(rng.random((VOCAB, 16)), axis=1)[:, :K].astype(np.int32)
    return {
        layer: Router(r.weight, r.norm, r.bias, token_experts=table + layer if layer in hashed else None)
        for layer, r in routers().items()
    }


def test_hashed_layers_are_exact_from_token_ids_and_never_predicted_from_rows():
    rs = hashed_routers((1, 2))
    p = GatePredictor(rs, LAYERS)
    assert p.hashed == {1, 2}
    tokens = [3, 9, 3]
    got = p.token_experts(2, tokens)
    np.testing.assert_array_equal(got, rs[2].token_experts[tokens])  # type: ignore[index]
    assert (got[0] == got[2]).all()
    x = np.random.default_rng(1).standard_normal((3, routers()[1].weight.shape[1])).astype(np.float32)
    with pytest.raises(ValueError, match="token id"):
        p.scores(x, 1, 2)
    with pytest.raises(ValueError, match="router"):
        p.token_experts(3, tokens)

    drive = Drive()
    la = Lookahead(p, drive, "gate2", width=2, adapt=False)
    for step in range(4):
        x1 = x[step % 3 : step % 3 + 1]
        routes = {l: p.token_experts(l, [step]) if l in p.hashed else top(p.scores(x1, l, l), 2) for l in LAYERS}
        run_step(la, x1, routes)
    t = la.totals()
    assert counts_add_up(t) and t["prefetch_pending"] == 0
    assert {layer for layer, _ in drive.sent} == {3, 4}  # layer 3 from hashed layer 1's rows (two ahead) and 2's
    for layer in (1, 2):
        assert t["per_layer"][layer]["issued"] == 0 and t["per_layer"][layer]["recall"] is None
    assert t["per_layer"][3]["recall2"] is not None  # predicted two ahead, from the hashed layer 1


def test_made_deepseek4_carries_the_table_that_load_routers_reads(tmp_path):
    from moed.gguf.header import read_split
    from moed.modelgen.families.deepseek4 import HASH_LAYERS
    from moed.modelgen.makemodel import make_model

    path = make_model(tmp_path / "ds4.gguf", arch="deepseek4", layers=3)[0]
    headers = read_split(str(path))
    rs, gating = load_routers(headers, [str(path)], [0, 1, 2])
    tables = {layer: r.token_experts for layer, r in rs.items()}
    biased = {layer for layer, r in rs.items() if r.bias is not None}
    assert gating == GATING_SQRT_SOFTPLUS
    assert [layer for layer, t in tables.items() if t is not None] == list(range(HASH_LAYERS))
    assert biased == {1, 2}  # exp_probs_b only where the router selects
    table = tables[0]
    assert table is not None and table.dtype == np.int32 and table.shape[1] == 2  # make_model's used
    assert table.min() >= 0 and table.max() < 8 and (table[:, 0] != table[:, 1]).all()  # distinct experts
    assert len({tuple(r) for r in table.tolist()}) > 20  # tokens spread over the experts
