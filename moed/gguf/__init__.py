"""The model-file layer: everything that reads or writes GGUF goes through here.

`header` parses headers fast and safely (never tensor data; opens never block),
`catalog` maps every routed expert to its bytes in a (split) file, `align`
rewrites a GGUF so that experts are page-aligned, `archs` is the one table of what
moed knows per architecture, and `budget` says what a model's experts take in the
RAM tier (and parses budgets such as `50%`). Users: the daemon, the lab, the model
maker (moed.modelgen), the CLI and the engines. Imports only the protocol (errors,
layout, sizes), gguf-py, numpy and moed.badinput.
"""
