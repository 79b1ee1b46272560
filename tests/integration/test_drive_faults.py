"""A real daemon on a drive that returns EIO for one expert (btrfs on a loop device, root only).

The model lives on a btrfs image with 4 KiB of layer 1 expert 5's `down` part
overwritten underneath the filesystem, so btrfs's checksum fails and the kernel
answers EIO for that block: a real error from the block layer and the
filesystem, nothing mocked. Skipped, with the reason, only where loop devices or
mkfs.btrfs are genuinely missing (scripts/setup-system installs btrfs-progs).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from moed.gguf.catalog import Catalog
from moed.protocol import errors
from moed.testing import file_bytes, wait_for
from moed.testing.faultfs import LoopBtrfs, unavailable

from .peer import NOBODY, as_peer
from .test_daemon import no_direct_dir  # noqa: F401, F811 - a fixture: a filesystem that refuses O_DIRECT

BAD_LAYER, BAD_EXPERT, BAD_PART = 1, 5, "down"

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"real EIO needs a loop btrfs: {unavailable()}")


@pytest.fixture(scope="module")
def bad_drive(model_factory):
    """(model on btrfs with one expert's block corrupted, the pristine copy) for the module."""
    src = model_factory(embd=256, ff=256, align=4096)  # page-aligned 17-page parts: one block is one expert's
    with LoopBtrfs() as fs:
        path = fs.copy_in(src, "model.gguf")
        _, off, length = Catalog.open(str(path)).extent(BAD_LAYER, BAD_EXPERT, BAD_PART)
        fs.corrupt(path, off + 2 * 4096)
        yield str(path), str(src)


def _assert_names_the_bad_expert(exc: BaseException) -> None:
    text = str(exc)
    assert f"layer {BAD_LAYER} expert {BAD_EXPERT} part {BAD_PART}" in text, text
    assert "[Errno 5] EIO" in text and "short read" not in text, text
    assert isinstance(exc, errors.ReadError)  # and the same facts as attributes, for servers
    assert (exc.layer, exc.expert, exc.part, exc.errno) == (BAD_LAYER, BAD_EXPERT, BAD_PART, 5)
    assert str(exc.model).endswith("model.gguf") and exc.model_id == 1


def _exact(h, cat: Catalog, pristine: str, layer: int, experts: list[int]) -> None:
    with h.acquire(layer, experts, timeout_s=30) as lease:
        for e in experts:
            for part in h.parts:
                _, off, length = cat.extent(layer, e, part)
                assert lease.view(e, part).tobytes() == file_bytes(pristine, off, length), (layer, e, part)


def _daemon_fds_threads(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def test_the_bad_expert_fails_with_its_name_and_errno_and_every_other_is_exact(start_daemon, bad_drive):
    model, pristine = bad_drive
    d = start_daemon("64MiB")
    cat = Catalog.open(model)
    with d.client("engine") as c:
        h = c.open_model(model)
        t0 = time.monotonic()
        with pytest.raises(errors.ReadError) as info:
            h.acquire(BAD_LAYER, [BAD_EXPERT], timeout_s=30)
        first_s = time.monotonic() - t0
        _assert_names_the_bad_expert(info.value)
        assert "3 attempts" in str(info.value)  # read_retries = 2 by default
        # Nothing half-read is published: no local hit, no residency, no lease.
        assert not h.resident(BAD_LAYER, [BAD_EXPERT]).any()
        for layer in h.moe_layers:
            good = [e for e in range(h.n_experts) if (layer, e) != (BAD_LAYER, BAD_EXPERT)]
            for i in range(0, len(good), 2):
                _exact(h, cat, pristine, layer, good[i : i + 2])
        # An acquire naming it with a good expert fails whole and holds nothing.
        with pytest.raises(errors.ReadError, match="quarantined"):
            h.acquire(BAD_LAYER, [4, BAD_EXPERT], timeout_s=30)
        t0 = time.monotonic()
        with pytest.raises(errors.ReadError, match="quarantined") as again:
            h.acquire(BAD_LAYER, [BAD_EXPERT], timeout_s=30)
        assert time.monotonic() - t0 < max(0.5, first_s), "a quarantined expert fails at once"
        _assert_names_the_bad_expert(again.value)
        s = c.stats()
        row = s["models"][0]
        assert s["read_errors"] == 1 and row["read_errors"] == 1
        assert s["read_retries"] >= 2 and s["quarantine_refusals"] == 2
        assert s["quarantined_experts"] == 1 and [list(p) for p in row["quarantined"]] == [[BAD_LAYER, BAD_EXPERT]]
        assert s["tenants"][0]["leases"] == 0 and s["reads_in_flight"] == 0
    assert "[Errno 5] EIO" in d.log()


def test_clear_errors_reads_the_expert_again(start_daemon, bad_drive):
    import subprocess
    import sys

    model, _ = bad_drive
    d = start_daemon("64MiB")
    with d.client("engine") as c:
        h = c.open_model(model)
        with pytest.raises(errors.ReadError):
            h.acquire(BAD_LAYER, [BAD_EXPERT])
        assert c.stats()["quarantined_experts"] == 1
        r = subprocess.run(
            [sys.executable, "-m", "moed.ctl", "--socket", d.socket, "clear-errors", model],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0 and "cleared 1 quarantined experts" in r.stdout, r.stderr
        with pytest.raises(errors.ReadError) as info:
            h.acquire(BAD_LAYER, [BAD_EXPERT])
        assert "quarantined" not in str(info.value)  # a real read again, which fails again
        _assert_names_the_bad_expert(info.value)
        assert c.stats()["read_errors"] == 2


def _pristine_bytes(model: str, pristine: str) -> dict:
    cat = Catalog.open(model)
    return {
        (layer, e, part): file_bytes(pristine, *cat.extent(layer, e, part)[1:])
        for layer in cat.moe_layers
        for e in range(cat.n_experts)
        for part in cat.parts
    }


def _other_tenant(socket_path: str, model: str, expected: dict, rounds: int) -> int:
    """Runs as nobody: acquire good experts of every layer, each byte checked."""
    from moed.client import Client

    n = 0
    with Client(socket_path, "other", timeout_s=30) as c:
        h = c.open_model(model)
        for r in range(rounds):
            for layer in h.moe_layers:
                experts = [(r + layer) % 4, 6 + (r % 2)]  # never expert 5
                with h.acquire(layer, experts, timeout_s=30) as lease:
                    for e in experts:
                        for part in h.parts:
                            assert lease.view(e, part).tobytes() == expected[(layer, e, part)], (layer, e, part)
                n += 1
    return n


def test_another_tenant_is_unaffected_while_one_hammers_the_bad_expert(start_shared, bad_drive):
    model, pristine = bad_drive
    expected = _pristine_bytes(model, pristine)
    d = start_shared("4MiB", "read_quarantine_s = 0\nread_retries = 0\n")  # every failing acquire reads
    stop = threading.Event()
    failures = []

    def hammer():
        with d.client("hammer") as c:
            h = c.open_model(model)
            while not stop.is_set():
                try:
                    h.acquire(BAD_LAYER, [BAD_EXPERT, 4])
                except errors.ReadError as exc:
                    failures.append(str(exc))

    t = threading.Thread(target=hammer)
    t.start()
    try:
        wait_for(lambda: failures, what="the hammer's first failure")
        out = as_peer(NOBODY, NOBODY, _other_tenant, d.socket, model, expected, 10, timeout_s=120)
    finally:
        stop.set()
        t.join(30)
    assert out.error == "" and out.result == 10 * 4, out
    assert len(failures) > 1 and all("expert 5 part down" in f for f in failures[:5])
    with d.client() as c:
        s = c.stats()
    assert s["read_errors"] == len(failures)
    assert all(t["leases"] == 0 for t in s["tenants"])


def test_a_thousand_failing_reads_leak_no_slot_lease_fd_or_thread(start_daemon, bad_drive):
    model, _ = bad_drive
    d = start_daemon("4MiB", config={"read_quarantine_s": 0, "read_retries": 0})
    with d.client("engine") as c:
        h = c.open_model(model)
        with h.acquire(0, [0, 1]):
            pass
        for _ in range(10):
            with pytest.raises(errors.ReadError):
                h.acquire(BAD_LAYER, [BAD_EXPERT, 3])
        before = c.stats()
        fds, threads = _daemon_fds_threads(d.proc.pid)
        for _ in range(1000):
            with pytest.raises(errors.ReadError):
                h.acquire(BAD_LAYER, [BAD_EXPERT, 3])
        after = c.stats()
        assert after["read_errors"] - before["read_errors"] == 1000
        assert _daemon_fds_threads(d.proc.pid) == (fds, threads)
        assert after["used_bytes"] == before["used_bytes"]  # expert 3 stays cached, 5 never is
        assert after["resident_experts"] == before["resident_experts"]
        assert after["reads_in_flight"] == 0 and after["tenants"][0]["leases"] == 0
        assert not h.resident(BAD_LAYER, [BAD_EXPERT]).any()
        with h.acquire(BAD_LAYER, [3, 4]):  # the layer still serves
            pass


def test_metrics_count_read_errors_overall_and_per_model(start_daemon, bad_drive):
    from .test_metrics import free_port, scrape

    model, _ = bad_drive
    port = free_port()
    d = start_daemon("64MiB", "--metrics-listen", f"127.0.0.1:{port}")
    with d.client() as c:
        h = c.open_model(model)
        with pytest.raises(errors.ReadError):
            h.acquire(BAD_LAYER, [BAD_EXPERT])
        h.prefetch(BAD_LAYER, [BAD_EXPERT])  # quarantined: skipped, no read
        s = c.stats()
    m = scrape(port)
    assert m[("moed_read_errors_total", ())] == 1 == s["read_errors"]
    assert m[("moed_quarantined_experts", ())] == 1
    assert m[("moed_prefetch_dropped_total", ())] == s["prefetch_dropped"]
    labels = (("model", model), ("model_id", str(h.model_id)))
    assert m[("moed_model_read_errors_total", labels)] == 1


def test_a_model_split_over_btrfs_and_a_filesystem_without_o_direct(start_daemon, model_factory, no_direct_dir):  # noqa: F811
    """One shard on btrfs (O_DIRECT, one block corrupted), the other where O_DIRECT is refused
    (read buffered): the same error for the bad expert, exact bytes from both filesystems."""
    import shutil

    shards = model_factory.shards(embd=256, ff=256, align=4096, split=2)
    with LoopBtrfs() as fs:
        first = fs.copy_in(shards[0], shards[0].name)
        second = os.path.join(no_direct_dir, shards[1].name)
        shutil.copyfile(shards[1], second)
        os.symlink(second, fs.mnt / shards[1].name)  # the reader opens the file it resolves to
        cat = Catalog.open(str(first))
        on = {
            s: [
                (layer, e)
                for layer in cat.moe_layers
                for e in range(cat.n_experts)
                if os.path.realpath(cat.extent(layer, e, BAD_PART)[0]) == s
            ]
            for s in (str(first), os.path.realpath(second))
        }
        assert all(on.values()), "both shards hold experts"
        bad_layer, bad_expert = on[str(first)][-1]
        fs.corrupt(first, cat.extent(bad_layer, bad_expert, BAD_PART)[1] + 4096)
        d = start_daemon("64MiB")
        with d.client("engine") as c:
            h = c.open_model(str(first))
            with pytest.raises(errors.ReadError) as info:
                h.acquire(bad_layer, [bad_expert])
            assert f"layer {bad_layer} expert {bad_expert} part {BAD_PART}" in str(info.value)
            assert "[Errno 5] EIO" in str(info.value)
            for layer, e in [on[str(first)][0], on[os.path.realpath(second)][0]]:
                with h.acquire(layer, [e]) as lease:
                    for part in h.parts:
                        path, off, length = cat.extent(layer, e, part)
                        src = shards[0] if os.path.realpath(path) == str(first) else shards[1]
                        assert lease.view(e, part).tobytes() == file_bytes(str(src), off, length)
            (row,) = c.stats()["models"]
            assert row["direct_io"] is False and row["read_errors"] == 1
        d.stop()  # before the filesystem goes
