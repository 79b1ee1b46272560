"""Recording routing traces from a running StreamedLlama (`moectl trace`).

What this module owns: turning the eval callback's per-layer ids into steps of
`moed.traces` (one step per llama_decode: 'P' for prompt batches, 'D' for
generated tokens), with the engine's own gate-ahead predictions (`ahead1[t, l]`:
layer l predicted at layer l-1's ffn_norm; `ahead2[t, l]`: at layer l-2's; 2 x
top-k wide, best first), and driving greedy generation over a list of prompts.

Invariants:
- The engine must compute every token's route in every layer, so it is created
  with `logits_all=True` (otherwise llama.cpp routes only the output token in the
  last layer and the step would be ragged); `record_trace` checks this.
- A decode that spans several ubatches is still one step: rows are concatenated
  in token order per layer, predictions too. A layer with no prediction (the
  first, or the first two for ahead2) is stored as -1.
"""

from __future__ import annotations

import numpy as np

from moed.engines.lookahead import AheadObserver
from moed.traces import DECODE, PROMPT, TraceWriter


class TraceRecorder(AheadObserver):
    """A route observer (and the look-ahead's) that appends one trace step per decode."""

    def __init__(self, writer: TraceWriter, moe_layers: list[int]):
        self.writer = writer
        self.index = {layer: i for i, layer in enumerate(moe_layers)}
        self.kind = PROMPT
        self._rows: dict[int, list[np.ndarray]] = {}
        self._ahead: dict[int, dict[int, list[np.ndarray]]] = {1: {}, 2: {}}

    def route(self, layer: int, ids: np.ndarray) -> None:
        self._rows.setdefault(self.index[layer], []).append(ids)

    def ahead(self, layer: int, lead: int, ids: np.ndarray) -> None:
        if lead in self._ahead:
            self._ahead[lead].setdefault(self.index[layer], []).append(ids[:, : self.writer.ahead_width].copy())

    def decoded(self) -> None:
        if not self._rows:
            return
        per_layer = [self._join(self._rows, i) for i in range(len(self.index))]
        aheads = [[self._prediction(lead, i, len(per_layer[i])) for i in range(len(self.index))] for lead in (1, 2)]
        self._rows = {}
        self._ahead = {1: {}, 2: {}}
        kept = [None if all(a.size == 0 for a in lead) else lead for lead in aheads]
        self.writer.append_step(self.kind, per_layer, ahead1=kept[0], ahead2=kept[1])

    @staticmethod
    def _join(rows: dict[int, list[np.ndarray]], i: int) -> np.ndarray:
        return np.concatenate(rows.get(i, [np.empty((0, 0), np.int32)]))

    def _prediction(self, lead: int, i: int, n_rows: int) -> np.ndarray:
        """Layer i's predictions for the step, or an empty row (stored as -1) when they do not line up."""
        got = self._join(self._ahead[lead], i)
        return got if got.shape[0] == n_rows else np.empty((0, 0), np.int32)


def chat_prompt(llm, text: str) -> str:
    """`text` as one user turn in the model's own chat template."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        raise ValueError("the model has no chat template (tokenizer.chat_template); drop --chat")
    vocab = llm._model
    fmt = Jinja2ChatFormatter(
        template, eos_token=vocab.token_get_text(vocab.token_eos()), bos_token=vocab.token_get_text(vocab.token_bos())
    )
    return fmt(messages=[{"role": "user", "content": text}]).prompt


def record_trace(
    llm, prompts: list[str], output: str, *, n_predict: int, chat: bool = False, model_name: str = ""
) -> int:
    """Run each prompt then `n_predict` greedy tokens; save the trace; return its step count."""
    if not llm._logits_all:
        raise ValueError("record_trace needs an engine created with logits_all=True")
    src = llm.streamer.source
    bytes_per_expert = sum(e.bytes_per_expert for e in src.extents(src.moe_layers[0]))
    writer = TraceWriter(
        len(src.moe_layers),
        src.n_experts,
        src.n_expert_used,
        bytes_per_expert=bytes_per_expert,
        layer_ids=src.moe_layers,
        meta={
            "model": model_name,
            "engine": "moed StreamedLlama",
            "prompts": len(prompts),
            "n_predict": n_predict,
            "chat": chat,
            "sampling": "greedy",
            "predictions": "gate-ahead at ffn_norm (moed.engines.predictor)",
        },
    )
    recorder = TraceRecorder(writer, src.moe_layers)
    llm.streamer.observers.append(recorder)
    llm.streamer.record_predictions(recorder, writer.ahead_width)
    try:
        eos = llm.token_eos()
        for text in prompts:
            _run_prompt(llm, recorder, chat_prompt(llm, text) if chat else text, n_predict, eos)
    finally:
        llm.streamer.observers.remove(recorder)
        llm.streamer.stop_recording(recorder)
    trace = writer.finish()
    trace.save(output)
    return trace.n_steps


def _run_prompt(llm, recorder: TraceRecorder, text: str, n_predict: int, eos: int) -> None:
    llm.reset()
    recorder.kind = PROMPT
    llm.eval(llm.tokenize(text.encode("utf-8"), special=True))
    recorder.kind = DECODE
    for _ in range(n_predict):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if token == eos or llm.n_tokens >= llm.n_ctx():
            break
        llm.eval([token])
