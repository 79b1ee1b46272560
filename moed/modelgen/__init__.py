"""Model making: real GGUF files written by the project itself.

- `makemodel`: tiny, real MoE models that llama.cpp loads and runs (random weights,
  every architecture of moed.gguf.archs); the tests' fixtures, the demo's `--random`
  model, `moectl make-model` and the benches' models.
- `sparse_headers`: real models' full headers over sparse files, for what only
  reads headers (the catalog's speed, llama.cpp's `vocab_only`).
- `quantmix`: llama.cpp's per-tensor quant mix (Q4_K_M), which both follow.
- `tinydata`: the tiny trained model's data, the standard library's source in a
  byte-level vocabulary (torch-free: the e2e tests check llama.cpp against it).
- `train`: trains that model (qwen3moe, learned routing) and writes it through
  makemodel's writer; `scripts/train-tiny-moe` drives it.

It imports only the model-file layer (moed.gguf), gguf-py and numpy: never the
daemon, the client, the engines or the lab. `train` alone also imports torch (to
train), llama_cpp (to check the written file computes what torch trained) and
matplotlib (the loss plot), all optional and none of them at the package's
import; nothing else in moed imports `train` (tests/unit/test_layering.py).
"""
