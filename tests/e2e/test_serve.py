"""`moectl serve` (llama-cpp-python's OpenAI server on moed) through the official openai client.

Real processes only: the daemon, one or two `moectl serve` processes, and the
openai client in the test.
"""

from __future__ import annotations

import threading
import time

import httpx2 as httpx
import pytest

from moed.testing import DaemonProcess, wait_for

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")
pytest.importorskip("llama_cpp.server.app")  # the [server] extra
openai = pytest.importorskip("openai")

from tests.e2e.serving import BANNED, PROMPT, ServeProcess, complete, served_experts  # noqa: E402


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    d = DaemonProcess("512KiB")
    server = ServeProcess(d.socket, tiny_model, log_dir=tmp_path_factory.mktemp("serve"))
    yield d, server
    server.stop()
    d.close()


def test_completion_through_the_openai_client(served):
    d, server = served
    before = served_experts(d)
    r = complete(server, 16)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage.completion_tokens == 16
    assert served_experts(d) > before  # the experts came from moed


def test_chat_completion(served):
    d, server = served
    r = server.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1


def test_streaming_chunks_arrive_before_the_end(served):
    d, server = served
    want = complete(server, 300).choices[0].text
    stream = complete(server, 300, stream=True)
    chunks = [next(iter(stream))]
    at_first_chunk = served_experts(d)
    chunks += list(stream)
    # The engine was still acquiring experts after the first chunk reached us.
    assert served_experts(d) > at_first_chunk
    assert len(chunks) > 100
    assert "".join(c.choices[0].text for c in chunks) == want


def test_two_servers_for_two_models_on_one_daemon(model_factory, tmp_path):
    a_model, b_model = model_factory(seed=1), model_factory(seed=2)
    d = DaemonProcess("1MiB")
    servers = []
    try:
        servers = [ServeProcess(d.socket, m, log_dir=tmp_path) for m in (a_model, b_model)]
        start = threading.Barrier(2)
        spans: dict[int, tuple[float, float, str]] = {}

        def ask(i: int) -> None:
            start.wait()
            t0 = time.monotonic()
            text = complete(servers[i], 150).choices[0].text
            spans[i] = (t0, time.monotonic(), text)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert set(spans) == {0, 1}
        (a0, a1, _), (b0, b1, _) = spans[0], spans[1]
        assert a0 < b1 and b0 < a1  # both were in flight at once
        with d.client("test") as c:
            models = {m["path"]: m for m in c.stats()["models"]}
        for m in (a_model, b_model):
            row = models[str(m)]
            assert row["hits"] + row["misses"] > 0
    finally:
        for s in servers:
            s.stop()
        d.close()


def test_daemon_killed_mid_request_is_a_503_and_a_restart_recovers(tiny_model, tmp_path):
    d = DaemonProcess("512KiB")
    server = None
    try:
        server = ServeProcess(d.socket, tiny_model, log_dir=tmp_path)
        warm = complete(server, 8).choices[0].text  # loaded and warm
        outcome: dict = {}

        def long_request() -> None:
            try:
                outcome["reply"] = complete(server, 900)
            except openai.APIStatusError as exc:
                outcome["error"] = exc

        t = threading.Thread(target=long_request)
        before = served_experts(d)
        t.start()
        wait_for(lambda: served_experts(d) > before + 200, timeout_s=30, what="the request to be under way")
        d.kill()
        t.join(60)
        assert not t.is_alive()
        err = outcome.get("error")
        assert err is not None, "the request finished without the daemon"
        assert err.status_code == 503
        assert "moed unavailable" in str(err.message)

        # moed is down: a new request is refused at once, with the reason.
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as down:
            complete(server, 4)
        assert down.value.status_code == 503 and "cannot connect to moed" in str(down.value.message)
        assert time.monotonic() - t0 < 10, "the probe waited for moed to come back"
        with pytest.raises(openai.APIStatusError) as down_stream:
            complete(server, 4, stream=True)
        assert down_stream.value.status_code == 503
        # ... but a bad request is the client's error whatever the daemon's state: 400, not 503
        bad = httpx.post(f"{server.url}/v1/completions", content=b"{not json", timeout=30)
        assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
        hot = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "temperature": -1}, timeout=30)
        assert hot.status_code == 400 and hot.json()["error"]["param"] == "temperature"

        d = DaemonProcess("512KiB", socket_dir=str(d.dir))
        r = complete(server, 8)  # the same engine, bound to the new daemon (no reload)
        assert r.usage.completion_tokens == 8 and r.choices[0].text == warm
        assert served_experts(d) > 0
        assert server.proc.poll() is None
    finally:
        if server is not None:
            server.stop()
        d.close()


def test_config_file_serves_two_models_and_warns_about_what_it_ignores(model_factory, tmp_path):
    import json

    a_model, b_model = model_factory(seed=1), model_factory(seed=2)
    config = tmp_path / "serve.json"
    config.write_text(
        json.dumps(
            {
                "models": [
                    {
                        "model": str(a_model),
                        "model_alias": "a",
                        "n_ctx": 512,
                        "verbose": False,
                        "n_gpu_layers": 4,
                        "use_mlock": True,
                    },
                    {"model": str(b_model), "model_alias": "b", "n_ctx": 512, "verbose": False},
                ]
            }
        )
    )
    d = DaemonProcess("1MiB")
    server = None
    try:
        server = ServeProcess(d.socket, None, log_dir=tmp_path, config=config)
        ids = {m.id for m in server.client.models.list().data}
        assert ids == {"a", "b"}
        texts = {}
        for name in ("a", "b", "a"):
            r = server.client.completions.create(
                model=name, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias=BANNED
            )
            assert r.model == name
            texts.setdefault(name, r.choices[0].text)
            assert texts[name] == r.choices[0].text  # switching back reloads the same model
        with d.client("test") as c:
            paths = {m["path"] for m in c.stats()["models"]}
        assert {str(a_model), str(b_model)} <= paths
        log = server.log()
        # no GPU device is visible to the workers (lavapipe only with GGML_VK_VISIBLE_DEVICES)
        assert "sees no GPU device" in log and "ignores use_mlock" in log
    finally:
        if server is not None:
            server.stop()
        d.close()
