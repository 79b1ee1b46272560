"""Verify mode's comparison: the first read of an expert is the reference for every later one."""

from moed.cache.store import ExpertKey
from moed.daemon.verify import Verifier
from moed.protocol import errors


def test_a_later_read_that_differs_is_refused_and_counted():
    v = Verifier()
    k = ExpertKey(1, 0, 3)
    assert v.check(k, 0xAB, "here") is None  # first read: recorded
    assert v.check(k, 0xAB, "here") is None  # same bytes: verified
    err = v.check(k, 0xCD, "model 1 layer 0 expert 3")
    assert isinstance(err, errors.VerifyMismatch) and "expert 3" in str(err)
    assert v.stats()["verified_reads"] == 1 and v.stats()["verify_mismatches"] == 1
    assert v.check(k, 0xCD, "again") is not None  # the first read stays the reference


def test_forget_drops_a_closed_models_hashes():
    v = Verifier()
    v.check(ExpertKey(1, 0, 0), 1, "a")
    v.check(ExpertKey(2, 0, 0), 2, "b")
    v.forget(1)
    assert v.stats()["verify_hashed_experts"] == 1
    assert v.check(ExpertKey(1, 0, 0), 9, "a") is None  # a new first read
