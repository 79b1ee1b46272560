"""StreamedLlama on a drive that fails one expert's read (btrfs on a loop device, root only).

The expert is one a prompt A routes to and a prompt B does not (found by running
both on the pristine model); 4 KiB of its `down` part is overwritten under the
filesystem, so the kernel answers EIO for it (moed.testing.faultfs). The eval of
A raises the daemon's ReadError naming the expert and ends with no lease held;
so does a completion of A; B, evaluated next on the same engine, is bit-exact
with resident llama.cpp on the pristine file.

The engine loads a skeleton (the file with holes for the experts): llama.cpp maps
the model with MAP_POPULATE, and populating a mapping over the bad block did not
return here (the load spun in the kernel for minutes), while the skeleton's
load reads only dense bytes and every expert comes from the daemon.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.testing import DaemonProcess

from .conftest import LLAMA_KW, assert_bit_equal

pytestmark = pytest.mark.e2e
faultfs = pytest.importorskip("moed.testing.faultfs")

TEXTS = [b"the expert model", b"one token at a time", b"reads memory pages", b"from the drive", b"zq", b"xv"]
KW = {**LLAMA_KW, "logits_all": True}


def _routes(path, texts) -> dict[bytes, tuple[list[int], dict[int, set[int]]]]:
    """text -> (its tokens, layer -> experts its prompt batch routed to), on the pristine model."""
    from moed.engines.llama_cpp import StreamedLlama

    seen: dict[int, set[int]] = defaultdict(set)

    def hook(layer, ids) -> None:
        seen[layer].update(int(e) for e in ids.ravel() if e >= 0)

    out = {}
    with DaemonProcess("64MiB") as d, d.client("routes") as c:
        llm = StreamedLlama(str(path), client=c, route_hook=hook, prefetch="off", repack="off", **KW)
        try:
            for text in texts:
                tokens = llm.tokenize(text)
                seen.clear()
                llm.reset()
                llm.eval(tokens)
                out[text] = (tokens, {k: set(v) for k, v in seen.items()})
        finally:
            llm.close()
    return out


@pytest.fixture(scope="module")
def bad_case(llama_cpp, model_factory):
    """(bad model path, pristine path, A's text, A tokens, B tokens, (layer, expert) only A routes to)."""
    if why := faultfs.unavailable():
        pytest.skip(f"real EIO needs a loop btrfs: {why}")
    src = model_factory(embd=256, ff=256, align=4096)  # page-aligned parts: one block is one expert's
    routes = _routes(src, TEXTS)
    for a, b in itertools.permutations(TEXTS, 2):
        (ta, ra), (tb, rb) = routes[a], routes[b]
        only_a = [(layer, e) for layer in sorted(ra) for e in sorted(ra[layer] - rb.get(layer, set()))]
        if only_a:
            break
    else:
        pytest.fail("no prompt pair routes apart: every prompt uses every expert")
    layer, expert = only_a[0]
    with faultfs.LoopBtrfs() as fs:
        path = fs.copy_in(src, "model.gguf")
        _, off, _ = Catalog.open(str(path)).extent(layer, expert, "down")
        fs.corrupt(path, off + 2 * 4096)
        yield str(path), str(src), a.decode(), ta, tb, (layer, expert)


def _leases(c) -> int:
    return sum(t["leases"] for t in c.stats()["tenants"])


def test_eval_raises_the_read_error_holds_nothing_and_the_next_prompt_is_bit_exact(bad_case, tmp_path):
    from moed.engines.llama_cpp import StreamedLlama, UnpackedLlama

    bad, pristine, a_text, ta, tb, (layer, expert) = bad_case
    ref = UnpackedLlama(pristine, repack="off", **KW)
    try:
        ref.eval(tb)
        want = ref.scores[: ref.n_tokens].copy()
    finally:
        ref.close()
    with DaemonProcess("64MiB") as d, d.client("engine") as c:
        llm = StreamedLlama(bad, client=c, repack="off", skeleton_dir=tmp_path, **KW)
        try:
            with pytest.raises(errors.ReadError) as info:
                llm.eval(ta)
            text = str(info.value)
            assert f"layer {layer} expert {expert} part down" in text and "[Errno 5] EIO" in text, text
            assert llm.streamer.held is None and _leases(c) == 0
            with pytest.raises(errors.ReadError, match=f"layer {layer} expert {expert}"):
                llm.create_completion(a_text, max_tokens=2)
            assert llm.streamer.held is None and _leases(c) == 0
            llm.reset()
            llm.eval(tb)
            assert_bit_equal(llm.scores[: llm.n_tokens], want)
            assert llm.streamer.held is None and _leases(c) == 0
        finally:
            llm.close()
        s = c.stats()
        assert s["read_errors"] >= 1 and s["quarantined_experts"] == 1
