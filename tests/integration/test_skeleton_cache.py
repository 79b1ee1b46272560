"""Skeletons written by engines starting at once (serve workers): each gets a whole file.

A real daemon gives the expert extents (MoedSource); skeleton_for writes the file with
holes. Several threads write the same skeleton concurrently, as several engine
processes do when `moectl serve --workers N` starts: each writer uses its own
temporary name, so whatever the interleaving, the file every one of them is handed
equals the real file outside the expert ranges and holds zeros inside them.
"""

from __future__ import annotations

import os
import threading

from moed.engines.skeleton import expert_ranges, skeleton_for
from moed.engines.sources import MoedSource


def test_concurrent_writers_each_get_a_whole_skeleton(start_daemon, model_factory, tmp_path):
    model = model_factory(embd=512, ff=512, align=4096, experts=16)
    d = start_daemon("16MiB")
    n = 4
    clients = [d.client(f"w{i}") for i in range(n)]
    sources = [MoedSource(c, str(model)) for c in clients]
    barrier = threading.Barrier(n)
    out: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            barrier.wait(10)
            out[i] = skeleton_for(sources[i], tmp_path)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in clients:
        c.close()
    assert not errors, errors
    (path,) = {p for paths in out.values() for p in paths}
    real = sources[0].files[0]
    holes = expert_ranges(sources[0], 0)
    with open(real, "rb") as r, open(path, "rb") as s:
        want, got = r.read(), s.read()
    assert len(got) == len(want)
    pos = 0
    for lo, hi in holes:
        assert got[pos:lo] == want[pos:lo], "a dense range differs from the real file"
        assert not any(got[lo:hi]), "an expert range holds bytes"
        pos = hi
    assert got[pos:] == want[pos:]
    assert not [f for f in os.listdir(os.path.dirname(path)) if ".partial" in f], "a temporary file was left"
