"""`moectl serve` on a drive that fails one expert's read: a 502 naming it, and the next request served.

The bad model lives on btrfs on a loop device with 4 KiB of one expert's bytes
overwritten under the filesystem (moed.testing.faultfs), so the kernel answers EIO
for that block: a real error through the real daemon into the real engine. The
expert is one prompt A's batch routes to and prompt B's does not (found on the
pristine model: `bad_expert` in tests/e2e/conftest.py), and max_tokens=1
evaluates only the prompt, so A gets the 502 and B, next on the same worker, is
served. Root only, like the daemon's drive-fault tests.

The server loads a skeleton (`--skeleton-dir`, the file with holes for the
experts), as the engine's own drive-fault test does: llama.cpp maps a model with
MAP_POPULATE, and populating a mapping over the bad block does not return.
"""

from __future__ import annotations

import pytest

from moed.testing import DaemonProcess

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")
pytest.importorskip("llama_cpp.server.app")  # the [server] extra
openai = pytest.importorskip("openai")

from tests.e2e.conftest import bad_expert  # noqa: E402
from tests.e2e.serving import BANNED, ServeProcess  # noqa: E402


@pytest.fixture(scope="module")
def bad_case(model_factory):
    """(bad model path, A, B, (layer, expert) only A routes to)."""
    with bad_expert(model_factory) as bad:
        yield bad.path, bad.a.decode(), bad.b.decode(), (bad.layer, bad.expert)


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
        d.close()
