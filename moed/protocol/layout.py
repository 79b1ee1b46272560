"""Slot layout of a size class segment, shared by daemon and client.

Part k of slot i lives at `part_off[k] + i * part_stride[k]`; each stride is the
part's size rounded up to a page, and parts are packed arrays one after another,
so the slots of one part form a ggml expert tensor with `capacity` experts.
"""

from __future__ import annotations

PAGE = 4096


def round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def slot_bytes(part_bytes) -> int:
    """RAM tier bytes of one slot: every part rounded up to a page (what the strides add up to)."""
    return sum(round_up(b) for b in part_bytes)


def slot_layout(part_bytes: list[int], capacity: int) -> tuple[list[int], list[int], int]:
    """(part_off, part_stride, segment_bytes) for `capacity` slots."""
    strides = [round_up(b) for b in part_bytes]
    offs, pos = [], 0
    for s in strides:
        offs.append(pos)
        pos += s * capacity
    return offs, strides, pos
