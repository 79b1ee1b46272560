"""The no-round-trip hit protocol, checked over every interleaving (moed.protocol.residency_words).

A pure model: one shared memory of words, a client that hits and releases, and
a daemon that tries to evict the slot and refill it with another expert. Every
atomic step of each is one move; the explorer runs every interleaving of the
two programs (sequential consistency: every interleaving is a legal order, and
nothing else is). The property: between a client's successful check and its
release, the slot's bytes are those of the expert it asked for.

The same explorer finds the bug in a client that checks the state before it
stores its hold, so the check can fail.
"""

from __future__ import annotations

from moed.protocol import residency_words as rz

CLASS, SLOT = 3, 5
A, B = "expert A", "expert B"


def initial() -> dict:
    g = 1
    return {
        "entry_A": rz.entry(g, SLOT),
        "entry_B": 0,
        "state": rz.state(g, rz.READY),
        "hold0": 0,
        "hold1": 0,
        "closed": 0,  # the region's closed word (revocation)
        "bytes": A,
        "violations": [],
    }


# Each program is a list of steps; a step takes (memory, locals) and returns the
# next step's index, or None when the program is done.


def client(rounds: int = 2, me_index: int = 0):
    hold_word = f"hold{me_index}"  # each client's own region

    def read_entry(mem, me):
        me["e"] = mem["entry_A"]
        if me["e"] == 0:
            return done_round(me)
        me["g"] = me["e"] >> 24
        return 1

    def store_hold(mem, me):
        mem[hold_word] = rz.hold(CLASS, (me["e"] & 0xFFFFFF) - 1, me["g"])
        return 2

    def check_state(mem, me):  # after the fence
        if mem["state"] != rz.state(me["g"], rz.READY):
            mem[hold_word] = 0
            return done_round(me)
        return 3

    def begin_read(mem, me):
        if mem["bytes"] != A:
            mem["violations"].append("hit read another expert's bytes")
        return 4

    def end_read_and_release(mem, me):
        if mem["bytes"] != A:
            mem["violations"].append("bytes changed under a hit")
        mem[hold_word] = 0
        return done_round(me)

    def done_round(me):
        me["round"] = me.get("round", 0) + 1
        return 0 if me["round"] < rounds else None

    return [read_entry, store_hold, check_state, begin_read, end_read_and_release]


def daemon(rounds: int = 2):
    def claim(mem, me):
        g = me.setdefault("g", 1)
        if mem["state"] == rz.state(g, rz.READY):
            mem["state"] = rz.state(g, rz.EVICTING)
            return 1
        return None

    def scan(mem, me):  # after the fence
        g = me["g"]
        if rz.hold(CLASS, SLOT, g) in (mem["hold0"], mem["hold1"]):
            mem["state"] = rz.state(g, rz.READY)  # refused: put back, try again later
            me["tries"] = me.get("tries", 0) + 1
            return 0 if me["tries"] < rounds else None
        mem["entry_A"] = 0
        return 2

    def refill(mem, me):
        mem["bytes"] = B
        return 3

    def publish(mem, me):
        g = me["g"] + 1
        mem["state"] = rz.state(g, rz.READY)
        mem["entry_B"] = rz.entry(g, SLOT)
        return None

    return [claim, scan, refill, publish]


def explore(programs) -> tuple[int, set[str]]:
    """Run every interleaving; (number of complete runs, violations seen)."""
    runs, seen = 0, set()

    def step(mem, pcs, locs):
        nonlocal runs
        moved = False
        for i, prog in enumerate(programs):
            if pcs[i] is None:
                continue
            moved = True
            m2 = {**mem, "violations": list(mem["violations"])}
            l2 = [dict(x) for x in locs]
            nxt = prog[pcs[i]](m2, l2[i])
            p2 = list(pcs)
            p2[i] = nxt
            step(m2, p2, l2)
        if not moved:
            runs += 1
            seen.update(mem["violations"])

    step(initial(), [0] * len(programs), [{} for _ in programs])
    return runs, seen


def test_no_interleaving_lets_a_hit_read_a_refilled_slot():
    runs, violations = explore([client(), daemon()])
    assert runs > 400  # every order of every step was tried
    assert violations == set()


def test_two_clients_and_the_daemon():
    runs, violations = explore([client(rounds=1), client(rounds=1, me_index=1), daemon(rounds=1)])
    assert runs > 1000 and violations == set()


def test_the_explorer_finds_the_bug_of_checking_before_holding():
    """Check the state, then store the hold: the daemon can scan between the two."""

    def buggy():
        steps = client()

        def check_then_hold_entry(mem, me):
            me["e"] = mem["entry_A"]
            if me["e"] == 0:
                return None
            me["g"] = me["e"] >> 24
            return 1

        def check(mem, me):
            if mem["state"] != rz.state(me["g"], rz.READY):
                return None
            return 2

        def hold(mem, me):
            mem["hold0"] = rz.hold(CLASS, SLOT, me["g"])
            return 3

        return [check_then_hold_entry, check, hold, steps[3], steps[4]]

    _, violations = explore([buggy(), daemon()])
    assert violations, "the explorer must be able to fail"


def test_encodings_agree_with_the_c_hit():
    """moed._holds computes the expected state and the hold word from the entry itself."""
    import mmap

    from moed import _holds

    g, slot, class_id = (1 << 39) + 12345, 77, 9
    table, states, region = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096), mmap.mmap(-1, rz.REGION_WORDS * 8)
    _holds.store(table, 3, rz.entry(g, slot))
    _holds.store(states, slot, rz.state(g, rz.READY))
    assert _holds.hit(table, 0, [3], states, region, [rz.HOLD_BASE], class_id) == [slot]
    assert _holds.load(region, rz.HOLD_BASE) == rz.hold(class_id, slot, g)
    assert _holds.find(region, rz.HOLD_BASE, rz.HOLD_WORDS, rz.hold(class_id, slot, g))
    _holds.store(states, slot, rz.state(g, rz.EVICTING))
    assert _holds.hit(table, 0, [3], states, region, [rz.HOLD_BASE + 1], class_id) is None
    assert _holds.load(region, rz.HOLD_BASE + 1) == 0  # a failed hit leaves no hold
    _holds.clear(region, [rz.HOLD_BASE])
    assert _holds.count(region, rz.HOLD_BASE, rz.HOLD_WORDS) == 0
    _holds.store(region, rz.W_CLOSED, 1)  # revoked: a hit that would succeed misses, and holds nothing
    _holds.store(states, slot, rz.state(g, rz.READY))
    assert _holds.hit(table, 0, [3], states, region, [rz.HOLD_BASE + 2], class_id) is None
    assert _holds.count(region, rz.HOLD_BASE, rz.HOLD_WORDS) == 0


# ---- revoking a region: the daemon closed the connection of a client that may be mid-hit


def revoking_client(check_closed: bool = True, rounds: int = 2):
    """The client's hit with the closed check after its state check (moed/_holds.c)."""
    steps = client(rounds=rounds)
    read_entry, store_hold, check_state, begin_read, end_read = steps

    def closed(mem, me):  # check_state passes on to index 3: here
        if check_closed and mem["closed"]:
            mem["hold0"] = 0
            me["round"] = rounds  # a miss: the socket path, which finds the connection closed
            return None
        return 4

    # indexes: 0 read_entry, 1 store_hold, 2 check_state, 3 closed, 4 begin_read, 5 end_read
    def begin(mem, me):
        begin_read(mem, me)
        return 5

    return [read_entry, store_hold, check_state, closed, begin, end_read]


def revoking_daemon(tries: int = 2):
    """Revoke the region (closed store, then count its holds); only once the count reads
    none does the region stop counting, and then the daemon evicts and refills."""
    evict = daemon(rounds=1)

    def revoke(mem, me):
        mem["closed"] = 1
        return 1

    def count(mem, me):  # after the fence
        if mem["hold0"]:
            me["waits"] = me.get("waits", 0) + 1
            return 1 if me["waits"] < tries else None  # still held: look again next period
        return 2

    def claim(mem, me):
        return _shift(evict[0](mem, me))

    def scan_without_region(mem, me):  # the region no longer counts: only others' holds
        g = me["g"]
        if rz.hold(CLASS, SLOT, g) == mem["hold1"]:
            mem["state"] = rz.state(g, rz.READY)
            return None
        mem["entry_A"] = 0
        return 4

    return [
        revoke,
        count,
        claim,
        scan_without_region,
        lambda m, me: _shift(evict[2](m, me)),
        lambda m, me: _shift(evict[3](m, me)),
    ]


def _shift(nxt):
    return None if nxt is None else nxt + 2


def test_no_interleaving_lets_a_revoked_client_read_a_refilled_slot():
    assert explore([revoking_client(), revoking_daemon()])[1] == set()


def test_the_explorer_finds_the_bug_of_a_hit_that_ignores_the_closed_word():
    assert explore([revoking_client(check_closed=False), revoking_daemon()])[1]
