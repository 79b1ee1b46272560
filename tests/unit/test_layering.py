"""The layering, checked on every module's imports (read with ast, nothing imported).

- protocol imports only the standard library and msgspec;
- the client never imports the daemon, gguf, psutil or llama_cpp;
- the daemon never imports the client;
- the cache model (moed.cache: store, eviction policies, quotas) imports only the
  standard library, so neither the daemon nor the lab, which both import it;
- the libc wrapper (moed/libc.py), shared by the daemon and the engines, imports
  only the standard library;
- the model-file layer (moed.gguf) imports only the protocol, gguf-py and numpy
  (and rich, for align's progress bar; moed.badinput, for budget specs; and
  moed._interleave, repack on read's byte moves in C);
- the lab never imports the daemon;
- the trace format (moed/traces.py) imports only the standard library, numpy,
  msgspec and the tools' input error (moed/badinput.py, itself standard library
  only), so the engines and the lab both may import it;
- the lab validates its input with BadInput, never the wire's BadRequest;
- the model maker (moed.modelgen) imports only the model-file layer, gguf-py and
  numpy (tests, the demo and the benches import it; it imports none of them);
  its trainer (moed/modelgen/train.py) may also import torch, llama_cpp (to check
  the trained file through llama.cpp) and matplotlib (the loss plot), and no other
  module of moed imports the trainer (torch is an optional extra, never the
  daemon's, the client's or the engines');
- the engines (in the inference processes) never import the daemon, nor the lab
  (the trace format they record in is moed/traces.py, below both);
- benchmarks import nothing from tests.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def imports_of(path: pathlib.Path) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            else:
                found.add(node.module or "")
    return found


TRAINER = "moed/modelgen/train.py"
OWN_RULE = {TRAINER}  # files with a rule of their own, left out of their directory's


def modules(where: str) -> list[pathlib.Path]:
    path = ROOT / where
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*.py") if str(p.relative_to(ROOT)) not in OWN_RULE)


def top(name: str) -> str:
    return name.split(".")[0]


def offending(where: str, allowed) -> dict[str, list[str]]:
    out = {}
    for path in modules(where):
        bad = sorted(n for n in imports_of(path) if not allowed(n))
        if bad:
            out[str(path.relative_to(ROOT))] = bad
    return out


STDLIB = set(sys.stdlib_module_names) | {"__future__"}


@pytest.mark.parametrize(
    "where, rule, allowed",
    [
        (
            "moed/protocol",
            "stdlib and msgspec only",
            lambda n: top(n) in STDLIB | {"msgspec"} or n.startswith("moed.protocol"),
        ),
        (
            "moed/client",
            "never the daemon, gguf, psutil or llama_cpp",
            lambda n: (
                not (
                    n.startswith(("moed.daemon", "moed.gguf", "moed.lab", "moed.engines"))
                    or top(n) in {"gguf", "psutil", "llama_cpp"}
                )
            ),
        ),
        ("moed/daemon", "never the client", lambda n: not n.startswith("moed.client")),
        (
            "moed/cache",
            "the standard library only (neither the daemon nor the lab)",
            lambda n: top(n) in STDLIB or n.startswith("moed.cache"),
        ),
        ("moed/libc.py", "the standard library only", lambda n: top(n) in STDLIB),
        (
            "moed/gguf",
            "the protocol, gguf-py, numpy, moed.badinput and moed._interleave (C, no imports)",
            lambda n: (
                top(n) in STDLIB | {"gguf", "numpy", "rich"}
                or n.startswith(("moed.protocol", "moed.gguf"))
                or n in ("moed.badinput", "moed._interleave")
            ),
        ),
        ("moed/lab", "never the daemon", lambda n: not n.startswith("moed.daemon")),
        (
            "moed/traces.py",
            "the standard library, numpy, msgspec and moed.badinput",
            lambda n: top(n) in STDLIB | {"numpy", "msgspec"} or n == "moed.badinput",
        ),
        ("moed/badinput.py", "the standard library only", lambda n: top(n) in STDLIB),
        (
            "moed/modelgen",
            "the model-file layer, gguf-py and numpy",
            lambda n: top(n) in STDLIB | {"gguf", "numpy"} or n.startswith(("moed.gguf", "moed.modelgen")),
        ),
        (
            TRAINER,
            "the model maker's imports, torch, llama_cpp and matplotlib",
            lambda n: (
                top(n) in STDLIB | {"gguf", "numpy", "torch", "llama_cpp", "matplotlib"}
                or n.startswith(("moed.gguf", "moed.modelgen"))
            ),
        ),
        ("moed/engines", "never the daemon", lambda n: not n.startswith("moed.daemon")),
        ("moed/engines", "never the lab", lambda n: not n.startswith("moed.lab")),
        ("bench", "nothing from tests", lambda n: top(n) != "tests"),
    ],
)
def test_layering(where, rule, allowed):
    assert offending(where, allowed) == {}, f"{where} must import {rule}"


def test_nothing_in_moed_imports_the_trainer():
    """torch is an optional extra: only scripts/train-tiny-moe imports the trainer."""
    found = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "moed").rglob("*.py"))
        if "moed.modelgen.train" in imports_of(path) or _imports_name(path, "moed.modelgen", "train")
    ]
    assert found == []


def _imports_name(path: pathlib.Path, module: str, name: str) -> bool:
    """Does `path` do `from module import name`?"""
    return any(
        isinstance(node, ast.ImportFrom) and node.module == module and any(a.name == name for a in node.names)
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
    )


def test_the_lab_raises_no_wire_error_for_its_input():
    """BadRequest is what a daemon answers; the lab's (and its verbs') input errors are BadInput."""
    found = []
    for path in modules("moed/lab") + modules("moed/cli/lab.py") + modules("moed/cli/fleet.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and any(a.name == "BadRequest" for a in node.names):
                found.append(str(path.relative_to(ROOT)))
            elif isinstance(node, ast.Attribute) and node.attr == "BadRequest":
                found.append(str(path.relative_to(ROOT)))
    assert found == []


def test_the_checker_sees_relative_imports():
    """The rules above would pass vacuously if imports were not found."""
    found = imports_of(ROOT / "moed" / "daemon" / "core.py")
    assert "moed.daemon.config" in found and "moed.protocol" in found


def test_unit_tests_run_no_llama_cpp():
    """tests/unit is the fast loop: a test that runs real llama.cpp (imports llama_cpp or
    takes the `llama_cpp` fixture) lives in tests/e2e."""
    found = []
    for path in modules("tests/unit"):
        tree = ast.parse(path.read_text(), str(path))
        takes = any(
            a.arg == "llama_cpp"
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test")
            for a in n.args.args
        )
        if takes or any(top(n) == "llama_cpp" for n in imports_of(path)):
            found.append(str(path.relative_to(ROOT)))
    assert found == []


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """moed's modules and, for each, the moed modules it imports (type-only imports
    included): `from pkg import sub` is an edge to the module pkg.sub where that is a
    module, else to pkg; a package's own __init__ is not counted as imported by its
    submodules (Python runs it first, but it is no dependency of theirs)."""
    paths = {module_name(p): p for p in sorted((ROOT / "moed").rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                subs = {f"{source}.{a.name}" for a in node.names} & paths.keys()
                deps |= subs if len(subs) == len(node.names) else subs | {source}
        graph[mod] = {d for d in deps if d in paths and d != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_moed():
    """No two modules of moed import each other, directly or round a longer circle:
    a module is a part with its own state, not a piece of another in a second file."""
    assert cycles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
    graph = import_graph()
    assert "moed.cache.records" in graph["moed.cache.store"]  # edges are found, relative ones too
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_two_classes_in_moed_share_a_name():
    """A class name says which thing it is: two classes of one name (a protocol and the
    class that is not its implementation; the daemon's lease record and the client's
    Lease) make every reader check the import."""
    where: dict[str, list[str]] = {}
    for path in sorted((ROOT / "moed").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module_name(path))
    assert {name: mods for name, mods in where.items() if len(mods) > 1} == {}


def test_one_module_wraps_libc():
    """moed/libc.py is the only module that opens libc (or the process's own symbols)."""
    found = []
    for path in sorted((ROOT / "moed").rglob("*.py")):
        if path.name == "libc.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "CDLL":
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and (first.value is None or "libc" in str(first.value)):
                    found.append(str(path.relative_to(ROOT)))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "find_library":
                found.append(str(path.relative_to(ROOT)))
    assert found == []


def test_one_module_binds_ggml():
    """moed/engines/ggml_api.py binds every ggml symbol and declares every ggml struct: no
    other module types a foreign function (`argtypes`, `restype`; moed/libc.py types libc's)
    or declares a `Ggml*` ctypes struct, so no symbol is bound twice with other types."""
    allowed = {"moed/engines/ggml_api.py", "moed/libc.py"}
    found = []
    for path in sorted((ROOT / "moed").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            typed = isinstance(node, ast.Attribute) and node.attr in ("argtypes", "restype")
            struct = isinstance(node, ast.ClassDef) and node.name.startswith("Ggml")
            if (typed and isinstance(node.ctx, ast.Store) and rel not in allowed) or (
                struct and rel != "moed/engines/ggml_api.py"
            ):
                found.append(f"{rel}:{node.lineno}")
    assert found == []
