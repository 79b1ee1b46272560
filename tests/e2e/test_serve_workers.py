"""`moectl serve --workers N`: engine workers behind one port, on one daemon, through the openai client.

Real processes only: the daemon, the front, its worker processes, and the openai
client (httpx2 where a header or the raw connection matters).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from moed.testing import DaemonProcess, wait_for

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")
pytest.importorskip("llama_cpp.server.app")  # the [server] extra
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

from tests.e2e.serving import BANNED, PROMPT, ServeProcess, complete, free_port  # noqa: E402


@pytest.fixture(scope="module")
def daemon():
    d = DaemonProcess("1MiB")
    yield d
    d.close()


@pytest.fixture(scope="module")
def two(daemon, tiny_model, tmp_path_factory):
    metrics_port = free_port()
    s = ServeProcess(
        daemon.socket,
        tiny_model,
        "--workers",
        "2",
        "--metrics-listen",
        f"127.0.0.1:{metrics_port}",
        log_dir=tmp_path_factory.mktemp("two"),
    )
    s.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield s
    s.stop()


def workers(server: ServeProcess, model: str = "m") -> list[dict]:
    return httpx.get(server.url + "/moed/workers", timeout=10).json()[model]["workers"]


def timed_stream(server: ServeProcess, n: int, out: dict, key, started: threading.Event | None = None) -> None:
    """Stream a completion; out[key] = (first chunk's time, last chunk's time, text); `started` set at the first."""
    text, first = "", None
    for chunk in complete(server, n, stream=True):
        if first is None:
            first = time.monotonic()
            if started is not None:
                started.set()
        text += chunk.choices[0].text
    out[key] = (first, time.monotonic(), text)


def test_two_streams_on_two_workers_overlap_and_match_one_worker(daemon, tiny_model, two, tmp_path):
    one = ServeProcess(daemon.socket, tiny_model, log_dir=tmp_path)
    try:
        want = complete(one, 150).choices[0].text
        spans: dict = {}
        # A long stream first; once it streams, a short one runs start to end inside it.
        # One worker would queue the short one behind the long one. (Two streams of the
        # same length started together need not overlap on a loaded 2-core box.)
        started = threading.Event()
        long = threading.Thread(target=timed_stream, args=(two, 900, spans, 0, started))
        long.start()
        assert started.wait(60), "the long stream never started"
        timed_stream(two, 150, spans, 1)
        long.join(120)
        (a0, a1, a_text), (b0, b1, b_text) = spans[0], spans[1]
        assert a0 < b0 and b1 < a1  # both streamed at once: one worker would have run them in turn
        assert b_text == want and a_text.startswith(want)  # the same greedy text as a one-worker server's
        assert sorted(w["served"] for w in workers(two)) == [1, 1]
        # One worker queues them: the second starts after the first is done.
        threads = [threading.Thread(target=timed_stream, args=(one, 150, spans, i + 2)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        (c0, c1, _), (d0, d1, _) = spans[2], spans[3]
        assert c1 <= d0 or d1 <= c0
    finally:
        one.stop()


def test_workers_share_the_cores(daemon, two):
    """Workers are engines created without thread counts: the daemon splits the cores
    between the two while both stream (moed.daemon.turns), and no count is a user's."""
    spans: dict = {}
    started = threading.Event()
    long = threading.Thread(target=timed_stream, args=(two, 400, spans, 0, started))
    long.start()
    assert started.wait(60), "the long stream never started"
    timed_stream(two, 60, spans, 1)  # both workers compute now
    long.join(120)
    with daemon.client("check") as c:
        rows = [e for e in c.stats()["engines"] if e["name"] == "moectl serve"]
    cores = len(os.sched_getaffinity(0))
    assert len(rows) >= 2 and all(r["turns"] > 0 for r in rows), rows
    assert all(r["auto"] for r in rows), rows
    assert min(r["threads"] for r in rows) == max(1, cores // 2)  # the one that stopped first, when both ran
    assert all(1 <= r["threads"] <= cores for r in rows)


def test_a_killed_worker_fails_its_request_and_comes_back(two):
    before = {w["index"]: w for w in workers(two)}
    started = threading.Event()
    outcome: dict = {}

    def long_stream() -> None:
        try:
            for chunk in complete(two, 900, stream=True):
                if chunk.choices[0].text:
                    started.set()
            outcome["done"] = True
        except openai.APIError as exc:
            outcome["error"] = exc

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(60)
    (busy,) = [w for w in workers(two) if w["in_flight"]]
    os.kill(busy["pid"], signal.SIGKILL)
    t.join(60)
    assert "error" in outcome, outcome
    assert "ended during the request" in str(outcome["error"])
    assert complete(two, 8).usage.completion_tokens == 8  # the other worker serves at once
    back = wait_for(
        lambda: next((w for w in workers(two) if w["index"] == busy["index"] and w["ready"]), None),
        timeout_s=60,
        what="the killed worker to be back",
    )
    assert back["pid"] != busy["pid"] and back["restarts"] == before[busy["index"]]["restarts"] + 1
    assert "SIGKILL" in back["last_exit"]


def scrape(url: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_metrics_count_requests_tokens_and_first_tokens(two):
    complete(two, 5)
    list(complete(two, 5, stream=True))
    before = scrape(two.metrics_url)
    chat = two.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    list(chat)
    samples = scrape(two.metrics_url)
    first_tokens = 'moed_serve_time_to_first_token_seconds_count{model="m"}'
    assert samples[first_tokens] == before[first_tokens] + 1  # once a stream (a chat's role chunk is not a token)
    assert samples['moed_serve_requests_total{model="m",status="200"}'] >= 2
    assert samples['moed_serve_tokens_generated_total{model="m"}'] >= 10
    assert samples['moed_serve_time_to_first_token_seconds_count{model="m"}'] >= 1
    assert samples['moed_serve_workers{model="m"}'] == 2
    assert 'moed_serve_requests_queued{model="m"}' in samples


def test_top_shows_the_server_next_to_the_daemon(daemon, two):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "moed.ctl", "--socket", daemon.socket, "top", "--once", "--interval", "0.5"]
    r = subprocess.run([*cmd, "--serve", two.metrics_url], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    line = next(line for line in r.stdout.splitlines() if two.metrics_url in line)
    assert " m " in line and "2/2" in line
    assert "moectl serve" in r.stdout  # the workers' daemon connections, in the tenants table


def test_past_the_queue_bound_is_a_503_with_retry_after(daemon, tiny_model, tmp_path):
    s = ServeProcess(daemon.socket, tiny_model, "--queue", "1", log_dir=tmp_path)
    try:
        started = threading.Event()
        results: dict = {}

        def first() -> None:
            for chunk in complete(s, 600, stream=True):
                if chunk.choices[0].text:
                    started.set()
            results["first"] = True

        def second() -> None:
            results["second"] = complete(s, 4).usage.completion_tokens

        a = threading.Thread(target=first)
        a.start()
        assert started.wait(60)
        b = threading.Thread(target=second)
        b.start()
        wait_for(lambda: httpx.get(s.url + "/moed/workers", timeout=10).json()["m"]["queued"] == 1, timeout_s=30)
        r = httpx.post(
            s.url + "/v1/completions",
            json={"model": "m", "prompt": PROMPT, "max_tokens": 4, "logit_bias": BANNED},
            timeout=30,
        )
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_busy"
        a.join(120)
        b.join(120)
        assert results == {"first": True, "second": 4}  # the queued one was served, not dropped
    finally:
        s.stop()


@pytest.mark.parametrize("to_group", [False, True], ids=["sigterm-to-the-front", "sigint-to-its-group"])
def test_a_stop_drains_the_request_and_exits_0_with_no_leases_left(tiny_model, tmp_path, to_group):
    """SIGTERM to the front (systemd, KillMode=mixed), or Ctrl-C's SIGINT to the whole process group."""
    daemon = DaemonProcess("1MiB")  # its own: no other server's clients on it
    try:
        _drain_and_exit(daemon, tiny_model, tmp_path, to_group)
    finally:
        daemon.close()


def _drain_and_exit(daemon: DaemonProcess, tiny_model, tmp_path, to_group: bool) -> None:
    s = ServeProcess(daemon.socket, tiny_model, "--workers", "2", log_dir=tmp_path, new_session=to_group)
    outcome: dict = {}
    started = threading.Event()

    def long_stream() -> None:
        text = ""
        for chunk in complete(s, 300, stream=True):
            text += chunk.choices[0].text
            if text:
                started.set()
        outcome["text"] = text

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(60)
    if to_group:
        os.killpg(s.proc.pid, signal.SIGINT)  # its own session: the front's pid is the group's id
    else:
        s.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert outcome.get("text"), "the request in flight was finished"
    assert s.proc.wait(30) == 0, s.log()
    assert "restarting" not in s.log()  # no worker ended under the drain
    s.stop()

    def no_serve_clients() -> bool:
        with daemon.client("test") as c:
            st = c.stats()
        # This one is the only connection left (stats counts the connection asking).
        return st["connections"] == 1 and all(tenant["leases"] == 0 for tenant in st["tenants"])

    wait_for(no_serve_clients, timeout_s=30, what="the workers' daemon connections to close")


def test_config_file_sets_workers_per_model(daemon, model_factory, tmp_path):
    a_model, b_model = model_factory(seed=1), model_factory(seed=2)
    config = tmp_path / "serve.json"
    config.write_text(
        json.dumps(
            {
                "models": [
                    {"model": str(a_model), "model_alias": "a", "n_ctx": 256, "verbose": False, "workers": 2},
                    {"model": str(b_model), "model_alias": "b", "n_ctx": 256, "verbose": False},
                ]
            }
        )
    )
    s = ServeProcess(daemon.socket, None, log_dir=tmp_path, config=config)
    try:
        assert len(workers(s, "a")) == 2 and len(workers(s, "b")) == 1
        for name in ("a", "b"):
            r = s.client.completions.create(model=name, prompt=PROMPT, max_tokens=4, logit_bias=BANNED)
            assert r.model == name and r.usage.completion_tokens == 4
    finally:
        s.stop()


def test_the_api_key_is_checked_at_the_front(daemon, tiny_model, tmp_path):
    s = ServeProcess(daemon.socket, tiny_model, "--api-key", "sekrit", log_dir=tmp_path)
    try:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "logit_bias": BANNED}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 401
        ok = httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        s.stop()


def test_a_model_that_cannot_load_fails_the_server_at_start(daemon, tmp_path):
    import subprocess
    import sys

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 100)
    cmd = [sys.executable, "-m", "moed.ctl", "--socket", daemon.socket, "serve", str(junk), "--port", str(free_port())]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "ended before it was ready" in r.stderr
