"""The stats schema is one table: the daemon's counters, the wire and the metrics agree on names."""

from __future__ import annotations

from dataclasses import fields

from moed.daemon.counters import WIRE, Counters, ModelUse, Tenant
from moed.protocol.stats import ModelRow, Stats, TenantModelRow, TenantRow, metric_fields


def test_every_counter_is_a_stats_field_or_named_off_the_wire():
    assert set(Counters().row()) <= set(Stats.__struct_fields__)
    assert set(WIRE) <= {f.name for f in fields(Counters)}


def test_tenant_and_model_use_counts_are_row_fields():
    assert {f.name for f in fields(ModelUse)} <= set(TenantModelRow.__struct_fields__)
    counts = {f.name for f in fields(Tenant) if f.type == "int"} - {"opens_in_flight"}  # not on the wire
    assert counts <= set(TenantRow.__struct_fields__)


def test_metric_names_are_unique_per_row_and_name_fields():
    for row in (Stats, ModelRow, TenantRow, TenantModelRow):
        names = [m.name for _, m in metric_fields(row)]
        assert len(names) == len(set(names)), row
        assert all(key in row.__struct_fields__ for key, _ in metric_fields(row))
    assert dict(metric_fields(Stats))["bytes_read"].name == "read_bytes"
