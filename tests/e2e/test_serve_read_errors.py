"""`moectl serve` on a drive that fails one expert's read: a 502 naming it, and the next request served.

The bad model lives on btrfs on a loop device with 4 KiB of one expert's bytes
overwritten under the filesystem (moed.testing.faultfs), so the kernel answers EIO
for that block: a real error through the real daemon into the real engine. The
expert is one prompt A's batch routes to and prompt B's does not (found on the
pristine model), and max_tokens=1 evaluates only the prompt, so A gets the 502 and
B, next on the same worker, is served. Root only, like the daemon's drive-fault tests.

The server loads a skeleton (`--skeleton-dir`, the file with holes for the
experts), as the engine's own drive-fault test does: llama.cpp maps a model with
MAP_POPULATE, and populating a mapping over the bad block does not return.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from moed.gguf.catalog import Catalog
from moed.testing import DaemonProcess

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")
pytest.importorskip("llama_cpp.server.app")  # the [server] extra
openai = pytest.importorskip("openai")
faultfs = pytest.importorskip("moed.testing.faultfs")

from tests.e2e.serving import BANNED, ServeProcess  # noqa: E402

TEXTS = ["the expert model", "one token at a time", "reads memory pages", "from the drive", "zq", "xv"]


def _prompt_routes(path) -> dict[str, dict[int, set[int]]]:
    """prompt -> layer -> experts its batch routes to, on the pristine model."""
    from moed.engines.llama_cpp import StreamedLlama

    seen: dict[int, set[int]] = defaultdict(set)

    def hook(layer, ids) -> None:
        seen[layer].update(int(e) for e in ids.ravel() if e >= 0)

    out = {}
    with DaemonProcess("64MiB") as d, d.client("routes") as c:
        llm = StreamedLlama(
            str(path), client=c, route_hook=hook, prefetch="off", repack="off", n_ctx=256, verbose=False
        )
        try:
            for text in TEXTS:
                seen.clear()
                llm.reset()
                llm.eval(llm.tokenize(text.encode()))
                out[text] = {k: set(v) for k, v in seen.items()}
        finally:
            llm.close()
    return out


@pytest.fixture(scope="module")
def bad_case(model_factory):
    """(bad model path, A, B, (layer, expert) only A routes to)."""
    if why := faultfs.unavailable():
        pytest.skip(f"real EIO needs a loop btrfs: {why}")
    src = model_factory(embd=256, ff=256, align=4096)  # page-aligned parts: one block is one expert's
    routes = _prompt_routes(src)
    for a, b in itertools.permutations(TEXTS, 2):
        only_a = [
            (layer, e) for layer in sorted(routes[a]) for e in sorted(routes[a][layer] - routes[b].get(layer, set()))
        ]
        if only_a:
            break
    else:
        pytest.fail("no prompt pair routes apart")
    layer, expert = only_a[0]
    with faultfs.LoopBtrfs() as fs:
        path = fs.copy_in(src, "bad.gguf")
        _, off, _ = Catalog.open(str(path)).extent(layer, expert, "down")
        fs.corrupt(path, off + 2 * 4096)
        yield path, a, b, (layer, expert)


def test_a_failed_expert_read_is_a_502_naming_it_and_the_next_request_is_served(bad_case, tmp_path):
    path, a, b, (layer, expert) = bad_case
    d = DaemonProcess("64MiB")
    server = None
    try:
        # The same kernels and no prefetch, as the routes were found with.
        engine = ["--skeleton-dir", str(tmp_path / "skeletons"), "--repack", "off", "--prefetch", "off"]
        server = ServeProcess(d.socket, path, *engine, log_dir=tmp_path)

        def ask(prompt: str, **kw):
            return server.client.completions.create(
                model="m", prompt=prompt, max_tokens=1, temperature=0, logit_bias=BANNED, **kw
            )

        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as failed:
                ask(a, stream=stream)
            assert failed.value.status_code == 502 and failed.value.code == "moed_read_error"
            message = str(failed.value.message)
            assert f"moed could not read expert {expert} of layer {layer} (down) of {path}: " in message, message
            assert "[Errno 5] EIO" in message
            assert ask(b).usage.completion_tokens == 1  # the same worker goes on
        assert server.proc.poll() is None and "Traceback" not in server.log()
    finally:
        if server is not None:
            server.stop()
        d.kill()
