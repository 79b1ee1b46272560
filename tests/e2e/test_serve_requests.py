"""What the soak of issue 25 found, each against a real `moectl serve` on a real daemon.

- concurrent streams are never cut: they queue (and with `--interrupt-requests`,
  a cut stream ends with finish_reason "interrupted");
- every bad request gets a 4xx with a clear message before any stream starts, and
  the same keep-alive connection serves the next request;
- an unknown model is a 404 `model_not_found`;
- `--ctx N` is a context of exactly N tokens;
- the server never logs "ASGI callable returned without completing response".

Clients are the official openai package and httpx (one connection, to see keep-alive).
"""

from __future__ import annotations

import json
import threading

import pytest

from moed.testing import DaemonProcess, wait_for

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")
pytest.importorskip("llama_cpp.server.app")  # the [server] extra
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # the openai client's own HTTP client (httpx's successor)

from tests.e2e.serving import BANNED, PROMPT, ServeProcess, complete  # noqa: E402

LONG_PROMPT = "memory pages " * 200  # well past a 128-token context
INCOMPLETE = "ASGI callable returned without completing response"


@pytest.fixture(scope="module")
def daemon():
    d = DaemonProcess("512KiB")
    yield d
    d.close()


@pytest.fixture(scope="module")
def server(daemon, tiny_model, tmp_path_factory):
    s = ServeProcess(daemon.socket, tiny_model, "--ctx", "128", log_dir=tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


def stream_text(server: ServeProcess, n: int, started: threading.Event | None = None, **kw):
    """(text, the last finish_reason) of one streamed completion; `started` set at its first text."""
    text, finish = "", None
    for chunk in complete(server, n, stream=True, **kw):
        choice = chunk.choices[0]
        text += choice.text
        if text and started is not None:
            started.set()
        finish = choice.finish_reason or finish
    return text, finish


def run_in_threads(*calls):
    """Run the calls at once; their results (or exceptions) in order."""
    results: list = [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_concurrent_streams_queue_and_none_is_cut(server):
    want = complete(server, 60).choices[0].text
    results = run_in_threads(*[lambda: stream_text(server, 60) for _ in range(3)])
    assert results == [(want, "length")] * 3, results


def test_a_new_request_cuts_a_stream_only_when_asked_and_it_says_so(daemon, tiny_model, tmp_path):
    s = ServeProcess(daemon.socket, tiny_model, "--interrupt-requests", log_dir=tmp_path)
    try:
        started = threading.Event()

        def second():
            assert started.wait(60)
            return complete(s, 4).usage.completion_tokens

        whole = complete(s, 900).choices[0].text
        cut, other = run_in_threads(lambda: stream_text(s, 900, started), second)
        assert other == 4
        text, finish = cut
        assert finish == "interrupted" and text and whole.startswith(text) and len(text) < len(whole)
        assert INCOMPLETE not in s.log()
    finally:
        s.stop()


def test_ctx_is_exactly_the_context_asked_for(server):
    prompt_tokens = complete(server, 1).usage.prompt_tokens
    full = complete(server, 128 - prompt_tokens)  # up to the last position of a 128-token context
    assert full.usage.total_tokens == 128
    with pytest.raises(openai.BadRequestError) as over:
        complete(server, 129 - prompt_tokens)
    assert over.value.code == "context_length_exceeded"
    assert "maximum context length is 128 tokens" in over.value.message


BAD_COMPLETIONS = [
    ({"prompt": LONG_PROMPT}, 400, "context_length_exceeded", "maximum context length is 128"),
    ({"prompt": PROMPT, "max_tokens": -1}, 400, None, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 10**9}, 400, "context_length_exceeded", "1000000000 for the completion"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "model_not_found", "`gpt-4` does not exist"),
    ({"prompt": PROMPT, "logit_bias": {"abc": 1}}, 400, None, "logit_bias keys are token ids"),
    ({"prompt": PROMPT, "logit_bias": {"99999": 1}}, 400, None, "not in this model's vocabulary"),
    ({"prompt": [PROMPT, PROMPT]}, 400, None, "one prompt a request"),
]
BAD_CHATS = [
    ({"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "context_length_exceeded", "128"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, None, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model_not_found", "gpt-4"),
    ({"messages": "hi"}, 400, None, "messages"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize(
    "path,body,status,code,says",
    [("/v1/completions", *case) for case in BAD_COMPLETIONS] + [("/v1/chat/completions", *case) for case in BAD_CHATS],
)
def test_a_bad_request_is_a_4xx_before_any_stream_and_the_connection_goes_on(
    server, path, body, status, code, says, stream
):
    # One connection for both requests: the second must be served on the first's.
    with httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=1)) as http:
        r = http.post(path, json={"model": "m", "max_tokens": 8, **body, "stream": stream})
        assert r.status_code == status, r.text
        assert r.headers["content-type"].startswith("application/json")
        error = r.json()["error"]
        assert error["code"] == code and says in error["message"], error
        assert "Traceback" not in r.text and "\n" not in error["message"]
        again = http.post(
            "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 3, "logit_bias": BANNED}
        )
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3


def test_a_body_that_is_not_json_is_a_400(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "Traceback" not in r.text


def test_the_openai_client_raises_a_bad_stream_before_it_iterates(server):
    with pytest.raises(openai.BadRequestError) as exc:
        server.client.completions.create(model="m", prompt=LONG_PROMPT, max_tokens=4, stream=True)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as missing:
        server.client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
    assert missing.value.code == "model_not_found"


def test_a_client_leaving_mid_stream_leaves_the_server_well(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 60, "logit_bias": BANNED, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    json.loads(line[6:])
                    break  # and close the connection mid-stream
    assert complete(server, 5).usage.completion_tokens == 5


def test_no_response_is_left_incomplete(server):
    """Runs after the others in this module: none of their requests left a response open."""
    wait_for(lambda: complete(server, 1) is not None, timeout_s=30, what="the server to answer")
    assert INCOMPLETE not in server.log()
    assert "Traceback" not in server.log()
