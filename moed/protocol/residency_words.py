"""Hits without a round trip: the shared words, their encodings, and why they are safe.

Three kinds of shared memory, all naturally aligned little-endian uint64 words:

- the **residency table** of a model (daemon writes, clients map read-only):
  word `layer_index * n_experts + expert` is 0 when that expert is not resident,
  else `entry(generation, slot)`; one more word after the entries (`pin_word`) is
  1 while every expert of the model is pinned and READY (whole steps, below);
- the **slot states** of a size class (daemon writes, clients map read-only):
  word `slot` is `state(generation, READY)` while the slot holds the expert
  installed at `generation`, anything else otherwise (EVICTING, EMPTY);
- a **hold region** per connection (that client writes, the daemon reads): hold
  words naming (class, slot, generation), a ring of touches (recency for the
  daemon's LRU), and local-hit counters per model.

A slot's generation grows every time the slot gets a new residency, so a
(slot, generation) pair names one residency of one expert, never another
(40 bits in entries and states: no wrap in practice).

The protocol (moed._holds does each side's steps with seq_cst atomics):

    client hit                          daemon eviction of a READY slot
    e = load(entry)        (0: miss)    cas(state, READY(g) -> EVICTING(g))
    store(hold, (c, slot, g))           fence
    fence                               for every region: load every hold word
    s = load(state)                     if some word == (c, slot, g): state = READY(g),
    s == READY(g): hit, read the bytes      the slot is not evicted (the store adopts it)
    else: clear the hold, ask the daemon else: entry = 0, the slot may be refilled
    ... release: store(hold, 0)

Why a hit can never read a slot that is being refilled: all these operations
are sequentially consistent, so they fall in one total order. Take a hit on
(slot, g): the client's load of the state read READY(g), so it came before the
daemon's CAS to EVICTING(g) of that residency (after the CAS the state never
reads READY(g) again: a refill publishes READY(g') with g' > g). The client's
hold store came before its load, and the daemon's hold loads come after its
CAS; so the daemon's loads come after the client's store and see the hold (or a
later value of that word, which only the client writes, and which it clears
only on release). The daemon then does not evict; the slot is refilled only
after a later claim finds no hold, i.e. after the client released it. Dekker's
argument: of "client stores, then loads" and "daemon stores, then loads", at
least one side sees the other's store. A stale entry is harmless: the state
check compares the generation the entry named.

Revoking a region. When the daemon itself closes a connection that has a region
(a tenant over its local share while another waits, a peer that reads nothing),
the client may be mid-hit or reading held bytes, and learns of the close only at
its next round trip, which a hit never makes. So the daemon does not stop
counting the region's holds at once; it revokes it, the same Dekker pattern:

    client hit (continued)              daemon revoke
    ... fence, s == READY(g)            store(closed, 1)
    c = load(closed)                    fence
    c != 0: clear the holds, miss       n = count of nonzero hold words
    else: hit                           n == 0: stop counting the region
                                        else: keep counting it; look again later

If the client's load of `closed` read 0, it came before the daemon's store, so
its hold store came before the daemon's count, which sees it: the region keeps
counting until the client releases. If it read 1, the client takes no hit. So
once a count after the closed store reads no hold of a live (published)
residency, no hit holds anything and none ever will: the region can go (a word
naming nothing published protects no read: a hit needs READY(g), and a claim of
a held READY slot is refused, so it stays published). A client that keeps holds
past the grace period (moed.daemon.bounds.REVOKE_GRACE_S) is taken to be hung;
its region stops counting then, which only that client could notice, on bytes it
should have released; its release then checks the held slots' states (after a
fence) and raises LeaseLost if one got a new residency. A peer that breaks the
protocol (a bad frame stream, no Hello) is treated as one that left: dropped.

Whole steps: a decode with no per-layer stop. When every expert of a model is
pinned (the host mirror holds it whole), an engine can let llama.cpp compute its
graph in one piece instead of stopping at each routed layer to take holds. A
pinned slot leaves the pinned partition only through the store's unpin, so one
word per region stands for all the holds of a step, with the same argument:

    engine, before llama_decode         daemon, before a pinned slot leaves
    cas(pin_hold, 0 -> model + 1)       store(pin_word, 0)
    a = load(pin_word)                  for every region: h = load(pin_hold)
    a == 1, region not closed, every    h == model + 1: the unpin waits (retried
      expert READY at the slot mapped:    each period), the slot stays pinned
      compute whole; else clear, stop  else: the slot may leave
      per layer as before
    ... after llama_decode: store(pin_hold, 0)

If the engine's load read 1, it came before the daemon's store of 0, so the
engine's cas came before the daemon's loads, which see it. A pin hold protects
only pinned slots (which nothing but an unpin can take), so what it can keep is
what the operator pinned, for as long as the step runs; a revoked region's pin
hold counts until the region ends, as its holds do.

What a hostile client can do with its own region: write any words there. A
hold word that matches a live residency keeps that slot from eviction (bounded
by the region's HOLD_WORDS, charged to its tenant, gone when its connection
closes or, if the daemon closed it, when revoked as above: a tenant keeps at most
max_clients_per_tenant revoked regions, and its revoked holds still count against
its LOCAL_HOLD_SHARE); a word that matches nothing only costs the daemon a comparison.
Touches and counters are bounds-checked and clamped by the daemon. It can never
write the table, the states or another client's region, so it can never make
another engine read wrong bytes.
"""

from __future__ import annotations

READY = 1
EVICTING = 2
GEN_MASK = (1 << 40) - 1

# The hold region, in words.
MAGIC = 0x6D6F65642D686F6C  # "moed-hol"
W_MAGIC = 0
W_RING_HEAD = 1  # touches ever written (the ring index is head % RING_WORDS)
W_CLOSED = 2  # the daemon's word: nonzero once it revoked the region (moed/_holds.c's W_CLOSED)
W_PIN_HOLD = 3  # the client's word: model id + 1 while a whole step reads that model's pinned experts
COUNTER_BASE = 8  # pairs (model_id, local hits) from here
MAX_MODEL_COUNTERS = 24
HOLD_BASE = 64
HOLD_WORDS = 1024  # a connection holds at most this many slots locally
RING_BASE = HOLD_BASE + HOLD_WORDS
RING_WORDS = 4096
REGION_WORDS = RING_BASE + RING_WORDS


def pin_word(n_entries: int) -> int:
    """The table word after its `n_entries` entries: 1 while every expert is pinned and READY."""
    return n_entries


def entry(generation: int, slot: int) -> int:
    return ((generation & GEN_MASK) << 24) | (slot + 1)


def state(generation: int, st: int) -> int:
    return ((generation & GEN_MASK) << 2) | st


def hold(class_id: int, slot: int, generation: int) -> int:
    """A hold word. Class, slot and generation are truncated: a collision can only
    make the daemon keep a slot it could have evicted, never the reverse."""
    return ((class_id & 0xFFFF) << 48) | ((slot & 0xFFFFFF) << 24) | (generation & 0xFFFFFF)


def touch(class_id: int, slot: int) -> int:
    return ((class_id & 0xFFFFFFFF) << 32) | (slot & 0xFFFFFFFF)


# Decoding, on ints and on numpy arrays of uint64 words alike (numpy >= 2 keeps a Python
# int operand in the array's type, so no numpy import here): the one copy in Python
# (moed/_hitproto.h's hp_entry_slot and friends are C's).


def entry_slot(entries):
    """The slot an entry names; an entry of 0 (no slot) gives -1: check `entries != 0`."""
    slots = entries & 0xFFFFFF
    return slots - 1 if isinstance(entries, int) else slots.astype("int64") - 1


def entry_generation(entries):
    return entries >> 24


def ready_state(generations):
    """The state word a READY slot of that generation holds (`state(generation, READY)`)."""
    return ((generations & GEN_MASK) << 2) | READY
