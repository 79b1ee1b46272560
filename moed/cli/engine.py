"""moectl verbs that run llama.cpp with experts from moed: generate, chat, trace, kl.

What this module owns: the terminal side of `StreamedLlama` (streaming tokens as
they come; at the end, the daemon's hit rate for this run and the engine's
look-ahead: prediction recall, prefetches issued / hit / wasted, stall per
token) and recording routing traces (with the engine's predictions). A missing file
or one llama.cpp refuses is a BadInput, raised: moectl's one error path (moed.cli)
reports it, as it does the daemon's errors.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import TYPE_CHECKING, cast

from moed.badinput import BadInput
from moed.engines.options import RUN, EngineOptions

if TYPE_CHECKING:
    from collections.abc import Iterator

    from llama_cpp.llama_types import (
        ChatCompletionRequestMessage,
        ChatCompletionStreamResponseDelta,
        CreateChatCompletionStreamResponse,
        CreateCompletionStreamResponse,
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with experts served by moed")
    _model_args(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat at the terminal with experts served by moed")
    _model_args(p)
    p.add_argument("-n", "--n-predict", type=int, default=256, help="most tokens per reply (default 256)")
    p.add_argument("--system", default="", help="system prompt")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("trace", help="record every step's routed experts per layer")
    _model_args(p)
    p.add_argument("--prompt-file", required=True, help="prompts, one per line (blank lines skipped)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="decode steps per prompt (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("-o", "--output", required=True, help="trace file to write")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("kl", help="what an output-changing option costs: KL divergence from the exact run")
    _model_args(p)
    p.add_argument("--prompt-file", required=True, help="texts, one per line (blank lines skipped), teacher-forced")
    p.add_argument(
        "--budget",
        default=None,
        help="run a private daemon with this RAM budget (a size, or a share of the experts: 25%%) "
        "instead of the one on --socket",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=cmd_kl)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF model (first shard of a split model)")
    p.add_argument(
        "--ctx", type=int, default=None, help="context length (default: the model's training context, at most 4096)"
    )
    p.add_argument("--batch", type=int, default=512, help="prompt batch size (default 512)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=0)
    # The engine's options (moed.engines.options): --skeleton-dir, --prefetch, ..., and the llama.cpp
    # settings that are options too: --n-gpu-layers, --threads.
    EngineOptions.add_flags(p, RUN)
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's load log")


# ---- shared --------------------------------------------------------------


class _Session:
    """A client plus a StreamedLlama, and the daemon counters at start (for this run's hit rate)."""

    def __init__(self, args: argparse.Namespace, socket: str | None = None, **llama_kwargs):
        from moed.client import Client
        from moed.engines.llama_cpp import StreamedLlama

        if not os.path.exists(args.model):
            raise BadInput(f"no such model file: {args.model}")
        self.client = Client(socket or args.socket, client_name=f"moectl {args.verb}")
        try:
            self.llm = StreamedLlama.from_options(
                args.model,
                EngineOptions.from_args(args, RUN),
                client=self.client,
                **_llama_settings(args),
                **llama_kwargs,
            )
        except ValueError as exc:  # llama.cpp refused the file
            self.client.close()
            raise BadInput(str(exc)) from None
        except BaseException:
            self.client.close()
            raise
        self.start = self.client.stats()
        self.t0 = time.perf_counter()

    def close(self) -> None:
        self.llm.close()
        self.client.close()

    def report(self, n_tokens: int, out=sys.stderr) -> None:
        now = self.client.stats()
        dt = time.perf_counter() - self.t0
        hits = now.get("hits", 0) - self.start.get("hits", 0)
        misses = now.get("misses", 0) - self.start.get("misses", 0)
        read = now.get("bytes_read", 0) - self.start.get("bytes_read", 0)
        rate = f"{100.0 * hits / (hits + misses):.1f}%" if hits + misses else "n/a"
        from moed.protocol.sizes import format_size

        print(
            f"\n[moed] {n_tokens} tokens in {dt:.1f} s ({n_tokens / dt if dt else 0:.2f} tok/s); "
            f"daemon hit rate {rate} ({hits} hits, {misses} misses), read {format_size(read)}; "
            f"{lookahead_line(self.llm.stream_stats())}{subst_line(self.llm.stream_stats())}"
            f"{device_line(self.llm.stream_stats())}",
            file=out,
        )


def subst_line(st: dict) -> str:
    """Substitution in one phrase (empty when off)."""
    if "subst_r" not in st:
        return ""
    return (
        f"; subst r={st['subst_r']:g} ({st['subst_rule']}): {st['subst_per_token']:.2f} per token, "
        f"{st['subst_reads_avoided']} reads avoided of {st['subst_reads_needed']}, "
        f"{100 * st['subst_weight_share']:.2f}% of routing weight on stand-ins"
    )


def device_line(st: dict) -> str:
    """Where the dense layers ran, in one phrase (empty when everything ran on the CPU)."""
    dev = st.get("devices", {})
    if not dev.get("gpu"):
        return ""
    layers = dev["gpu_layers"]
    span = f"layers {layers[0]}-{layers[1]}" if layers else "no layers"
    where = f"{span}{' and output' if dev.get('output_on_gpu') else ''} on {dev['gpu']}"
    if "gpu_slots" in dev:
        slots = st.get("gpu_slots", {})
        return (
            f"; {where}, their experts in {dev['gpu_slots']} device slots a layer "
            f"(hits {slots.get('hits', 0)}, uploads {slots.get('uploads', 0)}, "
            f"evictions {slots.get('evictions', 0)})"
        )
    return f"; dense {where}, experts on the CPU"


def lookahead_line(st: dict) -> str:
    """The engine's look-ahead in one phrase, for the closing line."""
    stall_ms = 1e3 * st.get("stall_s_per_token", 0.0)
    if st.get("prefetch", "off") == "off":
        return f"prefetch off, stall {stall_ms:.2f} ms/token"
    recall = st.get("prediction_recall")
    recall_s = "n/a" if recall is None else f"{recall:.2f}"
    return (
        f"prefetch {st['prefetch']}: recall {recall_s}, issued {st['prefetch_issued']} "
        f"(hits {st['prefetch_hits']}, wasted {st['prefetch_wasted']}), stall {stall_ms:.2f} ms/token"
    )


def _llama_settings(args) -> dict:
    """llama.cpp's own settings every engine verb takes from its flags (one place for generate, chat,
    kl); those that are engine options too (n_gpu_layers, the thread counts) come with the options."""
    return dict(
        n_ctx=args.ctx or _default_ctx(args.model),
        n_batch=args.batch,
        n_ubatch=args.batch,
        seed=args.seed,
        verbose=args.verbose,
    )


def _default_ctx(model: str, most: int = 4096) -> int:
    """The model's training context (`<arch>.context_length`), capped: the KV cache grows with it."""
    from moed.gguf.header import read_header

    try:
        h = read_header(model)
        arch = h.get("general.architecture")
        trained = int(h.get(f"{arch}.context_length", most))
    except Exception:  # noqa: BLE001 - llama.cpp will report a bad file itself, in its own words
        return most
    return max(1, min(trained, most))


def _sampling(args: argparse.Namespace) -> dict:
    if args.temp <= 0:
        return {"temperature": 0.0, "top_k": 1}
    return {"temperature": args.temp}


# ---- generate / chat -----------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    s = _Session(args)
    try:
        n = 0
        # stream=True: llama-cpp-python returns the chunk iterator (its annotation is the union of both).
        chunks = cast(
            "Iterator[CreateCompletionStreamResponse]",
            s.llm.create_completion(
                args.prompt, max_tokens=args.n_predict, stream=True, seed=args.seed, **_sampling(args)
            ),
        )
        for chunk in chunks:
            choice = chunk["choices"][0]
            sys.stdout.write(choice["text"])
            sys.stdout.flush()
            n += choice.get("finish_reason") is None  # the closing chunk carries no new token
        sys.stdout.write("\n")
        s.report(n)
    finally:
        s.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    s = _Session(args)
    messages: list[ChatCompletionRequestMessage] = [{"role": "system", "content": args.system}] if args.system else []
    total = 0
    interactive = sys.stdin.isatty()
    try:
        while True:
            if interactive:
                sys.stdout.write("> ")
                sys.stdout.flush()
            line = sys.stdin.readline()
            if not line or line.strip() in ("/exit", "/quit"):
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            reply: list[str] = []
            chunks = cast(
                "Iterator[CreateChatCompletionStreamResponse]",  # stream=True, as above
                s.llm.create_chat_completion(
                    messages, max_tokens=args.n_predict, stream=True, seed=args.seed, **_sampling(args)
                ),
            )
            for chunk in chunks:
                # The empty delta (the closing chunk) is a delta whose keys, all optional, are absent.
                delta = cast("ChatCompletionStreamResponseDelta", chunk["choices"][0]["delta"])
                text = delta.get("content") or ""
                if text:
                    sys.stdout.write(text)
                    sys.stdout.flush()
                    reply.append(text)
                    total += 1
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(reply)})
        s.report(total)
    finally:
        s.close()
    return 0


# ---- trace ---------------------------------------------------------------


def cmd_trace(args: argparse.Namespace) -> int:
    from moed.engines.tracing import record_trace

    with open(args.prompt_file, encoding="utf-8") as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise BadInput(f"{args.prompt_file} holds no prompts")
    s = _Session(args, logits_all=True)  # every token's route in every layer
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            steps = record_trace(
                s.llm,
                prompts,
                args.output,
                n_predict=args.n_predict,
                chat=args.chat,
                model_name=os.path.basename(args.model),
            )
        print(f"[moed] wrote {steps} steps for {len(prompts)} prompts to {args.output}", file=sys.stderr)
        s.report(steps)
    finally:
        s.close()
    return 0


# ---- kl ------------------------------------------------------------------


def cmd_kl(args: argparse.Namespace) -> int:
    import json

    from moed.engines.llama_cpp import UnpackedLlama
    from moed.lab import kl

    if not os.path.exists(args.model):
        raise BadInput(f"no such model file: {args.model}")
    with open(args.prompt_file, encoding="utf-8") as f:  # an OSError is reported as one line (moed.cli)
        texts = [line.rstrip("\n") for line in f if line.strip()]
    if not texts:
        raise BadInput(f"{args.prompt_file} holds no texts")
    kw = dict(_llama_settings(args), logits_all=True)
    daemon = None
    if args.budget is not None:
        from moed.gguf.budget import parse_budget
        from moed.spawn import DaemonProcess

        daemon = DaemonProcess(parse_budget(args.budget, args.model))
    sessions: list[_Session] = []

    def approx():
        s = _Session(args, socket=daemon.socket if daemon else None, logits_all=True)
        sessions.append(s)
        return s.llm

    def exact():
        """The same kernels without the option: resident, or streamed exactly for a repacked file
        (plain llama.cpp cannot read its experts; streaming is bit-exact with resident)."""
        from moed.gguf.catalog import Catalog

        if Catalog.open(args.model).expert_layouts:
            s = _Session(
                argparse.Namespace(**{**vars(args), "subst": None}),
                socket=daemon.socket if daemon else None,
                logits_all=True,
            )
            sessions.append(s)
            return s.llm
        # repack="auto" on a plain file: its experts are repacked on read, so stock's load (issue 41);
        # on the same layers and threads as the streamed run
        return UnpackedLlama(
            args.model, repack=args.repack, **kw, **EngineOptions.from_args(args, RUN).llama_settings()
        )

    try:
        try:
            report = kl.compare(
                exact,
                approx,
                texts,
                kw["n_ctx"],
                stats=lambda llm: llm.stream_stats(),
            )
        except ValueError as exc:  # llama.cpp refused a file, or the runs disagree on the texts
            raise BadInput(str(exc)) from None
        finally:
            for s in sessions:
                s.client.close()
    finally:
        if daemon is not None:
            daemon.stop()
    st = report.approx_stats or {}
    if args.json:
        out = report.as_dict()
        out["approx_stats"] = {k: v for k, v in st.items() if k.startswith("subst_") or k in ("tokens", "experts")}
        print(json.dumps(out))
    else:
        opts = f"subst r={args.subst:g} ({args.subst_rule})" if args.subst is not None else "no option (exact)"
        print(f"[moed] kl of {opts} against the exact run: {report.line()}{subst_line(st)}")
    return 0
