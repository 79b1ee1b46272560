"""Budget specs in a model's terms (moed.gguf.budget): shares of every expert's slot bytes, or sizes."""

from __future__ import annotations

import pytest

from moed.badinput import BadInput
from moed.gguf.budget import all_experts_bytes, parse_budget, slot_bytes_by_layer
from moed.gguf.catalog import Catalog
from moed.protocol.layout import PAGE


def test_every_expert_in_slot_bytes(tiny_model):
    cat = Catalog.open(tiny_model)
    per_layer = slot_bytes_by_layer(tiny_model)
    assert set(per_layer) == set(cat.moe_layers)
    assert all(b % PAGE == 0 and b >= cat.expert_bytes(l) for l, b in per_layer.items())
    assert all_experts_bytes(tiny_model) == cat.n_experts * sum(per_layer.values())


def test_shares_and_sizes(tiny_model):
    everything = all_experts_bytes(tiny_model)
    assert parse_budget("100%", tiny_model) == everything
    assert parse_budget(" 50% ", tiny_model) == everything // 2
    assert parse_budget("0.0001%", tiny_model) == PAGE  # never under a page
    assert parse_budget("512MiB", tiny_model) == 512 << 20
    assert parse_budget("4096", tiny_model) == 4096


@pytest.mark.parametrize("spec", ["lots", "x%", "0%", "101%"])
def test_a_bad_spec_is_bad_input(tiny_model, spec):
    with pytest.raises(BadInput):
        parse_budget(spec, tiny_model)
