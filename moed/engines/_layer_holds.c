/* The layer holds: a streamed model's routed stops in C, and llama.cpp's eval callback that feeds them.
 *
 * WHAT THIS MODULE OWNS: what a streamed model's routed layers hold, and the path each
 * routed stop takes (moed.engines.holds is its Python face). At any time the holds hold
 * at most one of three things:
 *   - their own hit grant (a lane layer's hit taken here: hold words in the connection's
 *     region, moed/_hitproto.h, the same steps as moed._holds);
 *   - a Python grant (what Python acquired from moed, handed over in route_fn's answer);
 *   - the whole step's pin hold (every expert pinned: no per-layer stop at all).
 * Every streamed model has holds, lane layers or not, local hits or not.
 *
 * THE EVAL CALLBACK. ggml's scheduler calls it twice for the nodes it cares about: once
 * with ask=true for EVERY node of the graph ("do you want this one?"), and once with
 * ask=false for those the answer was yes to, after computing them. The ask pass is a
 * name compare here (a Python callback would pay a ctypes transition and a name read on
 * each of the ~500 ask calls a token makes on a 16-layer MoE). The wanted nodes are each
 * routed layer's STOP, and the router's input while observing (moed.gguf.archs.RouterInput:
 * `ffn_norm-<n>` by default), which goes to the handle's own function, the GIL taken.
 *
 * A LAYER'S STOP is its own (`stop_at`, set at load): the top-k `ffn_moe_topk-<n>` (the
 * default: a CPU layer), or the routing weights `ffn_moe_weights-<n>` for a layer whose
 * experts compute from device slots (the weights are gathered by expert id, so the ids
 * are rewritten into slot ids after that gather: moed.engines.device_slots). Either way
 * the stop's top-k is the one route_fn is given (the weights' src[1]).
 *
 * A ROUTED STOP (the GIL held). When the ids are final (no route hook or substitution
 * may change them: `begin`'s try_hits) the holds try the layer's hit here:
 *   - a LANE layer (relaxed zero copy, mapped by the holds alone): read the top-k ids,
 *     hp_hit, release the earlier hit grant, leave the touches and the counter, and map
 *     every expert whose slot changed (MAP_FIXED of the daemon's read-only memfd);
 *   - a DEVICE layer (device slots, `device_layer`): read the top-k ids; when every
 *     distinct expert is in a slot of the layer's device LRU, bump their last use, write
 *     the slot ids over the top-k and release the earlier hit grant; else nothing changes.
 * The ids are read through the node's strides in host memory, or with one 2-D copy
 * through ggml's backend (`backend`: ggml_backend_tensor_get_2d/_set_2d, found in
 * Python) when the node sits in a device's memory (an offloaded layer's top-k).
 * A hit with nothing for Python this step (`begin`'s alone: no look-ahead, observer or
 * trace at the stop) and no Python grant to let go is the whole layer, in C: a few
 * microseconds (between two layers' callbacks the matmuls stream tens of MB of weights,
 * so the callback runs with cold caches, and a Python acquire and show cost 115 us a
 * layer where a warm loop says 22: bench/RESULTS.md, issue 22).
 * Otherwise exactly one call into Python: route_fn(topk, layer, status, grant, ids):
 *   status > 0      a hit taken here, of this many experts (a lane layer's held by the
 *                   holds' hit grant; a device layer's slot ids written): Python only
 *                   scores and prefetches, and lets `grant` go;
 *   LANE_MISSED     a lane layer's hit was tried and missed: Python asks the daemon,
 *                   with no second try (one hp_hit a layer);
 *   DEVICE_MISSED   a device layer's expert is in no slot: Python acquires what no slot
 *                   holds (the source's hit first), uploads it and writes the slot ids;
 *   NOT_TRIED       ids not final, odd ids, not a lane or device layer, no region:
 *                   Python tries the source's hit, then acquires on a miss;
 *   LOST, MAP_FAILED an earlier hit grant was lost, a mapping failed;
 * `grant` is the Python grant held until now (None: none), Python's to let go,
 * piggybacked on its acquire; `ids` the top-k's ids as read here (bytes of (rows, k)
 * int32, row-major; None when not read), so Python reads no node twice, and after a
 * device hit they are the experts, where the node now holds slots. Before Python asks
 * the daemon (every status but a hit) the holds' own hit grant is released.
 *
 * ONE OWNER FOR A GRANT: route_fn answers whether the graph goes on, and with the grant it
 * acquired: `(go_on, grant | None[, experts, slots])`. The holds hold that grant from the
 * moment the call returns, and map a lane layer's experts at their slots then (a failed
 * mapping keeps the grant and tells Python in one more call, MAP_FAILED): a missed layer
 * is one call C->Python and none back. A Python grant is released by Python alone
 * (moed.engines.grants), at the next stop (passed to it) or after the decode (`end` gives
 * it back); the holds' own hit grant and pin hold are released by one function here
 * (`let_go`). After a failure (`fail`) no hit is tried and no grant is passed until `end`.
 *
 * CROSSINGS: every routed stop is counted under exactly one outcome, with its calls
 * into Python (route_fn), its calls from Python to the holds while it was under way, the
 * most from Python at one stop, and its host time, Python's part included (`crossings`):
 *   lane_hit            a lane layer's hit, the whole layer in C (no Python);
 *   lane_hit_python     a lane layer's hit taken in C, then Python called;
 *   lane_miss           a lane layer's hit tried and missed (LANE_MISSED);
 *   device_hit          every routed expert in a device slot, the whole layer in C;
 *   device_hit_python   the same, then Python called;
 *   device_miss         a device layer's expert in no slot (DEVICE_MISSED);
 *   not_tried           nothing tried in C (NOT_TRIED);
 *   failed              LOST or MAP_FAILED.
 *
 * THE DEVICE LRU, per device layer: the numpy arrays of moed.engines.device_lru's
 * SlotLru, the policy's own (their buffers held here from `device_layer` until `free`):
 *   slot_of_expert  int32[n_expert]  the slot holding each expert, -1: none
 *   expert_of_slot  int32[S]         the expert each slot holds, -1: free
 *   last_use        int64[S]         the layer's clock at each slot's last use
 *   clock           int64[2]         [0] the clock, ticking once per distinct expert used,
 *                                    in ascending expert order; [1] the hits, summed
 * A device hit is `device_lru.full_hit` step for step: it only ticks the clock, stamps
 * `last_use` and counts the hits, and writes a slot only where both maps agree; the
 * policy alone fills and evicts (in Python, at a miss).
 *
 * WHOLE STEPS: when every expert of the model is pinned (the table's pin word reads 1),
 * a decode needs no per-layer stop at all. `whole_begin` takes the region's pin hold
 * (moed.protocol.residency_words: one word that keeps every pinned slot of the model),
 * checks every expert is READY at the slot its addresses show (mapping those that are
 * not), and while it is held the ask pass answers no to every node, so ggml computes the
 * graph in one piece as it does with no callback; `whole_end` lets the hold go.
 *
 * INVARIANTS. One owner for each thing the holds touch: they alone map the addresses of
 * their lane layers (Python's grant as its answer hands it over, warm through `place`); a
 * device hit writes only slots the layer's LRU says hold the expert; their hold indexes
 * were handed to them by the client's region and are their own; the ring's head is the
 * region's word, which every recorder writes holding the GIL (the holds always run
 * holding it). A hit tried on anything but a plain hit (a revoked or disabled region, an
 * id out of range, an expert in no slot) changes nothing. Nothing is read through a
 * pointer the layout did not say (`new`'s node layout is ggml_tensor.HOLDS_LAYOUT).
 *
 * Every function taking the holds (or the callback's handle) takes it first, and parses
 * its own arguments after it with one helper (`holds_args`, `callback_args`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "../_hitproto.h"

#define PREFIX_MAX 47 /* a ggml name is at most 63 bytes; the prefix leaves room for digits */
#define MAX_PARTS 4
#define MAX_LAYERS 4096
#define GGML_TYPE_I32 26
#define HOLDS_CAPSULE "moed.layer_holds"
#define CALLBACK_CAPSULE "moed.eval_callback"

/* A routed stop's status, as route_fn is given it (> 0: a hit of that many experts, taken here). */
#define ST_NOT_TRIED (-1)
#define ST_LOST (-2)
#define ST_MAP_FAILED (-3)
#define ST_LANE_MISSED (-4)
#define ST_DEVICE_MISSED (-5)
#define LOG_LAYERS 1024
#define LOG_EXPERTS 16384

/* A layer's stop node. */
enum { STOP_TOPK, STOP_WEIGHTS };
static const char *const STOP_PREFIX[2] = {"ffn_moe_topk-", "ffn_moe_weights-"};

/* The outcomes a routed stop is counted under (the module comment). */
enum {
    OUT_LANE_HIT, OUT_LANE_HIT_PYTHON, OUT_LANE_MISS, OUT_DEVICE_HIT, OUT_DEVICE_HIT_PYTHON, OUT_DEVICE_MISS,
    OUT_NOT_TRIED, OUT_FAILED, N_OUT
};
static const char *const OUT_NAMES[N_OUT] = {"lane_hit", "lane_hit_python", "lane_miss", "device_hit",
                                             "device_hit_python", "device_miss", "not_tried", "failed"};

/* Where struct ggml_tensor keeps what the holds read (ggml_tensor.HOLDS_LAYOUT). */
typedef struct {
    size_t name, type, buffer, ne, nb, src, data;
} NodeLayout;

/* ggml's backend calls for a node in a device's memory (NULL: every node is read as host memory). */
typedef void (*TensorSet2d)(void *tensor, const void *data, size_t offset, size_t size, size_t n_copies,
                            size_t stride_tensor, size_t stride_data);
typedef void (*TensorGet2d)(const void *tensor, void *data, size_t offset, size_t size, size_t n_copies,
                            size_t stride_tensor, size_t stride_data);
typedef bool (*BufferIsHost)(void *buffer);

typedef struct {
    int64_t row_base;
    uint64_t class_id;
    Py_buffer states;
    int fd;
    int n_parts;
    uintptr_t addr[MAX_PARTS]; /* expert 0's address of each part */
    size_t bytes[MAX_PARTS];
    uint64_t part_off[MAX_PARTS], part_stride[MAX_PARTS];
    int64_t *placed; /* slot mapped at each expert's addresses, -1: none (PROT_NONE) */
    uint64_t ns;     /* time in this layer's hits */
} LaneLayer;

typedef struct {
    Py_buffer slot_of_expert, expert_of_slot, last_use, clock; /* the policy's arrays (the module comment) */
    int64_t n_slots;
    uint64_t ns; /* time in this layer's hits */
} DeviceLayer;

typedef struct {
    int live;
    int has_region;
    PyObject *route_fn; /* route_fn(topk, layer, status, grant | None, ids | None) -> bool */
    Py_buffer region, table;
    int64_t n_experts;
    int64_t counter_word;
    NodeLayout at;
    TensorGet2d get_2d;
    TensorSet2d set_2d;
    BufferIsHost is_host;
    /* ---- what is held: at most one of the three ---- */
    int64_t *holds[2]; /* two sets of hold indexes: the hit grant held, and the next */
    Py_ssize_t set_size;
    int cur_set;        /* the set the held hit grant uses */
    Py_ssize_t cur_n;   /* experts in the held hit grant (0: none) */
    LaneLayer *cur;     /* its layer */
    PyObject *grant;    /* a Python grant, route_fn's answer (NULL: none) */
    int whole;          /* the region's pin hold is ours: a whole step is under way */
    /* ---- the decode's path choice (begin) ---- */
    int try_hits, alone, stopped, disabled;
    int64_t model_id, pin_word; /* pin_word < 0: no whole steps (pins not called) */
    uint64_t whole_decodes;     /* whole steps taken (whole_end) */
    int map_errno;              /* the last mapping's errno (ST_MAP_FAILED) */
    /* ---- the layers ---- */
    unsigned char stop[MAX_LAYERS]; /* each layer's stop node (STOP_TOPK unless stop_at said) */
    LaneLayer *lanes[MAX_LAYERS];
    DeviceLayer *devices[MAX_LAYERS];
    /* ---- the stop under way: its ids as read, the slot ids written, its distinct experts ---- */
    int32_t *ids, *slot_ids;
    int64_t ids_cap, n_ids; /* n_ids < 0: not read at this stop */
    unsigned char *mark;
    int64_t *experts, *rows;
    uint64_t *slots;
    uint64_t n_layers, n_experts_acq, acquire_ns, show_ns, maps, misses;
    uint64_t device_layers, device_experts, device_ns;
    /* ---- crossings, by a stop's outcome ---- */
    int in_stop;         /* inside route_fn: calls from Python count against the stop */
    uint64_t stop_calls; /* calls from Python during the stop under way */
    uint64_t stops[N_OUT], to_python[N_OUT], from_python[N_OUT], most_from_python[N_OUT];
    uint64_t stop_ns[N_OUT]; /* host time in the stops, Python's part included */
    /* While logging: the (layer, experts) of every layer done alone, for the engine's cache
     * estimate (take_log); a full log drops the rest and says so. */
    int logging, log_full;
    Py_ssize_t log_n, log_used;
    int32_t log_layer[LOG_LAYERS];
    Py_ssize_t log_start[LOG_LAYERS + 1];
    int32_t log_experts[LOG_EXPERTS];
} Holds;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int layer_stop(const Holds *H, long layer) {
    return H != NULL && layer >= 0 && layer < MAX_LAYERS ? H->stop[layer] : STOP_TOPK;
}

static LaneLayer *lane_of(const Holds *H, long layer) {
    return layer >= 0 && layer < MAX_LAYERS ? H->lanes[layer] : NULL;
}

static DeviceLayer *device_of(const Holds *H, long layer) {
    return layer >= 0 && layer < MAX_LAYERS ? H->devices[layer] : NULL;
}

/* ---- a node's top-k: read, written, its distinct experts ----------------- */

#define FIELD(node, off, type) (*(type const *)((const char *)(node) + (off)))

/* The top-k of a stop node: itself, or the routing weights' ids (src[1]); NULL: none. */
static const char *stop_topk(const Holds *H, const char *node, int kind) {
    if (kind == STOP_TOPK) return node;
    return ((const char *const *)(node + H->at.src))[1];
}

static bool on_host(const Holds *H, const char *node) {
    void *buffer = FIELD(node, H->at.buffer, void *);
    return buffer == NULL || H->is_host == NULL || H->is_host(buffer);
}

static int ensure_ids(Holds *H, int64_t n) {
    if (n <= H->ids_cap) return 0;
    int32_t *ids = PyMem_Realloc(H->ids, (size_t)n * 4), *slots;
    if (ids == NULL) return -1;
    H->ids = ids;
    if ((slots = PyMem_Realloc(H->slot_ids, (size_t)n * 4)) == NULL) return -1;
    H->slot_ids = slots;
    H->ids_cap = n;
    return 0;
}

/* The top-k's ids into H->ids, (rows, k) row-major: through its strides in host memory, or one
 * 2-D copy through ggml's backend from a device's; their count, or -1: not a matrix of int32
 * ids this can read (Python's path reads it). */
static int64_t read_ids(Holds *H, const char *topk) {
    const int64_t *ne = &FIELD(topk, H->at.ne, int64_t);
    const size_t *nb = &FIELD(topk, H->at.nb, size_t);
    if (FIELD(topk, H->at.type, int) != GGML_TYPE_I32 || ne[2] * ne[3] != 1 || ne[0] < 0 || ne[1] < 0) return -1;
    int64_t k = ne[0], rows = ne[1];
    if (ensure_ids(H, k * rows) < 0) return -1;
    const char *data = FIELD(topk, H->at.data, const char *);
    if (on_host(H, topk)) {
        for (int64_t t = 0; t < rows; t++)
            for (int64_t j = 0; j < k; j++) H->ids[t * k + j] = *(const int32_t *)(data + t * nb[1] + j * nb[0]);
    } else {
        if (H->get_2d == NULL || nb[0] != 4) return -1;
        if (k > 0 && rows > 0) H->get_2d(topk, H->ids, 0, (size_t)k * 4, (size_t)rows, nb[1], (size_t)k * 4);
    }
    return H->n_ids = k * rows;
}

/* H->slot_ids over the top-k's ids, through the same strides (the argsort's other columns untouched). */
static void write_slot_ids(Holds *H, const char *topk) {
    const int64_t *ne = &FIELD(topk, H->at.ne, int64_t);
    const size_t *nb = &FIELD(topk, H->at.nb, size_t);
    int64_t k = ne[0], rows = ne[1];
    if (on_host(H, topk)) {
        char *data = FIELD(topk, H->at.data, char *);
        for (int64_t t = 0; t < rows; t++)
            for (int64_t j = 0; j < k; j++) *(int32_t *)(data + t * nb[1] + j * nb[0]) = H->slot_ids[t * k + j];
    } else {
        H->set_2d((void *)topk, H->slot_ids, 0, (size_t)k * 4, (size_t)rows, nb[1], (size_t)k * 4);
    }
}

/* The distinct experts of the ids read, ascending (as np.unique), into H->experts: how many,
 * or -1 when an id is past the experts or negative (a lane layer skips negative ids: no expert). */
static int64_t distinct(Holds *H, int skip_negative) {
    int64_t n = H->n_experts, m = 0;
    int bad = 0;
    for (int64_t i = 0; i < H->n_ids; i++) {
        int32_t id = H->ids[i];
        if (id >= n || (id < 0 && !skip_negative)) bad = 1;
        else if (id >= 0) H->mark[id] = 1;
    }
    for (int64_t e = 0; e < n; e++)
        if (H->mark[e]) { H->mark[e] = 0; H->experts[m++] = e; }
    return bad ? -1 : m;
}

/* ---- the lane: a CPU layer's hit on the daemon's slots, mapped here ----- */

/* Map every expert of the layer whose slot changed; MAP_FIXED replaces what was there. */
static int lane_map(Holds *H, LaneLayer *ly, int64_t expert, uint64_t slot, int populate) {
    if (ly->placed[expert] == (int64_t)slot && !populate) return 0;
    ly->placed[expert] = -1; /* until every part is mapped: a failure leaves it unknown */
    for (int p = 0; p < ly->n_parts; p++) {
        void *addr = (void *)(ly->addr[p] + (uintptr_t)expert * ly->bytes[p]);
        off_t off = (off_t)(ly->part_off[p] + slot * ly->part_stride[p]);
        int flags = MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0);
        if (mmap(addr, ly->bytes[p], PROT_READ, flags, ly->fd, off) == MAP_FAILED) return -1;
    }
    ly->placed[expert] = (int64_t)slot;
    H->maps++;
    return 1;
}

/* THE RELEASE in C (the only one): let go of what the holds hold of their own, the hit grant
 * (its hold words cleared, moed/_hitproto.h) and the pin hold (its word zeroed; after the
 * step's reads: ggml's threads are joined, so they came first). 0: the hit grant was lost (a
 * slot refilled while held). A Python grant is Python's to release (moed.engines.holds). */
static int let_go(Holds *H) {
    int ok = 1;
    if (H->cur_n)
        ok = hp_release((const uint64_t *)H->cur->states.buf, (size_t)(H->cur->states.len / 8),
                        (uint64_t *)H->region.buf, H->holds[H->cur_set], (size_t)H->cur_n);
    H->cur_n = 0; H->cur = NULL;
    if (H->whole) {
        H->whole = 0;
        __atomic_store_n(&((uint64_t *)H->region.buf)[HP_W_PIN_HOLD], 0, __ATOMIC_SEQ_CST);
    }
    return ok;
}

/* An answer's lane layer and lists: a lane layer, as many experts as slots (or no layer); 0 with an error set. */
static int listed(Holds *H, Py_ssize_t layer, PyObject *experts, PyObject *slots) {
    if (layer < 0) return 1;
    if (lane_of(H, layer) != NULL && PyList_Check(experts) && PyList_Check(slots) &&
        PyList_GET_SIZE(experts) == PyList_GET_SIZE(slots))
        return 1;
    PyErr_Format(PyExc_ValueError, "layer %zd is not a lane layer, or experts and slots differ", layer);
    return 0;
}

/* Map lane layer `layer`'s experts at `slots` (checked by `listed`): 1, or with an error set
 * 0 (a bad list) or -1 (a mapping failed: map_errno says why). */
static int map_listed(Holds *H, Py_ssize_t layer, PyObject *experts, PyObject *slots) {
    LaneLayer *ly = lane_of(H, layer);
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(experts); j++) {
        long long e = PyLong_AsLongLong(PyList_GET_ITEM(experts, j));
        unsigned long long s = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(slots, j));
        if (PyErr_Occurred()) return 0;
        if (e < 0 || e >= H->n_experts) {
            PyErr_Format(PyExc_ValueError, "expert %lld out of range", e);
            return 0;
        }
        if (lane_map(H, ly, (int64_t)e, (uint64_t)s, 0) < 0) {
            H->map_errno = errno;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
    }
    return 1;
}

/* The hit of H->experts[0..m) on lane layer `ly`: held in the other hold set, the earlier hit
 * grant released, recorded and mapped. Experts held (> 0), ST_MISSED, ST_NOT_TRIED (nothing
 * changed), ST_LOST (held; the earlier hit grant was lost) or ST_MAP_FAILED (held). */
static int lane_take(Holds *H, LaneLayer *ly, int64_t m) {
    uint64_t t0 = now_ns();
    const uint64_t *table = (const uint64_t *)H->table.buf;
    for (int64_t j = 0; j < m; j++) {
        H->rows[j] = ly->row_base + H->experts[j];
        if (H->rows[j] >= H->table.len / 8) return ST_NOT_TRIED;
    }
    uint64_t *region = (uint64_t *)H->region.buf;
    int next = H->cur_n ? 1 - H->cur_set : H->cur_set;
    if (hp_hit(table, H->rows, (size_t)m, (const uint64_t *)ly->states.buf, (size_t)(ly->states.len / 8), region,
               H->holds[next], ly->class_id, H->slots) != HP_HIT) {
        H->misses++;
        return ST_LANE_MISSED;
    }
    int lost = !let_go(H); /* the earlier hit grant, after the new one holds what both share */
    H->cur_set = next; H->cur_n = m; H->cur = ly;
    hp_record(region, ly->class_id, H->slots, (size_t)m, H->counter_word);
    uint64_t t1 = now_ns();
    for (int64_t j = 0; j < m; j++)
        if (lane_map(H, ly, H->experts[j], H->slots[j], 0) < 0) { H->map_errno = errno; return ST_MAP_FAILED; }
    H->n_layers++; H->n_experts_acq += (uint64_t)m;
    H->acquire_ns += t1 - t0; H->show_ns += now_ns() - t1; ly->ns += t1 - t0;
    return lost ? ST_LOST : (int)m;
}

static int lane_try(Holds *H, const char *topk, LaneLayer *ly) {
    if (!H->has_region || H->disabled || read_ids(H, topk) < 0) return ST_NOT_TRIED;
    int64_t m = distinct(H, 1);
    if (m <= 0 || m > H->set_size) return ST_NOT_TRIED;
    return lane_take(H, ly, m);
}

/* ---- a device layer: every routed expert in a slot, the slot ids written ---- */

/* The slot of expert e in the layer's LRU where both maps agree, else -1. */
static int64_t device_slot(const DeviceLayer *dv, int64_t e) {
    int32_t s = ((const int32_t *)dv->slot_of_expert.buf)[e];
    return s >= 0 && s < dv->n_slots && ((const int32_t *)dv->expert_of_slot.buf)[s] == e ? s : -1;
}

/* A device layer's hit: experts (> 0), ST_DEVICE_MISSED (an expert in no slot: nothing
 * changed), ST_NOT_TRIED (odd ids) or ST_LOST (the hit taken; the earlier hit grant lost). */
static int device_try(Holds *H, const char *topk, DeviceLayer *dv) {
    uint64_t t0 = now_ns();
    if (read_ids(H, topk) < 0) return ST_NOT_TRIED;
    int64_t m = distinct(H, 0);
    if (m <= 0) return ST_NOT_TRIED;
    for (int64_t j = 0; j < m; j++)
        if (device_slot(dv, H->experts[j]) < 0) return ST_DEVICE_MISSED;
    int64_t *last_use = (int64_t *)dv->last_use.buf, *clock = (int64_t *)dv->clock.buf;
    const int32_t *slot_of = (const int32_t *)dv->slot_of_expert.buf;
    for (int64_t j = 0; j < m; j++) last_use[slot_of[H->experts[j]]] = ++clock[0];
    clock[1] += m;
    for (int64_t i = 0; i < H->n_ids; i++) H->slot_ids[i] = slot_of[H->ids[i]];
    write_slot_ids(H, topk);
    int lost = !let_go(H); /* the earlier layers' matmuls have run: their hit grant may go */
    uint64_t dt = now_ns() - t0;
    H->device_layers++; H->device_experts += (uint64_t)m; H->device_ns += dt; dv->ns += dt;
    return lost ? ST_LOST : (int)m;
}

/* ---- one routed stop ----------------------------------------------------- */

/* The layer just taken (H->experts[0..m)) into the log, while logging. */
static void log_layer(Holds *H, long layer, int64_t m) {
    if (!H->logging) return;
    if (H->log_n < LOG_LAYERS && H->log_used + m <= LOG_EXPERTS) {
        H->log_layer[H->log_n] = (int32_t)layer;
        H->log_start[H->log_n] = H->log_used;
        for (int64_t j = 0; j < m; j++) H->log_experts[H->log_used++] = (int32_t)H->experts[j];
        H->log_n++;
    } else {
        H->log_full = 1;
    }
}

/* The hit of the layer's kind, when the ids are final; sets *device for a device layer's. */
static int try_hit(Holds *H, const char *topk, long layer, int *device) {
    DeviceLayer *dv = device_of(H, layer);
    LaneLayer *ly = lane_of(H, layer);
    *device = dv != NULL;
    if (!H->try_hits || topk == NULL) return ST_NOT_TRIED;
    if (dv != NULL) return device_try(H, topk, dv);
    return ly != NULL && layer_stop(H, layer) == STOP_TOPK ? lane_try(H, topk, ly) : ST_NOT_TRIED;
}

static int outcome(int rc, int device) {
    if (rc > 0) return device ? OUT_DEVICE_HIT_PYTHON : OUT_LANE_HIT_PYTHON;
    switch (rc) {
    case ST_LANE_MISSED: return OUT_LANE_MISS;
    case ST_DEVICE_MISSED: return OUT_DEVICE_MISS;
    case ST_NOT_TRIED: return OUT_NOT_TRIED;
    default: return OUT_FAILED;
    }
}

/* Hold the grant route_fn answered with (None: nothing), its experts mapped on a lane layer
 * (experts None: no mapping). 1, or with an error set 0 (a bad answer: a bug) or -1 (a
 * mapping failed; the grant is held). */
static int take_grant(Holds *H, long layer, PyObject *grant, PyObject *experts, PyObject *slots) {
    if (grant == Py_None) return 1;
    if (H->grant != NULL || H->cur_n || H->whole) {
        PyErr_SetString(PyExc_ValueError, "route_fn answered a grant while the layer holds hold one");
        return 0;
    }
    if (experts != Py_None && !listed(H, layer, experts, slots)) return 0;
    Py_INCREF(grant);
    H->grant = grant; /* held from now, before anything is mapped */
    if (experts == Py_None) return 1;
    uint64_t t0 = now_ns();
    int rc = map_listed(H, layer, experts, slots);
    H->show_ns += now_ns() - t0; /* Python's show no longer times it: the holds map it */
    return rc;
}

/* route_fn(topk, layer, rc, grant, ids), one crossing of `out`. Its answer: the graph goes on
 * (a bool), or (goes on, grant | None[, experts, slots]): the grant is the holds' from the
 * moment the call returns (no window with no owner); `may_map`: a lane layer's experts may be
 * mapped. After a mapping failed, Python hears it in one more call (MAP_FAILED). */
static bool call_python(Holds *H, const char *topk, long layer, int rc, int out, int may_map) {
    PyObject *grant = Py_None, *ids = Py_None;
    if (H->grant != NULL && !H->stopped && may_map) { /* (a mapping's failure keeps it here) */
        grant = H->grant; /* Python's now: the reference moves with it */
        H->grant = NULL;
    } else {
        Py_INCREF(grant);
    }
    if (H->n_ids >= 0) ids = PyBytes_FromStringAndSize((const char *)H->ids, (Py_ssize_t)H->n_ids * 4);
    else Py_INCREF(ids);
    PyObject *r = NULL;
    H->stops[out] += may_map; /* the stop once, however many calls it makes */
    H->to_python[out]++;
    if (ids != NULL) {
        H->in_stop = 1;
        H->stop_calls = 0;
        r = PyObject_CallFunction(H->route_fn, "KliOO", (unsigned long long)(uintptr_t)topk, layer, rc, grant, ids);
        H->in_stop = 0;
        H->from_python[out] += H->stop_calls;
        if (H->stop_calls > H->most_from_python[out]) H->most_from_python[out] = H->stop_calls;
    }
    Py_DECREF(grant);
    Py_XDECREF(ids);
    int taken = r != NULL;
    PyObject *go = r, *answered = Py_None, *experts = Py_None, *slots = Py_None;
    if (r != NULL && PyTuple_Check(r)) {
        taken = PyArg_ParseTuple(r, "OO|OO", &go, &answered, &experts, &slots);
        if (taken) taken = take_grant(H, layer, answered, may_map ? experts : Py_None, slots);
    }
    bool ok = taken > 0 && PyObject_IsTrue(go) == 1;
    Py_XDECREF(r);
    if (taken < 0) { /* the grant is held; Python hears why once more, and answers for the graph */
        PyErr_Clear();
        H->n_ids = -1;
        return call_python(H, topk, layer, ST_MAP_FAILED, out, 0);
    }
    if (!taken) PyErr_WriteUnraisable(H->route_fn); /* the Python side catches its own errors; a bug stops the graph */
    return ok;
}

/* One routed stop (the module comment), counted and timed under its outcome; the GIL is held
 * and the caller keeps H alive. */
static bool holds_stop(Holds *H, const char *node, long layer) {
    if (H->route_fn == NULL || !H->live) return false; /* freed: nobody may compute from these pages */
    uint64_t t0 = now_ns();
    const char *topk = stop_topk(H, node, layer_stop(H, layer));
    int device, out;
    bool ok = true;
    H->n_ids = -1;
    int rc = try_hit(H, topk, layer, &device);
    if (rc > 0 && H->alone && H->grant == NULL) {
        log_layer(H, layer, rc);
        out = device ? OUT_DEVICE_HIT : OUT_LANE_HIT;
        H->stops[out]++;
    } else {
        bool asks = rc == ST_LANE_MISSED || rc == ST_DEVICE_MISSED || rc == ST_NOT_TRIED;
        if (asks && !H->stopped && !let_go(H)) rc = ST_LOST; /* the earlier hit grant, let go before Python asks */
        out = outcome(rc, device);
        ok = call_python(H, topk, layer, rc, out, 1);
    }
    H->stop_ns[out] += now_ns() - t0;
    return ok;
}

/* ---- whole steps ---------------------------------------------------------- */

/* Every expert of lane layer `ly` READY at its entry's slot, and mapped there; 0: not so. */
static int lane_whole(Holds *H, LaneLayer *ly) {
    const uint64_t *table = (const uint64_t *)H->table.buf, *states = (const uint64_t *)ly->states.buf;
    size_t n_states = (size_t)(ly->states.len / 8);
    for (int64_t e = 0; e < H->n_experts; e++) {
        if (ly->row_base + e >= H->table.len / 8) return 0;
        uint64_t entry = __atomic_load_n(&table[ly->row_base + e], __ATOMIC_SEQ_CST);
        uint64_t slot = hp_entry_slot(entry);
        if (entry == 0 || slot >= n_states) return 0;
        if (__atomic_load_n(&states[slot], __ATOMIC_SEQ_CST) != hp_ready_state(hp_entry_gen(entry))) return 0;
        if (lane_map(H, ly, e, slot, 0) < 0) return 0;
    }
    return 1;
}

/* The engine's side of the whole-step protocol: cas the pin hold, then the pin word must
 * read 1 and the region be open (seq_cst loads after the cas: moed.protocol.residency_words
 * says why the daemon then sees the hold before any pinned slot may leave); then every
 * expert of every lane layer READY at its entry's slot, mapped there. Any doubt: let go. */
static int whole_core(Holds *H) {
    if (!H->live || !H->has_region || H->disabled || H->pin_word < 0 || H->cur_n || H->grant != NULL || H->whole)
        return 0;
    uint64_t *region = (uint64_t *)H->region.buf;
    const uint64_t *table = (const uint64_t *)H->table.buf;
    uint64_t expect = 0;
    if (!__atomic_compare_exchange_n(&region[HP_W_PIN_HOLD], &expect, (uint64_t)H->model_id + 1, 0,
                                     __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return 0; /* another engine of this connection has it */
    H->whole = 1;
    int ok = __atomic_load_n(&table[H->pin_word], __ATOMIC_SEQ_CST) == 1 &&
             __atomic_load_n(&region[HP_W_CLOSED], __ATOMIC_SEQ_CST) == 0;
    for (int i = 0; ok && i < MAX_LAYERS; i++)
        if (H->lanes[i] != NULL) ok = lane_whole(H, H->lanes[i]);
    if (!ok) {
        let_go(H);
        return 0;
    }
    H->whole_decodes++;
    return 1;
}

/* ---- the eval callback ------------------------------------------------------ */

typedef struct {
    PyObject *fn; /* fn(tensor) -> bool: the router-input stops (and the routed ones, with no holds) */
    size_t name_offset;
    int routed;       /* stop at the routed layers' stops (a benchmark turns them off) */
    int router_input; /* stop at the router's input too (while observing) */
    char router_input_prefix[PREFIX_MAX + 1];
    size_t router_input_len;
    PyObject *holds_obj; /* the capsule, referenced while set */
    Holds *holds;
} Callback;

enum { NODE_NONE, NODE_ROUTE, NODE_ROUTER_INPUT };

/* The layer number of `<prefix><digits>`, else -1. */
static long layer_after(const char *name, const char *prefix, size_t len) {
    if (strncmp(name, prefix, len) != 0) return -1;
    const char *s = name + len;
    if (*s == 0 || strlen(s) > 9) return -1;
    long n = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return -1;
        n = n * 10 + (*s - '0');
    }
    return n;
}

/* What `name` is to the callback: a routed layer's own stop (its layer in *layer), the
 * router's input, or nothing. */
static int wanted(const Callback *c, const char *name, long *layer) {
    if (c->routed && strncmp(name, "ffn_moe_", 8) == 0) {
        for (int kind = STOP_TOPK; kind <= STOP_WEIGHTS; kind++) {
            long n = layer_after(name, STOP_PREFIX[kind], strlen(STOP_PREFIX[kind]));
            if (n >= 0) {
                *layer = n;
                return layer_stop(c->holds, n) == kind ? NODE_ROUTE : NODE_NONE;
            }
        }
    }
    if (c->router_input && layer_after(name, c->router_input_prefix, c->router_input_len) >= 0)
        return NODE_ROUTER_INPUT;
    return NODE_NONE;
}

static bool call_fn(const Callback *c, void *tensor) {
    PyObject *r = PyObject_CallFunction(c->fn, "K", (unsigned long long)(uintptr_t)tensor);
    bool ok = false;
    if (r == NULL) {
        PyErr_WriteUnraisable(c->fn); /* the Python side catches its own errors; a bug stops the graph */
    } else {
        ok = PyObject_IsTrue(r) == 1;
        Py_DECREF(r);
    }
    return ok;
}

static bool eval_callback(void *tensor, bool ask, void *user_data) {
    const Callback *c = (const Callback *)user_data;
    Holds *H = c->holds;
    if (H != NULL && H->whole) return false; /* a whole step: ggml computes the graph in one piece */
    long layer = -1;
    int kind = wanted(c, (const char *)tensor + c->name_offset, &layer);
    if (kind == NODE_NONE) return false;
    if (ask) return true;
    PyGILState_STATE g = PyGILState_Ensure();
    bool ok;
    if (kind == NODE_ROUTE && H != NULL) {
        PyObject *keep = c->holds_obj; /* Python might drop the holds inside its call */
        Py_INCREF(keep);
        ok = holds_stop(H, (const char *)tensor, layer);
        Py_DECREF(keep);
    } else {
        ok = call_fn(c, tensor);
    }
    PyGILState_Release(g);
    return ok;
}

/* ---- the one argument parser: the object first, then the function's own arguments ---- */

static void *capsule_args(PyObject *args, const char *name, const char *fmt, va_list va) {
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1) {
        PyErr_Format(PyExc_TypeError, "the first argument must be a %s", name);
        return NULL;
    }
    void *p = PyCapsule_GetPointer(PyTuple_GET_ITEM(args, 0), name);
    if (p == NULL) return NULL;
    PyObject *rest = PyTuple_GetSlice(args, 1, PyTuple_GET_SIZE(args));
    if (rest == NULL) return NULL;
    int ok = PyArg_VaParse(rest, fmt, va);
    Py_DECREF(rest);
    return ok ? p : NULL;
}

enum { ANY, LIVE };

/* The holds of args[0] (counted against the stop under way, if any; LIVE: not freed), the rest
 * of args parsed by `fmt` into the pointers that follow. NULL with an error set. */
static Holds *holds_args(PyObject *args, int live, const char *fmt, ...) {
    va_list va;
    va_start(va, fmt);
    Holds *H = capsule_args(args, HOLDS_CAPSULE, fmt, va);
    va_end(va);
    if (H == NULL) return NULL;
    if (H->in_stop) H->stop_calls++;
    if (live == LIVE && !H->live) {
        PyErr_SetString(PyExc_ValueError, "the layer holds were freed");
        return NULL;
    }
    return H;
}

static Callback *callback_args(PyObject *args, const char *fmt, ...) {
    va_list va;
    va_start(va, fmt);
    Callback *c = capsule_args(args, CALLBACK_CAPSULE, fmt, va);
    va_end(va);
    return c;
}

/* ---- the eval callback's Python interface ------------------------------------ */

static void callback_free(PyObject *capsule) {
    Callback *c = (Callback *)PyCapsule_GetPointer(capsule, CALLBACK_CAPSULE);
    if (c != NULL) {
        Py_XDECREF(c->fn);
        Py_XDECREF(c->holds_obj);
        PyMem_Free(c);
    }
}

/* callback_new(fn, name_offset) -> handle */
static PyObject *callback_new(PyObject *self, PyObject *args) {
    PyObject *fn; Py_ssize_t off;
    if (!PyArg_ParseTuple(args, "On", &fn, &off)) return NULL;
    if (!PyCallable_Check(fn) || off < 0 || off > 4096) {
        PyErr_SetString(PyExc_ValueError, "need a callable and a name offset inside struct ggml_tensor");
        return NULL;
    }
    Callback *c = PyMem_Calloc(1, sizeof(Callback)); /* every field not set below starts 0 (no holds) */
    if (c == NULL) return PyErr_NoMemory();
    Py_INCREF(fn);
    c->fn = fn;
    c->name_offset = (size_t)off;
    c->routed = 1;
    strcpy(c->router_input_prefix, "ffn_norm-");
    c->router_input_len = strlen(c->router_input_prefix);
    PyObject *cap = PyCapsule_New(c, CALLBACK_CAPSULE, callback_free);
    if (cap == NULL) { Py_DECREF(fn); PyMem_Free(c); }
    return cap;
}

/* callback_router_input(handle, on[, prefix]): also stop at <prefix><n>; the prefix stays until changed. */
static PyObject *callback_router_input(PyObject *self, PyObject *args) {
    int on; const char *prefix = NULL; Py_ssize_t len = 0;
    Callback *c = callback_args(args, "p|y#", &on, &prefix, &len);
    if (c == NULL) return NULL;
    if (prefix != NULL) {
        if (len < 1 || len > PREFIX_MAX || memchr(prefix, 0, (size_t)len) != NULL) {
            PyErr_SetString(PyExc_ValueError, "a node prefix must be 1..47 bytes with no NUL");
            return NULL;
        }
        memcpy(c->router_input_prefix, prefix, (size_t)len);
        c->router_input_prefix[len] = 0;
        c->router_input_len = (size_t)len;
    }
    c->router_input = on;
    Py_RETURN_NONE;
}

/* callback_routed(handle, on): stop at the routed layers' stops (on by default). */
static PyObject *callback_routed(PyObject *self, PyObject *args) {
    int on;
    Callback *c = callback_args(args, "p", &on);
    if (c == NULL) return NULL;
    c->routed = on;
    Py_RETURN_NONE;
}

/* callback_holds(handle, holds | None): the routed stops go to these holds. */
static PyObject *callback_holds(PyObject *self, PyObject *args) {
    PyObject *hobj;
    Callback *c = callback_args(args, "O", &hobj);
    if (c == NULL) return NULL;
    Holds *H = NULL;
    if (hobj != Py_None && (H = PyCapsule_GetPointer(hobj, HOLDS_CAPSULE)) == NULL) return NULL;
    Py_XINCREF(hobj == Py_None ? NULL : hobj);
    Py_XDECREF(c->holds_obj);
    c->holds_obj = hobj == Py_None ? NULL : hobj;
    c->holds = H;
    Py_RETURN_NONE;
}

static PyObject *callback_user_data(PyObject *self, PyObject *args) {
    Callback *c = callback_args(args, "");
    return c == NULL ? NULL : PyLong_FromVoidPtr(c);
}

static PyObject *callback_address(PyObject *self, PyObject *noargs) {
    return PyLong_FromVoidPtr((void *)eval_callback);
}

/* ---- the holds' Python interface: made, given layers ---------------------------- */

static void release_buffers(Holds *H) {
    if (!H->live) return;
    H->live = 0;
    for (int i = 0; i < MAX_LAYERS; i++) {
        LaneLayer *ly = H->lanes[i];
        DeviceLayer *dv = H->devices[i];
        if (ly != NULL) {
            PyBuffer_Release(&ly->states);
            PyMem_Free(ly->placed);
            PyMem_Free(ly);
            H->lanes[i] = NULL;
        }
        if (dv != NULL) {
            PyBuffer_Release(&dv->slot_of_expert); PyBuffer_Release(&dv->expert_of_slot);
            PyBuffer_Release(&dv->last_use); PyBuffer_Release(&dv->clock);
            PyMem_Free(dv);
            H->devices[i] = NULL;
        }
    }
    if (H->has_region) {
        PyBuffer_Release(&H->region);
        PyBuffer_Release(&H->table);
    }
}

static void free_arrays(Holds *H) {
    PyMem_Free(H->holds[0]); PyMem_Free(H->holds[1]);
    PyMem_Free(H->mark); PyMem_Free(H->experts); PyMem_Free(H->rows); PyMem_Free(H->slots);
    PyMem_Free(H->ids); PyMem_Free(H->slot_ids);
}

static void holds_capsule_free(PyObject *capsule) {
    Holds *H = (Holds *)PyCapsule_GetPointer(capsule, HOLDS_CAPSULE);
    if (H == NULL) return;
    release_buffers(H);
    Py_XDECREF(H->route_fn);
    Py_XDECREF(H->grant);
    free_arrays(H);
    PyMem_Free(H);
}

/* The region's hold indexes into H->holds (two sets of half each); 0 with nothing set: not the
 * region's hold words. */
static int take_indexes(Holds *H, PyObject *holds, Py_ssize_t half) {
    for (Py_ssize_t i = 0; i < 2 * half; i++) {
        Py_ssize_t h = PyLong_AsSsize_t(PyList_GET_ITEM(holds, i));
        if (PyErr_Occurred()) { PyErr_Clear(); return 0; }
        if (h < HP_HOLD_BASE || h >= HP_HOLD_BASE + HP_HOLD_WORDS) return 0;
        H->holds[i / half][i % half] = h;
    }
    return 1;
}

/* The region and table (both, or neither: no hits); -1 with an error set. */
static int take_region(Holds *H, PyObject *robj, PyObject *tobj, PyObject *holds, Py_ssize_t half) {
    if (robj == Py_None) return 0;
    if (PyObject_GetBuffer(robj, &H->region, PyBUF_WRITABLE) < 0) return -1;
    if (PyObject_GetBuffer(tobj, &H->table, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&H->region); return -1; }
    H->has_region = 1;
    int ok = (uintptr_t)H->region.buf % 8 == 0 && (uintptr_t)H->table.buf % 8 == 0 &&
             H->region.len / 8 >= HP_REGION_WORDS && H->counter_word < H->region.len / 8 &&
             take_indexes(H, holds, half);
    if (ok) return 0;
    PyBuffer_Release(&H->region); PyBuffer_Release(&H->table);
    H->has_region = 0;
    PyErr_SetString(PyExc_ValueError, "not a hold region and table, or a hold index outside its hold words");
    return -1;
}

/* new(route_fn, region | None, table | None, n_experts, hold_indexes, counter_word,
 *     (name, type, buffer, ne, nb, src, data)) -> holds
 * Without a region (local hits off, or no lane layers) no lane hit is tried. */
static PyObject *holds_new(PyObject *self, PyObject *args) {
    PyObject *fn, *robj, *tobj, *holds; Py_ssize_t n_experts, counter;
    NodeLayout at;
    if (!PyArg_ParseTuple(args, "OOOnOn(nnnnnnn)", &fn, &robj, &tobj, &n_experts, &holds, &counter, &at.name,
                          &at.type, &at.buffer, &at.ne, &at.nb, &at.src, &at.data))
        return NULL;
    if (!PyCallable_Check(fn) || !PyList_Check(holds) || PyList_GET_SIZE(holds) % 2 || n_experts < 1 ||
        n_experts > 65536) {
        PyErr_SetString(PyExc_ValueError, "need a route callable, an even list of hold indexes and 1..65536 experts");
        return NULL;
    }
    if ((robj == Py_None) != (tobj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "a region and a table, or neither");
        return NULL;
    }
    Holds *H = PyMem_Calloc(1, sizeof(Holds));
    if (H == NULL) return PyErr_NoMemory();
    Py_ssize_t half = PyList_GET_SIZE(holds) / 2;
    H->set_size = half; H->n_experts = n_experts; H->counter_word = counter; H->pin_word = -1; H->at = at;
    H->holds[0] = PyMem_Calloc((size_t)(half ? half : 1), sizeof(int64_t));
    H->holds[1] = PyMem_Calloc((size_t)(half ? half : 1), sizeof(int64_t));
    H->mark = PyMem_Calloc((size_t)n_experts, 1);
    H->experts = PyMem_Calloc((size_t)n_experts, sizeof(int64_t));
    H->rows = PyMem_Calloc((size_t)n_experts, sizeof(int64_t));
    H->slots = PyMem_Calloc((size_t)n_experts, sizeof(uint64_t));
    if (!H->holds[0] || !H->holds[1] || !H->mark || !H->experts || !H->rows || !H->slots) {
        PyErr_NoMemory();
        goto fail;
    }
    if (take_region(H, robj, tobj, holds, half) < 0) goto fail;
    Py_INCREF(fn);
    H->route_fn = fn;
    H->live = 1;
    PyObject *cap = PyCapsule_New(H, HOLDS_CAPSULE, holds_capsule_free);
    if (cap == NULL) { release_buffers(H); Py_DECREF(fn); goto fail; }
    return cap;
fail:
    free_arrays(H);
    PyMem_Free(H);
    return NULL;
}

/* One part's (addr, bytes, part_off, part_stride), page-aligned, into ly's part p; 0 with an error set. */
static int lane_part(LaneLayer *ly, int p, PyObject *part) {
    unsigned long long addr, bytes, off, stride;
    if (!PyArg_ParseTuple(part, "KKKK", &addr, &bytes, &off, &stride)) return 0;
    if (addr % 4096 || bytes % 4096 || off % 4096 || stride % 4096 || bytes == 0) {
        PyErr_SetString(PyExc_ValueError, "parts must be page-aligned (zero copy)");
        return 0;
    }
    ly->addr[p] = (uintptr_t)addr; ly->bytes[p] = (size_t)bytes;
    ly->part_off[p] = off; ly->part_stride[p] = stride;
    return 1;
}

/* lane_layer(holds, layer, row_base, class_id, states | None, fd, [(addr, bytes, part_off, part_stride)]) */
static PyObject *holds_lane_layer(PyObject *self, PyObject *args) {
    PyObject *sobj, *parts; Py_ssize_t layer, row_base; unsigned long long class_id; int fd;
    Holds *H = holds_args(args, LIVE, "nnKOiO", &layer, &row_base, &class_id, &sobj, &fd, &parts);
    if (H == NULL) return NULL;
    if (layer < 0 || layer >= MAX_LAYERS || H->lanes[layer] != NULL || H->devices[layer] != NULL ||
        !PyList_Check(parts) || PyList_GET_SIZE(parts) < 1 || PyList_GET_SIZE(parts) > MAX_PARTS || row_base < 0 ||
        fd < 0 || (H->has_region && sobj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "a new layer 0..4095, 1..4 parts, a row base, an fd and its states");
        return NULL;
    }
    LaneLayer *ly = PyMem_Calloc(1, sizeof(LaneLayer));
    if (ly == NULL || (ly->placed = PyMem_Malloc((size_t)H->n_experts * sizeof(int64_t))) == NULL) {
        PyMem_Free(ly);
        return PyErr_NoMemory();
    }
    for (int64_t e = 0; e < H->n_experts; e++) ly->placed[e] = -1;
    ly->row_base = row_base; ly->class_id = class_id; ly->fd = fd;
    ly->n_parts = (int)PyList_GET_SIZE(parts);
    int ok = 1;
    for (int p = 0; ok && p < ly->n_parts; p++) ok = lane_part(ly, p, PyList_GET_ITEM(parts, p));
    /* states.obj stays NULL without a region: PyBuffer_Release then does nothing */
    if (ok && sobj != Py_None) {
        ok = PyObject_GetBuffer(sobj, &ly->states, PyBUF_SIMPLE) == 0;
        if (ok && (uintptr_t)ly->states.buf % 8) {
            PyBuffer_Release(&ly->states);
            PyErr_SetString(PyExc_ValueError, "states not 8-byte aligned");
            ok = 0;
        }
    }
    if (!ok) {
        PyMem_Free(ly->placed); PyMem_Free(ly);
        return NULL;
    }
    H->lanes[layer] = ly;
    Py_RETURN_NONE;
}

/* A writable C-contiguous integer array of `n` items of `size` bytes (n < 0: any count >= 1). */
static int int_array(PyObject *obj, Py_buffer *view, Py_ssize_t size, Py_ssize_t n, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
        const char *f = view->format ? view->format : "B";
        char code = f[strlen(f) - 1];
        if (view->itemsize == size && strchr("ilq", code) != NULL && (uintptr_t)view->buf % (size_t)size == 0 &&
            (n < 0 ? view->len >= size : view->len == n * size))
            return 0;
        PyBuffer_Release(view);
    }
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s must be a writable, C-contiguous int%zd array (of %zd)", what, size * 8, n);
    return -1;
}

/* device_layer(holds, layer, slot_of_expert, expert_of_slot, last_use, clock): the layer's device
 * LRU (the module comment); its stop becomes the routing weights. */
static PyObject *holds_device_layer(PyObject *self, PyObject *args) {
    PyObject *a, *b, *c, *d; Py_ssize_t layer;
    Holds *H = holds_args(args, LIVE, "nOOOO", &layer, &a, &b, &c, &d);
    if (H == NULL) return NULL;
    if (layer < 0 || layer >= MAX_LAYERS || H->lanes[layer] != NULL || H->devices[layer] != NULL) {
        PyErr_Format(PyExc_ValueError, "layer %zd: a new layer 0..4095 that is not a lane layer", layer);
        return NULL;
    }
    DeviceLayer *dv = PyMem_Calloc(1, sizeof(DeviceLayer));
    if (dv == NULL) return PyErr_NoMemory();
    if (int_array(a, &dv->slot_of_expert, 4, H->n_experts, "slot_of_expert") < 0) goto fail0;
    if (int_array(b, &dv->expert_of_slot, 4, -1, "expert_of_slot") < 0) goto fail1;
    dv->n_slots = dv->expert_of_slot.len / 4;
    if (int_array(c, &dv->last_use, 8, dv->n_slots, "last_use") < 0) goto fail2;
    if (int_array(d, &dv->clock, 8, 2, "clock") < 0) goto fail3;
    H->devices[layer] = dv;
    H->stop[layer] = STOP_WEIGHTS;
    Py_RETURN_NONE;
fail3:
    PyBuffer_Release(&dv->last_use);
fail2:
    PyBuffer_Release(&dv->expert_of_slot);
fail1:
    PyBuffer_Release(&dv->slot_of_expert);
fail0:
    PyMem_Free(dv);
    return NULL;
}

/* stop_at(holds, layer, weights): the layer's stop is its routing weights (True) or its top-k. */
static PyObject *holds_stop_at(PyObject *self, PyObject *args) {
    Py_ssize_t layer; int weights;
    Holds *H = holds_args(args, LIVE, "np", &layer, &weights);
    if (H == NULL) return NULL;
    if (layer < 0 || layer >= MAX_LAYERS || (weights ? H->lanes[layer] != NULL : H->devices[layer] != NULL)) {
        PyErr_Format(PyExc_ValueError, "layer %zd: 0..4095, a lane layer stops at its top-k, a device layer at its weights",
                     layer);
        return NULL;
    }
    H->stop[layer] = weights ? STOP_WEIGHTS : STOP_TOPK;
    Py_RETURN_NONE;
}

/* backend(holds, tensor_get_2d, tensor_set_2d, buffer_is_host): ggml-base's functions, by address. */
static PyObject *holds_backend(PyObject *self, PyObject *args) {
    unsigned long long get, set, is_host;
    Holds *H = holds_args(args, LIVE, "KKK", &get, &set, &is_host);
    if (H == NULL) return NULL;
    if (!get || !set || !is_host) {
        PyErr_SetString(PyExc_ValueError, "ggml's backend functions, all three");
        return NULL;
    }
    H->get_2d = (TensorGet2d)(uintptr_t)get;
    H->set_2d = (TensorSet2d)(uintptr_t)set;
    H->is_host = (BufferIsHost)(uintptr_t)is_host;
    Py_RETURN_NONE;
}

/* ---- the holds' Python interface: a decode ------------------------------------ */

/* begin(holds, try_hits, alone, log): a decode's path choice. try_hits: the ids are final at
 * the stop (no hook, no substitution), so the holds try the layer's hit before Python sees
 * it; alone: nothing for Python at a stop either (a hit is the whole layer); log: keep the
 * layers done alone for take_log (cleared). */
static PyObject *holds_begin(PyObject *self, PyObject *args) {
    int try_hits, alone, logging;
    Holds *H = holds_args(args, LIVE, "ppp", &try_hits, &alone, &logging);
    if (H == NULL) return NULL;
    H->try_hits = try_hits; H->alone = try_hits && alone; H->stopped = 0;
    H->logging = logging; H->log_n = 0; H->log_used = 0; H->log_full = 0;
    Py_RETURN_NONE;
}

/* place(holds, layer, expert, slot[, populate]): map outside a decode (warm); populate maps it
 * again, page-table entries made now, so its first use in a matmul takes no fault. */
static PyObject *holds_place(PyObject *self, PyObject *args) {
    Py_ssize_t layer, expert; unsigned long long slot; int populate = 0;
    Holds *H = holds_args(args, LIVE, "nnK|p", &layer, &expert, &slot, &populate);
    if (H == NULL) return NULL;
    LaneLayer *ly = lane_of(H, layer);
    if (ly == NULL || expert < 0 || expert >= H->n_experts) {
        PyErr_Format(PyExc_ValueError, "layer %zd expert %zd is not a lane layer's", layer, expert);
        return NULL;
    }
    uint64_t t0 = now_ns();
    int rc = lane_map(H, ly, expert, slot, populate);
    H->show_ns += now_ns() - t0;
    if (rc < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong(rc);
}

/* forget(holds): every lane layer's addresses were remapped behind the holds' back (zeros after
 * a failed decode under an offload, then PROT_NONE): map each expert again at its next use. */
static PyObject *holds_forget(PyObject *self, PyObject *args) {
    Holds *H = holds_args(args, LIVE, "");
    if (H == NULL) return NULL;
    for (int i = 0; i < MAX_LAYERS; i++)
        if (H->lanes[i] != NULL)
            for (int64_t e = 0; e < H->n_experts; e++) H->lanes[i]->placed[e] = -1;
    Py_RETURN_NONE;
}

/* fail(holds): the decode failed; no hit is tried and no grant passed until end. */
static PyObject *holds_fail(PyObject *self, PyObject *args) {
    Holds *H = holds_args(args, ANY, "");
    if (H == NULL) return NULL;
    H->try_hits = 0; H->alone = 0; H->stopped = 1;
    Py_RETURN_NONE;
}

/* The Python grant held, given back (a new reference; None when none). */
static PyObject *give_grant(Holds *H) {
    PyObject *grant = H->grant != NULL ? H->grant : Py_None;
    if (H->grant == NULL) Py_INCREF(grant);
    H->grant = NULL;
    return grant;
}

/* end(holds) -> (grant | None, hit_ok): after a decode, the hit grant let go (hit_ok False: it
 * was lost) and the Python grant given back for Python to let go. */
static PyObject *holds_end(PyObject *self, PyObject *args) {
    Holds *H = holds_args(args, ANY, "");
    if (H == NULL) return NULL;
    int ok = H->live ? let_go(H) : 1;
    H->try_hits = 0; H->alone = 0; H->stopped = 0;
    return Py_BuildValue("(NO)", give_grant(H), ok ? Py_True : Py_False);
}

/* held(holds) -> None | ("hit", n) | ("grant", grant) | ("pin", model_id) */
static PyObject *holds_held(PyObject *self, PyObject *args) {
    Holds *H = holds_args(args, ANY, "");
    if (H == NULL) return NULL;
    if (H->cur_n) return Py_BuildValue("(sn)", "hit", H->cur_n);
    if (H->grant != NULL) return Py_BuildValue("(sO)", "grant", H->grant);
    if (H->whole) return Py_BuildValue("(sL)", "pin", (long long)H->model_id);
    Py_RETURN_NONE;
}

/* disable(holds): no more lane hits (the connection is closing); freed holds take it too. */
static PyObject *holds_disable(PyObject *self, PyObject *args) {
    Holds *H = holds_args(args, ANY, "");
    if (H == NULL) return NULL;
    H->disabled = 1;
    Py_RETURN_NONE;
}

/* take_log(holds) -> ([(layer, [experts]), ...], full): the log since the last take, emptied. */
static PyObject *holds_take_log(PyObject *self, PyObject *args) {
    Holds *H = holds_args(args, LIVE, "");
    if (H == NULL) return NULL;
    PyObject *out = PyList_New(H->log_n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < H->log_n; i++) {
        Py_ssize_t a = H->log_start[i], b = i + 1 < H->log_n ? H->log_start[i + 1] : H->log_used;
        PyObject *ex = PyList_New(b - a);
        if (ex == NULL) { Py_DECREF(out); return NULL; }
        for (Py_ssize_t j = a; j < b; j++) PyList_SET_ITEM(ex, j - a, PyLong_FromLong(H->log_experts[j]));
        PyObject *item = Py_BuildValue("(iN)", H->log_layer[i], ex);
        if (item == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, item);
    }
    PyObject *res = Py_BuildValue("(NO)", out, H->log_full ? Py_True : Py_False);
    H->log_n = 0; H->log_used = 0; H->log_full = 0;
    return res;
}

/* free(holds) -> grant | None: let the hit grant and the pin hold go and release the buffers
 * now; a Python grant still held is given back (for Python to let go). */
static PyObject *holds_free(PyObject *self, PyObject *args) {
    Holds *H = holds_args(args, ANY, "");
    if (H == NULL) return NULL;
    if (H->live) let_go(H);
    release_buffers(H);
    Py_CLEAR(H->route_fn); /* the streamer's bound method: no cycle outlives the model */
    return give_grant(H);
}

/* ---- whole steps' interface ------------------------------------------------ */

/* pins(holds, model_id, pin_word): whole steps become possible (pin_word: a table word). */
static PyObject *holds_pins(PyObject *self, PyObject *args) {
    Py_ssize_t model_id, pin_word;
    Holds *H = holds_args(args, LIVE, "nn", &model_id, &pin_word);
    if (H == NULL) return NULL;
    if (!H->has_region || model_id < 0 || pin_word < 0 || pin_word >= H->table.len / 8) {
        PyErr_SetString(PyExc_ValueError, "whole steps need a region, a model id and a pin word inside the table");
        return NULL;
    }
    H->model_id = model_id; H->pin_word = pin_word;
    Py_RETURN_NONE;
}

static PyObject *holds_whole_begin(PyObject *self, PyObject *args) {
    Holds *H = holds_args(args, LIVE, "");
    if (H == NULL) return NULL;
    errno = 0;
    int ok = whole_core(H);
    if (!ok && errno) return PyErr_SetFromErrno(PyExc_OSError); /* a mapping failed: not a plain no */
    return PyBool_FromLong(ok);
}

/* whole_end(holds, uses): the pin hold let go; `uses` added to the model's local-hit counter. */
static PyObject *holds_whole_end(PyObject *self, PyObject *args) {
    unsigned long long uses;
    Holds *H = holds_args(args, ANY, "K", &uses);
    if (H == NULL) return NULL;
    if (!H->live || !H->whole) Py_RETURN_NONE;
    let_go(H);
    hp_count((uint64_t *)H->region.buf, H->counter_word, uses);
    Py_RETURN_NONE;
}

/* ---- counters ----------------------------------------------------------------- */

static PyObject *holds_stats(PyObject *self, PyObject *args) {
    Holds *H = holds_args(args, ANY, "");
    if (H == NULL) return NULL;
    return Py_BuildValue("{sKsKsKsKsKsKsKsisKsKsK}", "layers", H->n_layers, "experts", H->n_experts_acq,
                         "acquire_ns", H->acquire_ns, "show_ns", H->show_ns, "maps", H->maps, "misses", H->misses,
                         "whole_decodes", H->whole_decodes, "map_errno", H->map_errno, "device_layers",
                         H->device_layers, "device_experts", H->device_experts, "device_ns", H->device_ns);
}

/* crossings(holds) -> {outcome: (stops, to_python, from_python, most_from_python, ns)} */
static PyObject *holds_crossings(PyObject *self, PyObject *args) {
    Holds *H = holds_args(args, ANY, "");
    if (H == NULL) return NULL;
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    for (int i = 0; i < N_OUT; i++) {
        PyObject *v = Py_BuildValue("(KKKKK)", H->stops[i], H->to_python[i], H->from_python[i],
                                    H->most_from_python[i], H->stop_ns[i]);
        if (v == NULL || PyDict_SetItemString(out, OUT_NAMES[i], v) < 0) { Py_XDECREF(v); Py_DECREF(out); return NULL; }
        Py_DECREF(v);
    }
    return out;
}

/* layer_ns(holds, layer): ns in the layer's hits taken here (lane or device). */
static PyObject *holds_layer_ns(PyObject *self, PyObject *args) {
    Py_ssize_t layer;
    Holds *H = holds_args(args, LIVE, "n", &layer);
    if (H == NULL) return NULL;
    LaneLayer *ly = lane_of(H, layer);
    DeviceLayer *dv = device_of(H, layer);
    return PyLong_FromUnsignedLongLong(ly ? ly->ns : dv ? dv->ns : 0);
}

static PyMethodDef methods[] = {
    {"callback_new", callback_new, METH_VARARGS, "callback_new(fn, name_offset) -> handle"},
    {"callback_router_input", callback_router_input, METH_VARARGS,
     "callback_router_input(handle, on[, prefix]): also stop at the router's input <prefix><n> (ffn_norm-<n>)"},
    {"callback_routed", callback_routed, METH_VARARGS, "callback_routed(handle, on): stop at the routed layers' stops"},
    {"callback_holds", callback_holds, METH_VARARGS, "callback_holds(handle, holds | None): the routed stops' holds"},
    {"callback_user_data", callback_user_data, METH_VARARGS, "the cb_eval_user_data pointer for a handle"},
    {"callback_address", callback_address, METH_NOARGS, "the address of the C eval callback"},
    {"new", holds_new, METH_VARARGS, "the layer holds of a model (a hold region and table, or none)"},
    {"lane_layer", holds_lane_layer, METH_VARARGS, "give the holds a lane layer (relaxed zero copy)"},
    {"device_layer", holds_device_layer, METH_VARARGS, "give the holds a device layer's LRU arrays"},
    {"stop_at", holds_stop_at, METH_VARARGS, "stop_at(holds, layer, weights): the layer's stop node"},
    {"backend", holds_backend, METH_VARARGS, "backend(holds, get_2d, set_2d, is_host): ggml's backend calls"},
    {"begin", holds_begin, METH_VARARGS, "begin(holds, try_hits, alone, log): a decode's path choice"},
    {"place", holds_place, METH_VARARGS, "map an expert's slot at its addresses if it changed (outside a decode)"},
    {"forget", holds_forget, METH_VARARGS, "the lane layers' addresses were remapped: map each again at its use"},
    {"fail", holds_fail, METH_VARARGS, "the decode failed: no hit, no grant passed until end"},
    {"end", holds_end, METH_VARARGS, "after a decode: (the grant given back | None, the hit grant was not lost)"},
    {"held", holds_held, METH_VARARGS, "what the holds hold now, or None"},
    {"disable", holds_disable, METH_VARARGS, "no more lane hits (the connection is closing)"},
    {"free", holds_free, METH_VARARGS, "let everything go and release the buffers now; the grant given back"},
    {"stats", holds_stats, METH_VARARGS, "the hits' counters"},
    {"crossings", holds_crossings, METH_VARARGS, "calls across C and Python per routed stop, by outcome"},
    {"take_log", holds_take_log, METH_VARARGS, "the layers done alone since the last take, and whether the log filled"},
    {"layer_ns", holds_layer_ns, METH_VARARGS, "ns in one layer's hits"},
    {"pins", holds_pins, METH_VARARGS, "pins(holds, model_id, pin_word): whole steps possible"},
    {"whole_begin", holds_whole_begin, METH_VARARGS, "take the pin hold and check every expert; True: whole"},
    {"whole_end", holds_whole_end, METH_VARARGS, "let the pin hold go, counting `uses` local hits"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "moed.engines._layer_holds",
    "The layer holds: a streamed model's routed stops in C, and the eval callback that feeds them.", -1, methods};

PyMODINIT_FUNC PyInit__layer_holds(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "NOT_TRIED", ST_NOT_TRIED) < 0 || PyModule_AddIntConstant(m, "LOST", ST_LOST) < 0 ||
        PyModule_AddIntConstant(m, "MAP_FAILED", ST_MAP_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "LANE_MISSED", ST_LANE_MISSED) < 0 ||
        PyModule_AddIntConstant(m, "DEVICE_MISSED", ST_DEVICE_MISSED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject *names = PyTuple_New(N_OUT);
    if (names == NULL) { Py_DECREF(m); return NULL; }
    for (int i = 0; i < N_OUT; i++) PyTuple_SET_ITEM(names, i, PyUnicode_FromString(OUT_NAMES[i]));
    if (PyModule_AddObject(m, "OUTCOMES", names) < 0) { Py_DECREF(names); Py_DECREF(m); return NULL; }
    return m;
}
