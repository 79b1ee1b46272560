"""StreamedLlama on a drive that fails one expert's read (btrfs on a loop device, root only).

The expert is one a prompt A routes to and a prompt B does not (found by running
both on the pristine model: `bad_expert` in tests/e2e/conftest.py); 4 KiB of its
`down` part is overwritten under the filesystem, so the kernel answers EIO for it
(moed.testing.faultfs). The eval of
A raises the daemon's ReadError naming the expert and ends with no lease held;
so does a completion of A; B, evaluated next on the same engine, is bit-exact
with resident llama.cpp on the pristine file.

The engine loads a skeleton (the file with holes for the experts): llama.cpp maps
the model with MAP_POPULATE, and populating a mapping over the bad block did not
return here (the load spun in the kernel for minutes), while the skeleton's
load reads only dense bytes and every expert comes from the daemon.
"""

from __future__ import annotations

import pytest

from moed.protocol import errors
from moed.testing import DaemonProcess

from .conftest import LLAMA_KW, assert_bit_equal, bad_expert

pytestmark = pytest.mark.e2e

KW = {**LLAMA_KW, "logits_all": True}


@pytest.fixture(scope="module")
def bad_case(llama_cpp, model_factory):
    """(bad model path, pristine path, A's text, A tokens, B tokens, (layer, expert) only A routes to)."""
    with bad_expert(model_factory) as bad:
        yield str(bad.path), str(bad.pristine), bad.a.decode(), bad.a_tokens, bad.b_tokens, (bad.layer, bad.expert)


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
