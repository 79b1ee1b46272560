"""ExpertPages on a plain file mapping: what is readable, what is not, and what bytes are where."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from moed.engines import vm
from moed.engines.expert_pages import ExpertPages, PartSpan, merge

PAGE = vm.PAGE


def perms_at(addr: int) -> str:
    for v in vm.read_maps():
        if v.start <= addr < v.end:
            return v.perms
    return ""


@pytest.fixture
def mapped(tmp_path):
    """A 64-page file of known bytes mapped read-only; yields (address, bytes, fd)."""
    data = np.random.default_rng(0).integers(0, 256, 64 * PAGE, dtype=np.uint8).tobytes()
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, len(data), mmap.MAP_SHARED, mmap.PROT_READ)
    arr = np.frombuffer(m, dtype=np.uint8)
    yield arr.ctypes.data, data, fd
    del arr
    m.close()
    os.close(fd)


def read(addr: int, n: int) -> bytes:
    import ctypes

    return ctypes.string_at(addr, n)


def test_merge_joins_touching_and_overlapping_runs():
    assert merge([(5, 9), (0, 3), (3, 4), (8, 12)]) == [(0, 4), (5, 12)]


def test_copy_span_hides_experts_and_keeps_dense_bytes_on_shared_pages(mapped):
    base, data, _ = mapped
    off, bpe, n = PAGE + 100, 3000, 8  # unaligned: shares its first/last page with dense bytes
    span = PartSpan(0, "gate", base + off, bpe, n)
    pages = ExpertPages([span])
    pages.install()
    assert not span.zero_copy
    # dense bytes just before and after the experts are still there
    assert read(base + PAGE, 100) == data[PAGE : PAGE + 100]
    end = off + n * bpe
    assert read(base + end, 50) == data[end : end + 50]
    # expert bytes on the shared first page read as zero, pure pages are inaccessible
    assert read(base + off, 10) == bytes(10)
    assert perms_at(base + 2 * PAGE) == "---p"
    src = np.frombuffer(data, dtype=np.uint8)
    pages.show_copied(span, 3, src.ctypes.data + off + 3 * bpe)
    assert read(span.expert_addr(3), bpe) == data[off + 3 * bpe : off + 4 * bpe]
    pages.hide(span, 3)
    assert perms_at(span.expert_addr(3) + PAGE) == "---p"
    assert pages.stats.copies == 1 and pages.stats.hides == 1


def test_neighbouring_experts_sharing_a_page_stay_correct(mapped):
    base, data, _ = mapped
    off, bpe = 4 * PAGE, 3000
    span = PartSpan(0, "up", base + off, bpe, 8)
    pages = ExpertPages([span])
    pages.install()
    src = np.frombuffer(data, dtype=np.uint8).ctypes.data
    pages.show_copied(span, 1, src + off + bpe)
    pages.show_copied(span, 2, src + off + 2 * bpe)
    pages.hide(span, 1)  # expert 2 shares a page with 1: it must survive
    assert read(span.expert_addr(2), bpe) == data[off + 2 * bpe : off + 3 * bpe]
    with pytest.raises(RuntimeError):
        pages.hide(span, 1)


def test_zero_copy_span_maps_the_slot_and_remaps_only_when_it_changes(mapped):
    base, data, fd = mapped
    span = PartSpan(0, "down", base + 8 * PAGE, 2 * PAGE, 4)
    pages = ExpertPages([span], strict=True)
    pages.install()
    assert span.zero_copy and perms_at(span.addr) == "---p"
    # "slots" are pages 40.. of the same file
    pages.show_mapped(span, 1, seg_key=7, fd=fd, offset=40 * PAGE)
    assert read(span.expert_addr(1), 2 * PAGE) == data[40 * PAGE : 42 * PAGE]
    pages.hide(span, 1)
    assert perms_at(span.expert_addr(1)) == "---s"
    pages.show_mapped(span, 1, seg_key=7, fd=fd, offset=40 * PAGE)  # same slot: one mprotect
    pages.show_mapped(span, 2, seg_key=7, fd=fd, offset=44 * PAGE)
    pages.hide(span, 1)
    pages.show_mapped(span, 1, seg_key=7, fd=fd, offset=50 * PAGE)  # the slot changed: map again
    assert read(span.expert_addr(1), 2 * PAGE) == data[50 * PAGE : 52 * PAGE]
    assert (pages.stats.maps, pages.stats.reprotects) == (3, 1)


def test_relaxed_mode_keeps_a_released_expert_mapped_until_its_slot_changes(mapped):
    base, data, fd = mapped
    span = PartSpan(0, "down", base + 8 * PAGE, 2 * PAGE, 4)
    pages = ExpertPages([span])
    pages.install()
    assert perms_at(span.expert_addr(3)) == "---p"  # never acquired: faults
    pages.show_mapped(span, 1, seg_key=7, fd=fd, offset=40 * PAGE)
    pages.hide(span, 1)
    assert perms_at(span.expert_addr(1)) == "r--s"
    pages.show_mapped(span, 1, seg_key=7, fd=fd, offset=40 * PAGE)  # no syscall at all
    assert (pages.stats.maps, pages.stats.reprotects) == (1, 0)
    pages.hide(span, 1)
    pages.show_mapped(span, 1, seg_key=7, fd=fd, offset=46 * PAGE)
    assert read(span.expert_addr(1), 2 * PAGE) == data[46 * PAGE : 48 * PAGE]
    assert pages.stats.maps == 2


def test_dense_runs_exclude_pure_expert_pages(mapped):
    base, _, _ = mapped
    span = PartSpan(0, "gate", base + PAGE + 100, 3 * PAGE, 2)
    pages = ExpertPages([span])
    runs = pages.dense_runs([(base, base + 64 * PAGE)])
    # pages 2..6 are pure expert pages; page 1 and 7 are shared with dense bytes
    assert runs == [(base, base + 2 * PAGE), (base + 7 * PAGE, base + 64 * PAGE)]


def test_after_a_failure_every_expert_reads_zeros_until_closed_then_all_are_hidden(mapped):
    """A failed decode under a GPU offload (docs/design.md §9.2): a later split's expert
    matmul may read any expert, shown or never acquired, and must read zeros, not fault;
    after the decode everything is hidden again and shows work as before."""
    base, data, fd = mapped
    src = np.frombuffer(data, dtype=np.uint8)
    copy = PartSpan(0, "gate", base + PAGE + 100, 3000, 8)  # shares pages with dense bytes
    zc = PartSpan(0, "up", base + 16 * PAGE, PAGE, 8)
    pages = ExpertPages([copy, zc])
    pages.install()
    pages.show_copied(copy, 2, src.ctypes.data + 40 * PAGE)
    pages.show_mapped(zc, 1, "seg", fd, 3 * PAGE)
    pages.open_zeros()
    for span in (copy, zc):
        for e in range(span.n_experts):
            assert read(span.expert_addr(e), span.bytes_per_expert) == bytes(span.bytes_per_expert)
    assert read(base + PAGE, 100) == data[PAGE : PAGE + 100], "dense bytes on a shared page stay"
    pages.hide(copy, 2)  # what was shown before the failure: forgotten, nothing to undo
    pages.hide(zc, 1)
    pages.close_zeros()
    assert perms_at(copy.expert_addr(4) + PAGE) == "---p" and perms_at(zc.expert_addr(1)) == "---p"
    assert read(copy.addr, 10) == bytes(10) and read(base + PAGE, 100) == data[PAGE : PAGE + 100]
    pages.show_mapped(zc, 1, "seg", fd, 3 * PAGE)  # shown again: mapped anew, not taken as still there
    assert read(zc.expert_addr(1), PAGE) == data[3 * PAGE : 4 * PAGE]
    pages.show_copied(copy, 2, src.ctypes.data + 40 * PAGE)
    assert read(copy.expert_addr(2), 3000) == data[40 * PAGE : 40 * PAGE + 3000]
    pages.hide(copy, 2)
    assert perms_at(copy.expert_addr(2) + PAGE) == "---p"
