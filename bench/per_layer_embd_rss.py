"""Where Gemma 4's per-layer token embeddings live in an engine: RSS of stock Llama and StreamedLlama.

llama.cpp marks `per_layer_token_embd` TENSOR_READ_LAZY (rows read on demand from the
mapping), but only with `llama_model_params.lazy_mode` ON, or AUTO (the default) for a
tensor over 4 GiB. This script writes a gemma4 test model whose per-layer embeddings
(`--embd 512`: 512 MiB; 256: 256 MiB) dwarf the daemon's RAM budget (16 MiB) and the rest of the model, loads it in
one fresh process per engine, evaluates a prompt and 8 greedy steps, and prints one
JSON line per engine: the process's anonymous, file-backed and locked resident bytes
and the resident bytes of the model file's mapping, next to the embeddings' size.

Engines: `stock` (llama_cpp.Llama, default params), `stock-lazy` (lazy_mode ON, set by
wrapping llama_model_default_params, which Llama's constructor calls: bench-only) and
`streamed` (StreamedLlama, which loads with lazy_mode ON and leaves the embeddings out
of its mlock of the dense weights: archs.LAZY_TENSORS).

    python bench/per_layer_embd_rss.py [--embd 512] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ENGINES = ("stock", "stock-lazy", "streamed")
PROMPT = b"the expert model reads memory pages from the drive, one token at a time"
EMBD = "per_layer_token_embd.weight"
GEOMETRY = dict(arch="gemma4", layers=16, ff=256, vocab=131072, align=4096)  # embeddings: embd x 1 MiB


def status() -> dict:
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmLck"):
            out[key] = int(value.split()[0]) * 1024
    return out


def mapping_rss(name: str) -> int:
    """Resident bytes of every mapping of a file called `name` (the model, or its skeleton)."""
    total, ours = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            ours = len(head) >= 6 and os.path.basename(head[-1]) == name
        elif ours and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def set_lazy() -> None:
    import llama_cpp.llama_cpp as bindings  # what llama_cpp.llama calls, not the package's re-export

    default = bindings.llama_model_default_params

    def lazy_params():
        params = default()
        params.lazy_mode = bindings.LLAMA_LAZY_MODE_ON
        return params

    bindings.llama_model_default_params = lazy_params


def child(kind: str, model: str, socket: str | None) -> dict:

    from moed.gguf.header import read_header

    if "lazy" in kind:
        set_lazy()
    # logits of the last token only, as users generate: logits_all would add a 128 MiB buffer
    kw = dict(n_ctx=256, n_batch=64, n_ubatch=64, logits_all=False, n_threads=2, verbose=False, seed=0)
    before = status()
    if kind.startswith("stock"):
        import llama_cpp

        llm = llama_cpp.Llama(model, **kw)
        client = None
    else:
        from moed.client import Client
        from moed.engines.llama_cpp import StreamedLlama

        client = Client(socket, "bench")
        llm = StreamedLlama(model, client=client, **kw)
    loaded = status()
    llm.eval(llm.tokenize(PROMPT))
    for _ in range(8):
        llm.eval([llm.sample(temp=0.0)])  # greedy, from the last logits (logits_all is off)
    after = status()
    embd = next(t.n_bytes for t in read_header(model).tensors if t.name == EMBD)
    res = {
        "engine": kind,
        "embeddings_bytes": embd,
        "file_bytes": os.path.getsize(model),
        "rss_before_load": before["VmRSS"],
        "loaded": loaded,
        "after_decode": after,
        "model_mapping_rss": mapping_rss(os.path.basename(model)),
    }
    if client is not None:
        res["daemon_used_bytes"] = client.stats()["used_bytes"]  # the RAM tier: experts only
    llm.close()
    if client is not None:
        client.close()
    return res


def with_daemon(fn):
    from moed.testing import wait_for

    sock_dir = pathlib.Path(f"/tmp/moed-ple-{os.getpid()}")
    sock_dir.mkdir(exist_ok=True)
    sock = str(sock_dir / "s")
    log = open(sock_dir / "moed.log", "wb")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "moed.daemon.main", "--socket", sock, "--ram-budget", "16MiB"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: os.path.exists(sock) or daemon.poll() is not None, 30, what="moed socket")
        if daemon.poll() is not None:
            raise RuntimeError((sock_dir / "moed.log").read_text())
        return fn(sock)
    finally:
        daemon.terminate()
        daemon.wait(30)
        log.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def run(kind: str, model: str, socket: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--model", model] + (["--socket", socket] if socket else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"engine": kind, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--embd", type=int, default=512, help="hidden size: the per-layer embeddings are embd MiB")
    ap.add_argument("--model", default=None, help="default: /tmp/moed-ple/gemma4-ple-EMBD.gguf, written if absent")
    ap.add_argument("--child", choices=ENGINES)
    ap.add_argument("--socket")
    args = ap.parse_args()
    args.model = args.model or f"/tmp/moed-ple/gemma4-ple-{args.embd}.gguf"
    if args.child:
        print(json.dumps(child(args.child, args.model, args.socket)))
        return 0
    if not os.path.exists(args.model):
        from moed.modelgen.makemodel import make_model

        print(f"writing {args.model} ...", file=sys.stderr)
        make_model(args.model, embd=args.embd, **GEOMETRY)
    for kind in ENGINES:
        if kind.startswith("stock"):
            res = run(kind, args.model, None)
        else:
            res = with_daemon(lambda sock, kind=kind: run(kind, args.model, sock))
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
