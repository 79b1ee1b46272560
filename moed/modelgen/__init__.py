"""Model making: real GGUF files written by the project itself.

- `makemodel`: tiny, real MoE models that llama.cpp loads and runs (random weights,
  every architecture of moed.gguf.archs); the tests' fixtures, the demo's `--random`
  model, `moectl make-model` and the benches' models.
- `sparse_headers`: real models' full headers over sparse files, for what only
  reads headers (the catalog's speed, llama.cpp's `vocab_only`).
- `quantmix`: llama.cpp's per-tensor quant mix (Q4_K_M), which both follow.

It imports only the model-file layer (moed.gguf), gguf-py and numpy: never the
daemon, the client, the engines or the lab (tests/unit/test_layering.py).
"""
