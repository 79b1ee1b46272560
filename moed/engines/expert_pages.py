"""The routed-expert address ranges inside llama.cpp's mapping of a model, page by page.

What this module owns: turning every routed-expert byte range of the model mapping
into inaccessible memory at install, and making one expert's bytes visible at
its own address (`show`) or inaccessible again (`hide`).

Invariants:
- After `install`, an address of a routed expert holds either that expert's true
  bytes (it is shown), or zeros, or faults (PROT_NONE). An expert never acquired
  always faults. In the default relaxed mode a released zero-copy expert may
  still show the slot it last had (possibly reused by now); in `strict` mode it
  faults again. It never holds another
  expert's bytes. Only bytes on a page shared with dense data or with a
  neighbouring shown expert can be readable while hidden, and those read as zero
  or as this expert's own bytes.
- Zero-copy spans (expert 0 and the stride page-aligned) map the daemon's slot
  pages straight in with MAP_SHARED|MAP_FIXED, read-only. The slot behind an
  address is remembered: showing the same slot again is one mprotect (none when
  not `strict`), and only a changed slot costs a new mapping.
- Copy spans copy into private anonymous pages. A page is made writable while any
  shown expert covers it (per-page count), and dropped (MADV_DONTNEED, PROT_NONE)
  when the count falls to zero, so a copy engine never accumulates the model.
- Dense bytes that share a page with expert bytes are copied into a private
  anonymous page at install and stay readable; the expert bytes there are zeroed.
- After a failed layer under a GPU offload (`open_zeros`), every expert address reads
  zeros until `close_zeros`: ggml's scheduler only leaves the failing split, and a later
  split's expert matmul must read mapped memory, not fault (docs/design.md §9.2). What
  was shown before is forgotten then: every expert is hidden again by `close_zeros`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable
from dataclasses import dataclass, field

from moed import libc
from moed.engines.vm import PAGE, page_ceil, page_floor
from moed.libc import PROT_NONE, PROT_READ, PROT_WRITE


@dataclass(frozen=True)
class PartSpan:
    """One routed-expert tensor (one part of one layer) as it sits in our address space."""

    layer: int
    part: str
    addr: int  # address of expert 0
    bytes_per_expert: int
    n_experts: int

    @property
    def zero_copy(self) -> bool:
        return self.addr % PAGE == 0 and self.bytes_per_expert % PAGE == 0

    def expert_addr(self, expert: int) -> int:
        return self.addr + expert * self.bytes_per_expert

    @property
    def end(self) -> int:
        return self.addr + self.n_experts * self.bytes_per_expert


def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def gaps(lo: int, hi: int, holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [lo, hi) that sorted `holes` do not cover."""
    out, pos = [], lo
    for s, e in holes:
        if e <= pos or s >= hi:
            continue
        if s > pos:
            out.append((pos, s))
        pos = max(pos, e)
    if pos < hi:
        out.append((pos, hi))
    return out


@dataclass
class _ZeroCopyState:
    key: tuple[Hashable, int] | None = None  # (segment identity, offset) mapped here
    visible: bool = False


@dataclass
class PageStats:
    maps: int = 0  # MAP_FIXED of a slot (the slot behind an address changed)
    reprotects: int = 0  # same slot shown again: one mprotect
    copies: int = 0
    copy_bytes: int = 0
    hides: int = 0


@dataclass
class ExpertPages:
    """All routed-expert spans of one loaded model (every shard mapping together)."""

    spans: list[PartSpan]
    # Relaxed (the default, DESIGN "only remap when the slot behind an address
    # changed"): a released zero-copy expert stays mapped to its last slot, so a
    # repeated hit costs no syscall; llama.cpp only reads the experts its router
    # chose, and those are acquired (and remapped if their slot moved) first.
    # strict: a released zero-copy expert goes back to PROT_NONE, so any read of an
    # expert not granted right now faults (tests, debugging; ~1.5x slower decode).
    # Copy spans are always hidden (their pages are dropped).
    strict: bool = False
    stats: PageStats = field(default_factory=PageStats)

    def __post_init__(self) -> None:
        self._by_key = {(s.layer, s.part): s for s in self.spans}
        self._expert_runs = merge([(s.addr, s.end) for s in self.spans])
        self._mixed_pages = self._find_mixed_pages()
        self._page_refs: dict[int, int] = {}
        self._zc: dict[tuple[int, str, int], _ZeroCopyState] = {}
        self.zeroed = False  # between open_zeros and close_zeros: every expert reads zeros

    # ---- install ---------------------------------------------------------

    def _find_mixed_pages(self) -> set[int]:
        """Pages holding both routed-expert bytes and anything else (dense bytes, padding)."""
        mixed = set()
        for s, e in self._expert_runs:
            if s % PAGE:
                mixed.add(page_floor(s))
            if e % PAGE:
                mixed.add(page_floor(e))
        return mixed

    def install(self) -> None:
        """Make every routed-expert byte inaccessible; keep dense bytes on shared pages readable.

        Must run before the first decode and while the file mapping is still intact
        (the dense bytes of mixed pages are read from it).
        """
        saved = {p: ctypes.string_at(p, PAGE) for p in self._mixed_pages}
        for s, e in self._expert_runs:
            lo, hi = page_floor(s), page_ceil(e)
            libc.map_fixed(lo, hi - lo, PROT_NONE)
        for page, content in saved.items():
            libc.mprotect(page, PAGE, PROT_READ | PROT_WRITE)
            ctypes.memmove(page, content, PAGE)
        self._zero_mixed()

    def _pure_runs(self) -> list[tuple[int, int]]:
        """The page ranges that hold expert bytes only (no dense byte shares them)."""
        pure = [(page_ceil(s), page_floor(e)) for s, e in self._expert_runs]
        return [(s, e) for s, e in pure if s < e]

    def open_zeros(self) -> None:
        """Every expert address readable as zeros (private anonymous pages, read-only): the
        graph of a failed decode may still run expert matmuls on any expert, and none of
        them may fault. Shown experts are forgotten; `close_zeros` hides them all."""
        for lo, hi in self._pure_runs():
            libc.map_fixed(lo, hi - lo, PROT_READ)
        self._zero_mixed()
        self._page_refs.clear()
        self._zc.clear()
        self.zeroed = True

    def close_zeros(self) -> None:
        """After the failed decode: every expert inaccessible again, as after `install`."""
        if not self.zeroed:
            return
        for lo, hi in self._pure_runs():
            libc.map_fixed(lo, hi - lo, PROT_NONE)
        self.zeroed = False

    def reset(self) -> None:
        """Every expert inaccessible again and nothing remembered, as right after `install`:
        the daemon this engine mapped is gone (moed.engines.streamer, `rebind`), and no address
        may keep showing its segments' pages or be taken for showing a slot of the new one."""
        for lo, hi in self._pure_runs():
            libc.map_fixed(lo, hi - lo, PROT_NONE)  # drops every MAP_SHARED slot mapping there
        self._zero_mixed()
        self._page_refs.clear()
        self._zc.clear()
        self.zeroed = False

    def _zero_mixed(self) -> None:
        """Expert bytes on pages shared with dense bytes back to zero (a copied expert's)."""
        for page in self._mixed_pages:
            for s, e in self._expert_runs:
                lo, hi = max(s, page), min(e, page + PAGE)
                if lo < hi:
                    ctypes.memset(lo, 0, hi - lo)

    def dense_runs(self, vmas: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Parts of the model's mapping that are not pure expert pages (to lock)."""
        pure = self._pure_runs()
        out = []
        for lo, hi in merge(vmas + [(p, p + PAGE) for p in self._mixed_pages]):
            out += gaps(lo, hi, pure)
        return out

    # ---- show / hide -----------------------------------------------------

    def span(self, layer: int, part: str) -> PartSpan:
        return self._by_key[(layer, part)]

    def show_mapped(self, span: PartSpan, expert: int, seg_key: Hashable, fd: int, offset: int) -> None:
        """Zero copy: the slot's pages at `offset` of segment `fd` appear at the expert's address."""
        state = self._zc.setdefault((span.layer, span.part, expert), _ZeroCopyState())
        addr, n = span.expert_addr(expert), span.bytes_per_expert
        key = (seg_key, offset)
        if state.key == key:
            if not state.visible:
                libc.mprotect(addr, n, PROT_READ)
                self.stats.reprotects += 1
        else:
            libc.map_fixed(addr, n, PROT_READ, fd, offset)
            state.key = key
            self.stats.maps += 1
        state.visible = True

    def show_copied(self, span: PartSpan, expert: int, src_addr: int) -> None:
        """Copy path: copy the expert's bytes from `src_addr` into private pages at its address."""
        addr, n = span.expert_addr(expert), span.bytes_per_expert
        fresh = []
        for page in range(page_floor(addr), page_ceil(addr + n), PAGE):
            refs = self._page_refs.get(page, 0)
            self._page_refs[page] = refs + 1
            if refs == 0 and page not in self._mixed_pages:
                fresh.append(page)
        for lo, hi in merge([(p, p + PAGE) for p in fresh]):
            libc.mprotect(lo, hi - lo, PROT_READ | PROT_WRITE)
        ctypes.memmove(addr, src_addr, n)
        self.stats.copies += 1
        self.stats.copy_bytes += n

    def hide(self, span: PartSpan, expert: int) -> None:
        if self.zeroed:
            return  # open_zeros forgot what was shown; close_zeros hides everything
        if span.zero_copy:
            self._hide_mapped(span, expert)
        else:
            self._hide_copied(span, expert)
        self.stats.hides += 1

    def _hide_mapped(self, span: PartSpan, expert: int) -> None:
        state = self._zc.get((span.layer, span.part, expert))
        if self.strict and state is not None and state.visible:
            libc.mprotect(span.expert_addr(expert), span.bytes_per_expert, PROT_NONE)
            state.visible = False

    def _hide_copied(self, span: PartSpan, expert: int) -> None:
        addr, n = span.expert_addr(expert), span.bytes_per_expert
        dropped = []
        for page in range(page_floor(addr), page_ceil(addr + n), PAGE):
            refs = self._page_refs.get(page, 0) - 1
            if refs < 0:
                raise RuntimeError(f"hide of an expert that is not shown: layer {span.layer} {span.part} {expert}")
            if refs == 0:
                del self._page_refs[page]
            else:
                self._page_refs[page] = refs
            if page in self._mixed_pages:
                # Dense bytes stay; this expert's bytes on the shared page go back to zero.
                lo, hi = max(addr, page), min(addr + n, page + PAGE)
                ctypes.memset(lo, 0, hi - lo)
            elif refs == 0:
                dropped.append(page)
        for lo, hi in merge([(p, p + PAGE) for p in dropped]):
            libc.madvise(lo, hi - lo, libc.MADV_DONTNEED)
            libc.mprotect(lo, hi - lo, PROT_NONE)
