"""The model-file layer: everything that reads or writes GGUF goes through here.

`header` parses headers fast and safely (never tensor data; opens never block),
`catalog` maps every routed expert to its bytes in a (split) file, and `align`
rewrites a GGUF so that experts are page-aligned. Users: the daemon, the lab,
the CLI and the engines. Imports only the protocol (errors, layout) and gguf-py.
"""
