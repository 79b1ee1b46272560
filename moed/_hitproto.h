/* The client's side of moed's no-round-trip hit protocol, as plain C on raw words.
 *
 * One copy of the steps (moed/protocol/residency_words.py says why they are safe),
 * included by the two extensions that take hits: moed/_holds.c (the Python client's
 * calls) and moed/engines/_layer_holds.c (the engine's per-layer lane inside llama.cpp's eval
 * callback). Callers check every index against its buffer before calling; these
 * functions only order the loads and stores.
 *
 *   entry  = (generation & 2^40-1) << 24 | (slot + 1)          residency table
 *   state  = (generation & 2^40-1) << 2 | 1  (READY)            slot states
 *   hold   = (class & 0xFFFF) << 48 | (slot & 0xFFFFFF) << 24 | (generation & 0xFFFFFF)
 *   touch  = (class & 0xFFFFFFFF) << 32 | (slot & 0xFFFFFFFF)   the region's ring
 */
#ifndef MOED_HITPROTO_H
#define MOED_HITPROTO_H

#include <stddef.h>
#include <stdint.h>

/* moed.protocol.residency_words: the hold region's layout, in words. */
#define HP_W_RING_HEAD 1
#define HP_W_CLOSED 2
#define HP_W_PIN_HOLD 3 /* model id + 1 while a whole step reads its pinned experts */
#define HP_HOLD_BASE 64
#define HP_HOLD_WORDS 1024
#define HP_RING_BASE (HP_HOLD_BASE + HP_HOLD_WORDS)
#define HP_RING_WORDS 4096
#define HP_REGION_WORDS (HP_RING_BASE + HP_RING_WORDS)

enum { HP_MISS = 0, HP_HIT = 1, HP_BAD = -1 };

/* The word codec, the one copy in C (moed.protocol.residency_words is Python's). */
#define HP_READY 1
#define HP_EVICTING 2
static inline uint64_t hp_entry_slot(uint64_t entry) { return (entry & 0xFFFFFF) - 1; } /* entry != 0 */
static inline uint64_t hp_entry_gen(uint64_t entry) { return entry >> 24; }
static inline uint64_t hp_ready_state(uint64_t gen) { return (gen << 2) | HP_READY; }
static inline uint64_t hp_state_kind(uint64_t state) { return state & 3; }
static inline uint64_t hp_state_gen24(uint64_t state) { return (state >> 2) & 0xFFFFFF; }
static inline uint64_t hp_hold_word(uint64_t class_id, uint64_t slot, uint64_t gen) {
    return ((class_id & 0xFFFF) << 48) | ((slot & 0xFFFFFF) << 24) | (gen & 0xFFFFFF);
}
static inline size_t hp_hold_slot(uint64_t word) { return (size_t)((word >> 24) & 0xFFFFFF); }
static inline uint64_t hp_hold_gen24(uint64_t word) { return word & 0xFFFFFF; }

/* The hit: for each expert read its entry (0: miss, nothing left written) and store a
 * hold in region word hidx[j]; one fence; every state must still read READY with the
 * entry's generation and the region must not be revoked, else the holds are cleared
 * (HP_MISS). HP_BAD: an entry names a slot outside the states (cleared too). */
static inline int hp_hit(const uint64_t *entries, const int64_t *rows, size_t k, const uint64_t *states,
                         size_t n_states, uint64_t *region, const int64_t *hidx, uint64_t class_id,
                         uint64_t *slots) {
    uint64_t expect[k ? k : 1];
    size_t written = 0;
    int rc = HP_MISS;
    for (size_t j = 0; j < k; j++) {
        uint64_t entry = __atomic_load_n(&entries[rows[j]], __ATOMIC_ACQUIRE);
        if (entry == 0) goto clear;
        uint64_t slot = hp_entry_slot(entry), gen = hp_entry_gen(entry);
        if (slot >= n_states) { rc = HP_BAD; goto clear; }
        slots[j] = slot;
        expect[j] = hp_ready_state(gen);
        __atomic_store_n(&region[hidx[j]], hp_hold_word(class_id, slot, gen), __ATOMIC_SEQ_CST);
        written = j + 1;
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (size_t j = 0; j < k; j++)
        if (__atomic_load_n(&states[slots[j]], __ATOMIC_SEQ_CST) != expect[j]) goto clear;
    /* After the fence, as the states: a daemon that revoked the region before this load
     * sees these holds in its scan after its closed store (Dekker again). */
    if (__atomic_load_n(&region[HP_W_CLOSED], __ATOMIC_SEQ_CST) != 0) goto clear;
    return HP_HIT;
clear:
    for (size_t j = 0; j < written; j++) __atomic_store_n(&region[hidx[j]], 0, __ATOMIC_SEQ_CST);
    return rc;
}

/* The release of a local lease: a fence (the lease's byte reads come before it), then
 * every held slot's state must still name the hold's generation (its low 24 bits),
 * READY or EVICTING (a claim that will find this hold and put the state back); then
 * the holds are cleared. 0: some slot got a new residency while held, which happens
 * only once the daemon revoked the region and its grace ended, so the bytes read may
 * not be the expert's. (A refill not yet published is not seen: a net, not the protocol.) */
static inline int hp_release(const uint64_t *states, size_t n_states, uint64_t *region, const int64_t *hidx,
                             size_t k) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int ok = 1;
    for (size_t j = 0; j < k; j++) {
        uint64_t word = __atomic_load_n(&region[hidx[j]], __ATOMIC_RELAXED); /* only we write it */
        size_t slot = hp_hold_slot(word);
        uint64_t st = slot < n_states ? __atomic_load_n(&states[slot], __ATOMIC_SEQ_CST) : 0;
        uint64_t kind = hp_state_kind(st);
        if ((kind != HP_READY && kind != HP_EVICTING) || hp_state_gen24(st) != hp_hold_gen24(word)) ok = 0;
        __atomic_store_n(&region[hidx[j]], 0, __ATOMIC_RELEASE);
    }
    return ok;
}

/* Add `k` local hits to the model's counter word (counter_word < 0: none). Only this
 * process writes it, and every writer holds the GIL, so a relaxed add is enough. */
static inline void hp_count(uint64_t *region, int64_t counter_word, uint64_t k) {
    if (counter_word < 0) return;
    uint64_t n = __atomic_load_n(&region[counter_word], __ATOMIC_RELAXED);
    __atomic_store_n(&region[counter_word], n + k, __ATOMIC_RELAXED);
}

/* Leave a hit's touches for the daemon's LRU and count it: the ring entries first,
 * then the head (a seq_cst store), so the daemon never reads a touch not written.
 * The head lives in the region (only this process writes it); the caller serializes
 * recorders (both extensions call this holding the GIL). counter_word < 0: none. */
static inline void hp_record(uint64_t *region, uint64_t class_id, const uint64_t *slots, size_t k,
                             int64_t counter_word) {
    uint64_t head = __atomic_load_n(&region[HP_W_RING_HEAD], __ATOMIC_RELAXED);
    for (size_t j = 0; j < k; j++, head++)
        region[HP_RING_BASE + head % HP_RING_WORDS] = ((class_id & 0xFFFFFFFF) << 32) | (slots[j] & 0xFFFFFFFF);
    __atomic_store_n(&region[HP_W_RING_HEAD], head, __ATOMIC_SEQ_CST);
    hp_count(region, counter_word, k);
}

#endif
