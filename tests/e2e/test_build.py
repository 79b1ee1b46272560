"""The llama.cpp build moed runs: this CPU's instruction sets only, and never AMX.

scripts/setup-venv builds llama-cpp-python with scripts/llama-build-flags: each
instruction set named from /proc/cpuinfo, AMX off (its K-quant path crashes,
llama.cpp #20824). These tests hold on every x86 and ARM host: they read what the
installed library says it was compiled with.
"""

from __future__ import annotations

import pathlib
import platform
import re
import subprocess

import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("llama_cpp")

ROOT = pathlib.Path(__file__).resolve().parents[2]
# llama_print_system_info's names -> /proc/cpuinfo flags (all must be present)
CPUINFO = {
    "SSE3": ["pni"],
    "SSSE3": ["ssse3"],
    "AVX": ["avx"],
    "AVX2": ["avx2"],
    "AVX_VNNI": ["avx_vnni"],
    "F16C": ["f16c"],
    "FMA": ["fma"],
    "BMI2": ["bmi2"],
    "AVX512": ["avx512f"],
    "AVX512_VBMI": ["avx512vbmi"],
    "AVX512_VNNI": ["avx512_vnni"],
    "AVX512_BF16": ["avx512_bf16"],
    "AMX_INT8": ["amx_int8"],
}


def cpu_flags() -> set[str]:
    text = pathlib.Path("/proc/cpuinfo").read_text()
    m = re.search(r"^(?:flags|Features)\s*:(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


def compiled_features() -> dict[str, bool]:
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    return {k: v == "1" for k, v in re.findall(r"(\w+) = (\d)", info)}


def test_the_build_has_no_amx_path():
    from moed.engines import kernels

    assert not compiled_features().get("AMX_INT8", False)
    assert b"AMX" not in kernels.cpu_backend().extra_bufts  # only CPU_REPACK (or nothing) is offered


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction sets")
def test_the_build_uses_only_instruction_sets_this_cpu_has():
    """A wheel built on another CPU would die with SIGILL: setup-venv keys its cache on the flags."""
    have = cpu_flags()
    used = [name for name, on in compiled_features().items() if on and name in CPUINFO]
    missing = {name: CPUINFO[name] for name in used if not set(CPUINFO[name]) <= have}
    assert not missing, f"llama.cpp was compiled for {missing}, which this CPU lacks: rerun scripts/setup-venv"
    assert "AVX" in used or "avx" not in have  # and it does use what the CPU has


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction sets")
def test_build_flags_name_this_cpu_and_turn_amx_off():
    out = subprocess.run([str(ROOT / "scripts" / "llama-build-flags")], capture_output=True, text=True, check=True)
    cmake_args = out.stdout.splitlines()[0]
    assert "-DGGML_NATIVE=OFF" in cmake_args
    for amx in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"):
        assert f"-D{amx}=OFF" in cmake_args
    have = cpu_flags()
    assert ("-DGGML_AVX2=ON" in cmake_args) == ("avx2" in have)
    assert ("-DGGML_AVX512=ON" in cmake_args) == ("avx512f" in have and "avx512bw" in have)
