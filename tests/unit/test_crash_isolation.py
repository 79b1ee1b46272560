"""A test that crashes its process (llama.cpp's segfaults) is one failed test, not the end of the run.

scripts/test runs pytest with PYTEST_ISOLATION (pytest-xdist, one worker,
restarted after a crash); this runs a tiny suite the same way and checks that a
segfaulting test is reported by name while the tests after it still run.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def isolation_args() -> list[str]:
    text = (ROOT / "scripts" / "test").read_text()
    m = re.search(r"^isolation=\((.*)\)$", text, re.M)
    assert m, "scripts/test defines isolation=(...)"
    return m.group(1).split()


def test_a_segfault_fails_one_test_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_crashes.py").write_text(
        "import ctypes\n"
        "def test_before():\n    assert True\n"
        "def test_segfaults():\n    ctypes.string_at(0)\n"
        "def test_after():\n    assert True\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *isolation_args(), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "test_segfaults" in out and "crashed" in out, out
    assert re.search(r"1 failed, 2 passed", out), out
