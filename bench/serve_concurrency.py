"""Concurrent streamed completions on `moectl serve`: one worker with every core against one worker a core.

Two servers on one daemon, the same model, run one after the other in the same run:

  workers1  `--workers 1 --threads CORES`: llama.cpp's threads on one request at a time;
  workersN  `--workers CORES --threads 1`: CORES engine processes, one request each.

For each number of clients (`--clients 1,2,4`), every client streams `--requests`
completions of `--tokens` tokens (temperature 0, end of text banned so each runs to
its length) through the official openai client, all clients at once. Printed per
server and client count: aggregate tokens/s (all tokens / wall time), p50 and p95
time to first token; then the ratios workersN / workers1. After each server's
runs: each worker's RSS and private bytes (/proc/PID/smaps_rollup) and the
daemon's used bytes, so the second worker's cost is stated and its expert bytes
(none: the daemon's used bytes stay put) are seen.

    python bench/serve_concurrency.py [--model PATH] [--clients 1,2,4] [--tokens 64] [--requests 4]

Default model: the committed tiny trained MoE (moed.data.TINY_MOE). An
OLMoE-geometry model: `moectl make-model olmoe.gguf --arch olmoe` and `--model
olmoe.gguf`. Goals (issue 25): >= 1.6x the aggregate tokens/s of one worker with 4
clients on a 2-core box, p95 time to first token no worse; RESULTS.md records them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import openai

from moed.spawn import DaemonProcess

BANNED_EOS = {"2": -100}  # the tiny trained model's </s>: every completion runs to max_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, sock: str, model: str, workers: int, threads: int):
        self.port = free_port()
        cmd = [sys.executable, "-m", "moed.ctl", "--socket", sock, "serve", model, "--alias", "m"]
        cmd += ["--workers", str(workers), "--threads", str(threads), "--ctx", "1024", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moectl serve did not start (exit {self.proc.poll()})")
            time.sleep(0.2)

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/moed/workers", timeout=10).json()["m"]["workers"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def one_stream(server: Server, tokens: int) -> tuple[float, int]:
    """(time to first token, tokens) of one streamed completion."""
    t0, first, n = time.monotonic(), None, 0
    stream = server.client.completions.create(
        model="m", prompt="The old house", max_tokens=tokens, temperature=0, logit_bias=BANNED_EOS, stream=True
    )
    for chunk in stream:
        if chunk.choices[0].finish_reason is None:
            first = first or time.monotonic() - t0
            n += 1
    return first or 0.0, n


def run_clients(server: Server, clients: int, requests: int, tokens: int) -> dict:
    ttfts: list[float] = []
    total = [0]
    lock = threading.Lock()

    def client() -> None:
        for _ in range(requests):
            ttft, n = one_stream(server, tokens)
            with lock:
                ttfts.append(ttft)
                total[0] += n

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    ttfts.sort()
    return {
        "clients": clients,
        "tokens_s": total[0] / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
    }


def memory(pid: int) -> dict:
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Rss", "Private_Clean", "Private_Dirty"):
                fields[key] = int(value.split()[0]) * 1024
    return {"rss_bytes": fields["Rss"], "private_bytes": fields["Private_Clean"] + fields["Private_Dirty"]}


def main() -> int:
    from moed.data import TINY_MOE

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(TINY_MOE))
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--budget", default="256MiB")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    counts = [int(c) for c in args.clients.split(",")]
    results: dict[str, dict[int, dict]] = {}
    with DaemonProcess(args.budget) as d:
        for name, workers, threads in (("workers1", 1, cores), (f"workers{cores}", cores, 1)):
            server = Server(d.socket, args.model, workers, threads)
            try:
                one_stream(server, 4)  # loaded and warm
                results[name] = {}
                for c in counts:
                    row = run_clients(server, c, args.requests, args.tokens)
                    results[name][c] = row
                    print(json.dumps({"server": name, **row}), flush=True)
                with d.client("bench") as c:
                    used = c.stats()["used_bytes"]
                mem = [memory(w["pid"]) for w in server.workers()]
                print(json.dumps({"server": name, "daemon_used_bytes": used, "workers": mem}), flush=True)
            finally:
                server.stop()
    one, many = results["workers1"], results[f"workers{cores}"]
    for c in counts:
        ratio = many[c]["tokens_s"] / one[c]["tokens_s"]
        p95 = many[c]["ttft_p95_s"] / one[c]["ttft_p95_s"] if one[c]["ttft_p95_s"] else float("nan")
        print(json.dumps({"clients": c, "tokens_s_ratio": round(ratio, 3), "ttft_p95_ratio": round(p95, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
