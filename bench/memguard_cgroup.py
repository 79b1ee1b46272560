"""The memory guard under a cgroup memory cap with a hog that keeps growing.

Run (root, cgroup v1 memory controller at /sys/fs/cgroup/memory):
    .venv/bin/python bench/memguard_cgroup.py [--cap 1GiB --budget 512MiB --floor 256MiB --hog 600MiB]

Setup: one memory cgroup capped at `--cap` holds moed and a hog process. moed's
store is filled to its budget (locked, unreclaimable shared memory), then the
hog allocates and touches `--hog-step` every `--hog-interval-s` up to `--hog`,
while an engine client (outside the cgroup) keeps acquiring random experts.
A sampler reads the cgroup's available memory (limit - usage + inactive file
pages, what moed's guard reads) every 10 ms.

Two runs in the same invocation:
- baseline: moed with no floor (the guard off): the cap is reached, the
  kernel's OOM killer ends the hog or moed;
- guarded: moed with `--mem-floor`: it gives memory back as the hog grows.

Prints, per run: who survived, the hog's peak, available memory (min, and the
median over the last second), moed's used bytes at the end, given back bytes,
and acquires refused; then the OOM kills of both runs and the ratio of the
guarded run's steady available memory to the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moed.client import Client  # noqa: E402
from moed.protocol import errors  # noqa: E402
from moed.protocol.sizes import format_size, parse_size  # noqa: E402

CG_ROOT = "/sys/fs/cgroup/memory"

HOG = r"""
import sys, time, mmap
step, total, interval = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
held, have = [], 0
print("start", flush=True)
while have < total:
    m = mmap.mmap(-1, step)
    for off in range(0, step, 4096):
        m[off] = 1
    held.append(m)
    have += step
    print("have", have, flush=True)
    time.sleep(interval)
print("done", have, flush=True)
time.sleep(3600)
"""


class Cgroup:
    def __init__(self, name: str, cap_bytes: int):
        self.path = os.path.join(CG_ROOT, name)
        os.makedirs(self.path, exist_ok=True)
        self._write("memory.limit_in_bytes", str(cap_bytes))
        try:
            self._write("memory.memsw.limit_in_bytes", str(cap_bytes))
        except OSError:
            pass  # no swap accounting: the box has no swap anyway

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def available_bytes(self) -> int:
        limit = int(self.read("memory.limit_in_bytes"))
        usage = int(self.read("memory.usage_in_bytes"))
        inactive = 0
        for line in self.read("memory.stat").splitlines():
            k, v = line.split()
            if k == "total_inactive_file":
                inactive = int(v)
        return limit - usage + inactive

    def spawn(self, argv: list[str], **kw) -> subprocess.Popen:
        """Start argv inside this cgroup (the shell joins it, then execs)."""
        shell = f'echo $$ > {self.path}/cgroup.procs && exec "$@"'
        return subprocess.Popen(["sh", "-c", shell, "sh", *argv], **kw)

    def remove(self) -> None:
        for _ in range(100):
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.05)


def make_bench_model(root: str) -> str:
    from moed.modelgen.makemodel import make_model

    path = os.path.join(root, "memguard-model.gguf")
    if not os.path.exists(path):
        make_model(path, layers=8, experts=32, used=4, embd=1024, ff=1024, align=4096, random_experts=True)
    return path


def wait_socket(path: str, proc: subprocess.Popen, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moed exited with {proc.returncode}")
        try:
            with Client(path, "probe", timeout_s=2) as c:
                c.ping()
                return
        except errors.DaemonUnavailable:
            time.sleep(0.05)
    raise TimeoutError("moed did not start")


def run(args, model: str, floor_bytes: int, label: str) -> dict:
    tmp = tempfile.mkdtemp(prefix="moed-bench-")
    sock = os.path.join(tmp, "s")
    conf = os.path.join(tmp, "moed.toml")
    with open(conf, "w") as f:
        f.write(f"mem_sample_s = {args.sample_s}\n")
    cg = Cgroup(f"moed-bench-{os.getpid()}-{label}", args.cap)
    log = open(os.path.join(tmp, "moed.log"), "wb")
    daemon = cg.spawn(
        [
            sys.executable,
            "-m",
            "moed.daemon.main",
            "--socket",
            sock,
            "--ram-budget",
            str(args.budget),
            "--mem-floor",
            str(floor_bytes),
            "--config",
            conf,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    hog = None
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    refused = [0, 0]
    try:
        wait_socket(sock, daemon)
        with Client(sock, "filler") as c:
            h = c.open_model(model)
            for layer in h.moe_layers:  # fill the store to its budget
                for e in range(0, h.n_experts, h.n_expert_used):
                    try:
                        with h.acquire(layer, list(range(e, e + h.n_expert_used)), timeout_s=5):
                            pass
                    except errors.BudgetExhausted:
                        pass
            filled = c.stats()["used_bytes"]

        def sampler():
            t0 = time.monotonic()
            while not stop.is_set():
                try:
                    samples.append((time.monotonic() - t0, cg.available_bytes()))
                except (OSError, ValueError):
                    pass
                time.sleep(0.01)

        def engine():
            rng = random.Random(1)
            try:
                with Client(sock, "engine", timeout_s=10) as c:
                    h = c.open_model(model)
                    while not stop.is_set():
                        try:
                            with h.acquire(
                                rng.choice(h.moe_layers), rng.sample(range(h.n_experts), h.n_expert_used), timeout=0.1
                            ):
                                refused[0] += 1
                        except errors.BudgetExhausted:
                            refused[1] += 1
            except errors.DaemonUnavailable:
                pass

        threads = [threading.Thread(target=sampler, daemon=True), threading.Thread(target=engine, daemon=True)]
        for t in threads:
            t.start()
        hog = cg.spawn(
            [sys.executable, "-c", HOG, str(args.hog_step), str(args.hog), str(args.hog_interval_s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        peak = 0
        deadline = time.monotonic() + 60
        for line in hog.stdout:
            if line.startswith(("have", "done")):
                peak = int(line.split()[1])
            if line.startswith("done") or time.monotonic() > deadline:
                break
        time.sleep(1.0)  # steady state with the hog at its peak
        stop.set()
        for t in threads:
            t.join(5)
        hog_alive = hog.poll() is None
        daemon_alive = daemon.poll() is None
        end = {}
        if daemon_alive:
            with Client(sock, "stats", timeout_s=5) as c:
                end = c.stats()
        t_end = samples[-1][0] if samples else 0
        last = [a for t, a in samples if t >= t_end - 1.0]
        return {
            "run": label,
            "floor": floor_bytes,
            "filled": filled,
            "hog_peak": peak,
            "hog_survived": hog_alive,
            "moed_survived": daemon_alive,
            "avail_min": min(a for _, a in samples) if samples else None,
            "avail_last_s_median": int(statistics.median(last)) if last else None,
            "used_end": end.get("used_bytes"),
            "given_back": end.get("given_back_bytes", 0),
            "acquires_ok": refused[0],
            "acquires_refused": refused[1],
            "oom_kills": _oom_kills(cg),
        }
    finally:
        stop.set()
        for p in (hog, daemon):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        log.close()
        cg.remove()


def _oom_kills(cg: Cgroup) -> int:
    try:
        for line in cg.read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap", type=parse_size, default=parse_size("1GiB"))
    p.add_argument("--budget", type=parse_size, default=parse_size("512MiB"))
    p.add_argument("--floor", type=parse_size, default=parse_size("256MiB"))
    p.add_argument("--hog", type=parse_size, default=parse_size("600MiB"))
    p.add_argument("--hog-step", type=parse_size, default=parse_size("32MiB"))
    p.add_argument("--hog-interval-s", type=float, default=0.1)
    p.add_argument("--sample-s", type=float, default=0.05)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not os.access(CG_ROOT, os.W_OK):
        sys.exit(f"needs write access to {CG_ROOT} (root, cgroup v1 memory controller)")
    model = make_bench_model(os.path.join(tempfile.gettempdir(), "moed-bench-models"))
    results = [run(args, model, 0, "baseline"), run(args, model, args.floor, "guarded")]
    if args.json:
        print(json.dumps(results))
    print(
        f"cap {format_size(args.cap)}, moed budget {format_size(args.budget)}, floor {format_size(args.floor)}, "
        f"hog up to {format_size(args.hog)} in {format_size(args.hog_step)} steps every {args.hog_interval_s}s, "
        f"guard samples every {args.sample_s}s"
    )
    for r in results:
        fmt = lambda v: format_size(v) if isinstance(v, int) else str(v)  # noqa: E731
        print(
            f"{r['run']:>9}: hog peak {fmt(r['hog_peak'])} (survived: {r['hog_survived']}), "
            f"moed survived: {r['moed_survived']}, oom kills {r['oom_kills']}, "
            f"available min {fmt(r['avail_min'])}, last 1 s median {fmt(r['avail_last_s_median'])}, "
            f"store filled {fmt(r['filled'])} -> {fmt(r['used_end'])}, given back {fmt(r['given_back'])}, "
            f"engine acquires ok/refused {r['acquires_ok']}/{r['acquires_refused']}"
        )
    base, guard = results
    print(f"OOM kills baseline/guarded: {base['oom_kills']}/{guard['oom_kills']}")
    if guard["avail_last_s_median"]:
        print(f"ratio available (last 1 s median) / floor, guarded: {guard['avail_last_s_median'] / args.floor:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
