/* llama.cpp's eval callback with the "ask" pass in C, and the layer holds.
 *
 * ggml's scheduler calls the eval callback twice for the nodes it cares about:
 * once with ask=true for EVERY node of the graph ("do you want this one?"), and
 * once with ask=false for those the answer was yes to, after computing them. A
 * Python callback pays a ctypes transition and a name read on each of the ~500
 * ask calls a token makes on a 16-layer MoE; here the ask pass is a prefix
 * compare in C, and only the wanted nodes (each routed layer's stop,
 * `ffn_moe_topk-<n>`, and the router's input while observing: moed.gguf.archs.RouterInput)
 * reach the layer holds or Python, with the GIL taken for the call.
 *
 *   handle = make(fn, name_offset)   # fn(tensor_address) -> bool: the router-input stops (and the
 *                                    # routed ones of a handle with no layer holds)
 *   set_router_input(handle, on[, prefix])  # also stop at the router's input <prefix><n>; the
 *                                    # prefix stays until changed (b"ffn_norm-"; gpt-oss:
 *                                    # b"attn_post_norm-")
 *   set_route(handle, prefix)        # the routed layer's stop: b"ffn_moe_topk-" (default), or
 *                                    # b"ffn_moe_weights-" for device expert slots (its ids are
 *                                    # rewritten after the routing weights were gathered)
 *   set_holds(handle, holds | None)  # the routed stops go to these layer holds
 *   callback_address(), user_data(handle): what goes into llama_context_params
 * The handle owns a reference to fn and to the holds and must outlive the context.
 *
 * THE LAYER HOLDS: the one owner of what a streamed model's routed layers hold. At
 * any time it holds at most one of three things:
 *   - its own hit grant (a layer's hit taken here: hold words in the connection's
 *     region, moed/_hitproto.h, the same steps as moed._holds);
 *   - a Python grant it was handed (`holds_hold`: what Python acquired from moed);
 *   - the whole step's pin hold (every expert pinned: no per-layer stop at all).
 * It chooses each routed stop's path and lets go of what it held. Every streamed
 * model has one, lane layers or not, local hits or not.
 *
 * A routed stop (the GIL held):
 *   1. When the ids are final (no route hook or substitution may change them: the
 *      per-decode `try_hits` Python sets in `holds_begin`) and the layer is a lane
 *      layer (relaxed zero copy, mapped by the holds alone), the holds take the hit:
 *      read the top-k ids through the node's strides, hp_hit, release the earlier
 *      hit grant, leave the touches and the counter, and map every expert whose slot
 *      changed (MAP_FIXED of the daemon's read-only memfd). A hit with nothing for
 *      Python this step (`alone`: no look-ahead, observer or trace at the stop) and
 *      no Python grant to let go is the whole layer: C only, a few microseconds
 *      (between two layers' callbacks the matmuls stream tens of MB of weights, so
 *      the callback runs with cold caches, and a Python acquire and show cost
 *      115 us a layer where a warm loop says 22: bench/RESULTS.md, issue 22).
 *   2. Otherwise exactly one call into Python: route_fn(tensor, layer, status, grant):
 *        status > 0      HIT: this many experts held by the holds' hit grant; Python only
 *                        scores and prefetches (and lets `grant` go);
 *        MISSED (-4)     the hit was tried and missed: Python asks the daemon, with no
 *                        second try (one hp_hit a layer);
 *        NOT_TRIED (-1)  not a lane layer, the ids not final, odd ids, no region:
 *                        Python tries the source's hit, then acquires on a miss;
 *        LOST (-2), MAP_FAILED (-3): an earlier hit grant was lost, a mapping failed;
 *      `grant` is the Python grant held until now (None if none): Python lets it go,
 *      piggybacked on its acquire. On MISSED and NOT_TRIED the holds' own hit grant
 *      is released first, before Python asks the daemon. Python then hands its grant
 *      back with ONE call, `holds_hold`, which records it as held and maps its
 *      experts on a lane layer. A missed layer: one call C->Python, one Python->C.
 *   3. A Python grant is let go by Python: at the next stop (passed to it) or after
 *      the decode (`holds_end` gives it back). After a failure (`holds_fail`) no hit
 *      is tried and no grant is passed until `holds_end`.
 * The holds count their crossings by the stop's outcome (alone, hit, missed,
 * not_tried, failed): stops, calls into Python, calls from Python during the stop,
 * and the most calls from Python at one stop (`holds_crossings`).
 *
 * Under a GPU offload the top-k may sit in device memory, which these raw-pointer
 * reads cannot see. The holds do not read the device's top-k themselves
 * (ggml_backend_tensor_get): an offloaded model gets layer holds with no lane layers
 * and no region, so every routed stop is NOT_TRIED and goes through Python, which
 * reads the top-k through ggml's backend API (moed.engines.ggml_tensor) and acquires
 * after the source's hit; the holds still own the grant and its release. The device
 * slots (moed.engines.device_slots) build on that: their stop is the routing weights.
 *
 *   holds = holds_new(route_fn, region | None, table | None, n_experts, hold_indexes,
 *                     counter_word, tensor_layout)
 *   holds_layer(holds, layer, row_base, class_id, states, fd, [(addr, bytes, part_off, part_stride)])
 *   holds_begin(holds, try_hits, alone, log)       a decode's path choice
 *   holds_hold(holds, grant[, layer, experts, slots]) -> None   the grant held (mapped on a lane layer)
 *   holds_fail(holds)                              the decode failed: nothing more until end
 *   holds_end(holds) -> (grant | None, hit_ok)     the hit grant let go, the grant given back
 *   holds_place(holds, layer, expert, slot[, populate]) -> bool   map outside a decode (warm)
 *   holds_held(holds) -> None | ("hit", n) | ("grant", grant) | ("pin", model_id)
 *   holds_disable(holds), holds_free(holds) -> grant | None
 *   holds_stats(holds), holds_crossings(holds), holds_layer_ns(holds, layer), holds_map_errno(holds)
 *   holds_take_log(holds) -> ([(layer, [experts])], full): the layers done alone, while logging
 *
 * Whole steps: when every expert of the model is pinned (the table's pin word reads 1),
 * a decode needs no per-layer stop at all. holds_whole_begin takes the region's pin hold
 * (moed.protocol.residency_words: one word that keeps every pinned slot of the model),
 * checks every expert is READY at the slot its addresses show (mapping those that are
 * not), and while it is held the ask pass answers no to every node, so ggml computes the
 * graph in one piece as it does with no callback; holds_whole_end lets the hold go.
 *
 *   holds_pins(holds, model_id, pin_word)   the model's id and its table's pin word
 *   holds_whole_begin(holds) -> bool        True: the pin hold is taken, every expert mapped
 *   holds_whole_end(holds, uses)            the pin hold let go; `uses` counted as local hits
 *
 * One owner for each thing the holds touch: they alone map the addresses of their lane
 * layers (Python's path maps them through holds_hold, warm through holds_place); their
 * hold indexes were handed to them by the client's region and are their own; the ring's
 * head is the region's word, which every recorder writes holding the GIL (the holds
 * always run holding it). A hit tried on anything but a plain hit (a revoked or
 * disabled region, an id out of range) changes nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "_hitproto.h"

#define PREFIX_MAX 47 /* a ggml name is at most 63 bytes; the prefix leaves room for digits */

#define LANE_MAX_PARTS 4
#define LANE_MAX_LAYERS 4096
/* A routed stop's status, as route_fn is given it (> 0: a hit of that many experts). */
#define ST_NOT_TRIED (-1)
#define ST_LOST (-2)
#define ST_MAP_FAILED (-3)
#define ST_MISSED (-4)
#define LANE_LOG_LAYERS 1024
#define LANE_LOG_EXPERTS 16384

/* The outcomes a routed stop's crossings are counted by. */
enum { OUT_ALONE, OUT_HIT, OUT_MISSED, OUT_NOT_TRIED, OUT_FAILED, N_OUT };
static const char *const OUT_NAMES[N_OUT] = {"alone", "hit", "missed", "not_tried", "failed"};

typedef struct {
    int64_t row_base;
    uint64_t class_id;
    Py_buffer states;
    int fd;
    int n_parts;
    uintptr_t addr[LANE_MAX_PARTS]; /* expert 0's address of each part */
    size_t bytes[LANE_MAX_PARTS];
    uint64_t part_off[LANE_MAX_PARTS], part_stride[LANE_MAX_PARTS];
    int64_t *placed; /* slot mapped at each expert's addresses, -1: none (PROT_NONE) */
    uint64_t ns;     /* time in this layer's hits */
} LaneLayer;

typedef struct {
    int live;
    int has_region;
    PyObject *route_fn; /* route_fn(tensor, layer, status, grant | None) -> bool */
    Py_buffer region, table;
    int64_t n_experts;
    int64_t counter_word;
    size_t name_off, type_off, ne_off, nb_off, data_off;
    /* ---- what is held: at most one of the three ---- */
    int64_t *holds[2]; /* two sets of hold indexes: the hit grant held, and the next */
    Py_ssize_t set_size;
    int cur_set;        /* the set the held hit grant uses */
    Py_ssize_t cur_n;   /* experts in the held hit grant (0: none) */
    LaneLayer *cur;     /* its layer */
    PyObject *grant;    /* a Python grant handed by holds_hold (NULL: none) */
    int whole;          /* the region's pin hold is ours: a whole step is under way */
    /* ---- the decode's path choice (holds_begin) ---- */
    int try_hits, alone, stopped, disabled;
    int64_t model_id, pin_word; /* pin_word < 0: no whole steps (holds_pins not called) */
    uint64_t whole_decodes; /* whole steps taken (holds_whole_end) */
    int map_errno; /* the last mapping's errno (ST_MAP_FAILED) */
    LaneLayer *layers[LANE_MAX_LAYERS];
    unsigned char *mark;
    int64_t *experts, *rows;
    uint64_t *slots;
    uint64_t n_layers, n_experts_acq, acquire_ns, show_ns, maps, misses;
    /* ---- crossings, by a stop's outcome ---- */
    int in_stop;          /* inside route_fn: calls from Python count against the stop */
    uint64_t stop_calls;  /* calls from Python during the stop under way */
    uint64_t stops[N_OUT], to_python[N_OUT], from_python[N_OUT], most_from_python[N_OUT];
    /* While logging: the (layer, experts) of every layer done alone, for the engine's cache
     * estimate (holds_take_log); a full log drops the rest and says so. */
    int logging, log_full;
    Py_ssize_t log_n, log_used;
    int32_t log_layer[LANE_LOG_LAYERS];
    Py_ssize_t log_start[LANE_LOG_LAYERS + 1];
    int32_t log_experts[LANE_LOG_EXPERTS];
} Holds;

typedef struct {
    PyObject *fn;
    size_t name_offset;
    int router_input; /* stop at the router's input too (while observing) */
    char router_input_prefix[PREFIX_MAX + 1];
    size_t router_input_len;
    char route_prefix[PREFIX_MAX + 1];
    size_t route_len;
    int route_topk;       /* the routed stop is the top-k node itself (the holds may read its ids) */
    PyObject *holds_obj;  /* the capsule, referenced while set */
    Holds *holds;
} Config;

enum { NODE_NONE, NODE_ROUTE, NODE_ROUTER_INPUT };

static int digits_to_end(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return 0;
    return 1;
}

static int wanted(const Config *c, const char *name) {
    if (strncmp(name, c->route_prefix, c->route_len) == 0)
        return digits_to_end(name + c->route_len) ? NODE_ROUTE : NODE_NONE;
    if (c->router_input && strncmp(name, c->router_input_prefix, c->router_input_len) == 0)
        return digits_to_end(name + c->router_input_len) ? NODE_ROUTER_INPUT : NODE_NONE;
    return NODE_NONE;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

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

/* Release the held hit grant, if any; 0: it was lost (a slot refilled while held). */
static int drop_hit(Holds *H) {
    int ok = 1;
    if (H->cur_n)
        ok = hp_release((const uint64_t *)H->cur->states.buf, (size_t)(H->cur->states.len / 8),
                        (uint64_t *)H->region.buf, H->holds[H->cur_set], (size_t)H->cur_n);
    H->cur_n = 0; H->cur = NULL;
    return ok;
}

/* The hit of a lane layer at its top-k node (the module comment, step 1): experts held
 * (> 0), ST_MISSED, ST_NOT_TRIED (nothing changed), ST_LOST (the hit is held; the earlier
 * hit grant was lost) or ST_MAP_FAILED (held; map_errno says why). The GIL is held. */
static int lane_try(Holds *H, const char *tensor, long layer) {
    if (!H->live || !H->has_region || H->disabled) return ST_NOT_TRIED;
    LaneLayer *ly = layer >= 0 && layer < LANE_MAX_LAYERS ? H->layers[layer] : NULL;
    if (ly == NULL || *(const int *)(tensor + H->type_off) != 26 /* GGML_TYPE_I32 */) return ST_NOT_TRIED;
    const int64_t *ne = (const int64_t *)(tensor + H->ne_off);
    const size_t *nb = (const size_t *)(tensor + H->nb_off);
    const char *data = *(const char *const *)(tensor + H->data_off);
    int64_t n = H->n_experts, m = 0;
    int bad = 0;
    for (int64_t t = 0; t < ne[1]; t++)
        for (int64_t j = 0; j < ne[0]; j++) {
            int32_t id = *(const int32_t *)(data + t * nb[1] + j * nb[0]);
            if (id >= n) bad = 1;
            else if (id >= 0) H->mark[id] = 1;
        }
    for (int64_t e = 0; e < n; e++)
        if (H->mark[e]) { H->mark[e] = 0; H->experts[m++] = e; } /* ascending, as np.unique */
    if (bad || m == 0 || m > H->set_size) return ST_NOT_TRIED;
    uint64_t t0 = now_ns();
    const uint64_t *table = (const uint64_t *)H->table.buf;
    Py_ssize_t n_table = H->table.len / 8;
    for (int64_t j = 0; j < m; j++) {
        H->rows[j] = ly->row_base + H->experts[j];
        if (H->rows[j] >= n_table) return ST_NOT_TRIED;
    }
    uint64_t *region = (uint64_t *)H->region.buf;
    int next = H->cur_n ? 1 - H->cur_set : H->cur_set;
    int rc = hp_hit(table, H->rows, (size_t)m, (const uint64_t *)ly->states.buf, (size_t)(ly->states.len / 8),
                    region, H->holds[next], ly->class_id, H->slots);
    if (rc != HP_HIT) { H->misses++; return ST_MISSED; }
    int lost = 0;
    if (H->cur_n)
        lost = !hp_release((const uint64_t *)H->cur->states.buf, (size_t)(H->cur->states.len / 8), region,
                           H->holds[H->cur_set], (size_t)H->cur_n);
    H->cur_set = next; H->cur_n = m; H->cur = ly;
    hp_record(region, ly->class_id, H->slots, (size_t)m, H->counter_word);
    uint64_t t1 = now_ns();
    for (int64_t j = 0; j < m; j++)
        if (lane_map(H, ly, H->experts[j], H->slots[j], 0) < 0) { H->map_errno = errno; return ST_MAP_FAILED; }
    uint64_t t2 = now_ns();
    H->n_layers++; H->n_experts_acq += (uint64_t)m;
    H->acquire_ns += t1 - t0; H->show_ns += t2 - t1; ly->ns += t1 - t0;
    return lost ? ST_LOST : (int)m;
}

/* The layer just taken (H->experts[0..m)) into the log, while logging. */
static void log_layer(Holds *H, long layer, int64_t m) {
    if (!H->logging) return;
    if (H->log_n < LANE_LOG_LAYERS && H->log_used + m <= LANE_LOG_EXPERTS) {
        H->log_layer[H->log_n] = (int32_t)layer;
        H->log_start[H->log_n] = H->log_used;
        for (int64_t j = 0; j < m; j++) H->log_experts[H->log_used++] = (int32_t)H->experts[j];
        H->log_n++;
    } else {
        H->log_full = 1;
    }
}

/* One routed stop (the module comment); the GIL is held and the caller keeps H alive. */
static bool holds_stop(Holds *H, const char *tensor, long layer, int topk) {
    if (H->route_fn == NULL) return false; /* freed: nobody may compute from these pages */
    int rc = ST_NOT_TRIED;
    if (H->try_hits && topk) {
        rc = lane_try(H, tensor, layer);
        if (rc > 0 && H->alone && H->grant == NULL) {
            log_layer(H, layer, rc);
            H->stops[OUT_ALONE]++;
            return true;
        }
    }
    if ((rc == ST_MISSED || rc == ST_NOT_TRIED) && !H->stopped && H->live && !drop_hit(H))
        rc = ST_LOST; /* the earlier hit grant, let go before Python asks the daemon */
    int out = rc > 0 ? OUT_HIT : rc == ST_MISSED ? OUT_MISSED : rc == ST_NOT_TRIED ? OUT_NOT_TRIED : OUT_FAILED;
    PyObject *grant = Py_None;
    if (H->grant != NULL && !H->stopped) {
        grant = H->grant; /* Python's to let go now: the reference moves with it */
        H->grant = NULL;
    } else {
        Py_INCREF(grant);
    }
    H->stops[out]++;
    H->to_python[out]++;
    H->in_stop = 1;
    H->stop_calls = 0;
    PyObject *r = PyObject_CallFunction(H->route_fn, "KliO", (unsigned long long)(uintptr_t)tensor, layer, rc, grant);
    H->in_stop = 0;
    H->from_python[out] += H->stop_calls;
    if (H->stop_calls > H->most_from_python[out]) H->most_from_python[out] = H->stop_calls;
    Py_DECREF(grant);
    bool ok = false;
    if (r == NULL) {
        PyErr_WriteUnraisable(H->route_fn); /* the Python side catches its own errors; a bug stops the graph */
    } else {
        ok = PyObject_IsTrue(r) == 1;
        Py_DECREF(r);
    }
    return ok;
}

/* The layer number after a matched prefix (digits only, checked by `wanted`). */
static long stop_layer(const char *digits) {
    errno = 0;
    long n = strtol(digits, NULL, 10);
    return errno ? -1 : n;
}

static bool eval_callback(void *tensor, bool ask, void *user_data) {
    const Config *c = (const Config *)user_data;
    Holds *H = c->holds;
    if (H != NULL && H->whole) return false; /* a whole step: ggml computes the graph in one piece */
    const char *name = (const char *)tensor + c->name_offset;
    int kind = wanted(c, name);
    if (kind == NODE_NONE) return false;
    if (ask) return true;
    PyGILState_STATE g = PyGILState_Ensure();
    bool ok = false;
    if (kind == NODE_ROUTE && H != NULL) {
        PyObject *keep = c->holds_obj; /* Python might drop the holds inside its call */
        Py_INCREF(keep);
        ok = holds_stop(H, (const char *)tensor, stop_layer(name + c->route_len), c->route_topk);
        Py_DECREF(keep);
        PyGILState_Release(g);
        return ok;
    }
    PyObject *r = PyObject_CallFunction(c->fn, "K", (unsigned long long)(uintptr_t)tensor);
    if (r == NULL) {
        PyErr_WriteUnraisable(c->fn); /* the Python side catches its own errors; a bug stops the graph */
    } else {
        ok = PyObject_IsTrue(r) == 1;
        Py_DECREF(r);
    }
    PyGILState_Release(g);
    return ok;
}

static void config_free(PyObject *capsule) {
    Config *c = (Config *)PyCapsule_GetPointer(capsule, "moed.evalcb");
    if (c != NULL) {
        Py_XDECREF(c->fn);
        Py_XDECREF(c->holds_obj);
        PyMem_Free(c);
    }
}

static PyObject *make(PyObject *self, PyObject *args) {
    PyObject *fn; Py_ssize_t off;
    if (!PyArg_ParseTuple(args, "On", &fn, &off)) return NULL;
    if (!PyCallable_Check(fn) || off < 0 || off > 4096) {
        PyErr_SetString(PyExc_ValueError, "need a callable and a name offset inside struct ggml_tensor");
        return NULL;
    }
    Config *c = PyMem_Calloc(1, sizeof(Config)); /* every field not set below starts 0 (no holds) */
    if (c == NULL) return PyErr_NoMemory();
    Py_INCREF(fn);
    c->fn = fn;
    c->name_offset = (size_t)off;
    strcpy(c->router_input_prefix, "ffn_norm-");
    c->router_input_len = strlen(c->router_input_prefix);
    strcpy(c->route_prefix, "ffn_moe_topk-");
    c->route_len = strlen(c->route_prefix);
    c->route_topk = 1;
    PyObject *cap = PyCapsule_New(c, "moed.evalcb", config_free);
    if (cap == NULL) { Py_DECREF(fn); PyMem_Free(c); }
    return cap;
}

static Config *config_of(PyObject *cap) {
    return (Config *)PyCapsule_GetPointer(cap, "moed.evalcb");
}

/* Copy a 1..47-byte prefix with no NUL into `dst`; -1 with ValueError set otherwise. */
static int set_prefix(char *dst, size_t *len_out, const char *prefix, Py_ssize_t len) {
    if (len < 1 || len > PREFIX_MAX || memchr(prefix, 0, (size_t)len) != NULL) {
        PyErr_SetString(PyExc_ValueError, "a node prefix must be 1..47 bytes with no NUL");
        return -1;
    }
    memcpy(dst, prefix, (size_t)len);
    dst[len] = 0;
    *len_out = (size_t)len;
    return 0;
}

static PyObject *set_router_input(PyObject *self, PyObject *args) {
    PyObject *cap; int on; const char *prefix = NULL; Py_ssize_t len = 0;
    if (!PyArg_ParseTuple(args, "Op|y#", &cap, &on, &prefix, &len)) return NULL;
    Config *c = config_of(cap);
    if (c == NULL) return NULL;
    if (prefix != NULL && set_prefix(c->router_input_prefix, &c->router_input_len, prefix, len) < 0) return NULL;
    c->router_input = on;
    Py_RETURN_NONE;
}

static PyObject *set_route(PyObject *self, PyObject *args) {
    PyObject *cap; const char *prefix; Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Oy#", &cap, &prefix, &len)) return NULL;
    Config *c = config_of(cap);
    if (c == NULL) return NULL;
    if (set_prefix(c->route_prefix, &c->route_len, prefix, len) < 0) return NULL;
    c->route_topk = strcmp(c->route_prefix, "ffn_moe_topk-") == 0;
    Py_RETURN_NONE;
}

static PyObject *user_data(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Config *c = config_of(cap);
    if (c == NULL) return NULL;
    return PyLong_FromVoidPtr(c);
}

static PyObject *callback_address(PyObject *self, PyObject *noargs) {
    return PyLong_FromVoidPtr((void *)eval_callback);
}


/* ---- the layer holds' Python interface ---------------------------------- */

static void holds_release_buffers(Holds *H) {
    if (!H->live) return;
    H->live = 0;
    for (int i = 0; i < LANE_MAX_LAYERS; i++) {
        LaneLayer *ly = H->layers[i];
        if (ly == NULL) continue;
        PyBuffer_Release(&ly->states);
        PyMem_Free(ly->placed);
        PyMem_Free(ly);
        H->layers[i] = NULL;
    }
    if (H->has_region) {
        PyBuffer_Release(&H->region);
        PyBuffer_Release(&H->table);
    }
}

static void holds_capsule_free(PyObject *capsule) {
    Holds *H = (Holds *)PyCapsule_GetPointer(capsule, "moed.holds");
    if (H == NULL) return;
    holds_release_buffers(H);
    Py_XDECREF(H->route_fn);
    Py_XDECREF(H->grant);
    PyMem_Free(H->holds[0]); PyMem_Free(H->holds[1]);
    PyMem_Free(H->mark); PyMem_Free(H->experts); PyMem_Free(H->rows); PyMem_Free(H->slots);
    PyMem_Free(H);
}

/* The holds of a capsule; a call from Python inside a stop counts against it. */
static Holds *holds_any(PyObject *cap) {
    Holds *H = (Holds *)PyCapsule_GetPointer(cap, "moed.holds");
    if (H != NULL && H->in_stop) H->stop_calls++;
    return H;
}

/* The same, live (not freed). */
static Holds *holds_of(PyObject *cap) {
    Holds *H = holds_any(cap);
    if (H != NULL && !H->live) {
        PyErr_SetString(PyExc_ValueError, "the layer holds were freed");
        return NULL;
    }
    return H;
}

/* holds_new(route_fn, region | None, table | None, n_experts, hold_indexes, counter_word,
 *           (name_off, type_off, ne_off, nb_off, data_off)) -> holds
 * Without a region (local hits off, or no lane layers) no hit is tried: every stop is Python's. */
static PyObject *holds_new(PyObject *self, PyObject *args) {
    PyObject *fn, *robj, *tobj, *holds; Py_ssize_t n_experts, counter;
    Py_ssize_t name_off, type_off, ne_off, nb_off, data_off;
    if (!PyArg_ParseTuple(args, "OOOnOn(nnnnn)", &fn, &robj, &tobj, &n_experts, &holds, &counter, &name_off,
                          &type_off, &ne_off, &nb_off, &data_off))
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
    H->set_size = half;
    H->n_experts = n_experts;
    H->counter_word = counter;
    H->pin_word = -1;
    H->name_off = (size_t)name_off; H->type_off = (size_t)type_off; H->ne_off = (size_t)ne_off;
    H->nb_off = (size_t)nb_off; H->data_off = (size_t)data_off;
    H->holds[0] = PyMem_Calloc((size_t)(half ? half : 1), sizeof(int64_t));
    H->holds[1] = PyMem_Calloc((size_t)(half ? half : 1), sizeof(int64_t));
    H->mark = PyMem_Calloc((size_t)n_experts, 1);
    H->experts = PyMem_Calloc((size_t)n_experts, sizeof(int64_t));
    H->rows = PyMem_Calloc((size_t)n_experts, sizeof(int64_t));
    H->slots = PyMem_Calloc((size_t)n_experts, sizeof(uint64_t));
    PyObject *cap = NULL;
    if (!H->holds[0] || !H->holds[1] || !H->mark || !H->experts || !H->rows || !H->slots) {
        PyErr_NoMemory();
        goto fail;
    }
    if (robj != Py_None) {
        if (PyObject_GetBuffer(robj, &H->region, PyBUF_WRITABLE) < 0) goto fail;
        if (PyObject_GetBuffer(tobj, &H->table, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&H->region); goto fail; }
        H->has_region = 1;
        Py_ssize_t words = H->region.len / 8;
        int ok = ((uintptr_t)H->region.buf % 8 == 0) && ((uintptr_t)H->table.buf % 8 == 0) &&
                 words >= HP_REGION_WORDS && counter < words;
        for (Py_ssize_t i = 0; ok && i < 2 * half; i++) {
            Py_ssize_t h = PyLong_AsSsize_t(PyList_GET_ITEM(holds, i));
            if (PyErr_Occurred()) { PyErr_Clear(); ok = 0; break; }
            if (h < HP_HOLD_BASE || h >= HP_HOLD_BASE + HP_HOLD_WORDS) ok = 0; /* the region's hold words */
            H->holds[i / half][i % half] = h;
        }
        if (!ok) {
            PyBuffer_Release(&H->region); PyBuffer_Release(&H->table);
            H->has_region = 0;
            PyErr_SetString(PyExc_ValueError, "not a hold region and table, or a hold index outside its hold words");
            goto fail;
        }
    }
    Py_INCREF(fn);
    H->route_fn = fn;
    H->live = 1;
    cap = PyCapsule_New(H, "moed.holds", holds_capsule_free);
    if (cap == NULL) { holds_release_buffers(H); Py_DECREF(fn); goto fail; }
    return cap;
fail:
    PyMem_Free(H->holds[0]); PyMem_Free(H->holds[1]);
    PyMem_Free(H->mark); PyMem_Free(H->experts); PyMem_Free(H->rows); PyMem_Free(H->slots);
    PyMem_Free(H);
    return NULL;
}

/* holds_layer(holds, layer, row_base, class_id, states | None, fd, [(addr, bytes, part_off, part_stride), ...]) */
static PyObject *holds_layer(PyObject *self, PyObject *args) {
    PyObject *cap, *sobj, *parts; Py_ssize_t layer, row_base; unsigned long long class_id; int fd;
    if (!PyArg_ParseTuple(args, "OnnKOiO", &cap, &layer, &row_base, &class_id, &sobj, &fd, &parts)) return NULL;
    Holds *H = holds_of(cap);
    if (H == NULL) return NULL;
    if (layer < 0 || layer >= LANE_MAX_LAYERS || H->layers[layer] != NULL || !PyList_Check(parts) ||
        PyList_GET_SIZE(parts) < 1 || PyList_GET_SIZE(parts) > LANE_MAX_PARTS || row_base < 0 || fd < 0 ||
        (H->has_region && sobj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "a new layer 0..4095, 1..4 parts, a row base, an fd and its states");
        return NULL;
    }
    LaneLayer *ly = PyMem_Calloc(1, sizeof(LaneLayer));
    if (ly == NULL) return PyErr_NoMemory();
    ly->placed = PyMem_Malloc((size_t)H->n_experts * sizeof(int64_t));
    if (ly->placed == NULL) { PyMem_Free(ly); return PyErr_NoMemory(); }
    for (int64_t e = 0; e < H->n_experts; e++) ly->placed[e] = -1;
    ly->row_base = row_base; ly->class_id = class_id; ly->fd = fd;
    ly->n_parts = (int)PyList_GET_SIZE(parts);
    for (int p = 0; p < ly->n_parts; p++) {
        unsigned long long addr, bytes, off, stride;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(parts, p), "KKKK", &addr, &bytes, &off, &stride) || addr % 4096 ||
            bytes % 4096 || off % 4096 || stride % 4096 || bytes == 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "parts must be page-aligned (zero copy)");
            PyMem_Free(ly->placed); PyMem_Free(ly);
            return NULL;
        }
        ly->addr[p] = (uintptr_t)addr; ly->bytes[p] = (size_t)bytes;
        ly->part_off[p] = off; ly->part_stride[p] = stride;
    }
    /* states.obj stays NULL without a region: PyBuffer_Release then does nothing */
    if (sobj != Py_None) {
        if (PyObject_GetBuffer(sobj, &ly->states, PyBUF_SIMPLE) < 0 || (uintptr_t)ly->states.buf % 8) {
            if (!PyErr_Occurred()) {
                PyBuffer_Release(&ly->states);
                PyErr_SetString(PyExc_ValueError, "states not 8-byte aligned");
            }
            PyMem_Free(ly->placed); PyMem_Free(ly);
            return NULL;
        }
    }
    H->layers[layer] = ly;
    Py_RETURN_NONE;
}

/* holds_begin(holds, try_hits, alone, log): a decode's path choice. try_hits: the ids are
 * final at the stop (no hook, no substitution), so the holds try a lane layer's hit before
 * Python sees it; alone: nothing for Python at a stop either (a hit is the whole layer);
 * log: keep the layers done alone for take_log (cleared). */
static PyObject *holds_begin(PyObject *self, PyObject *args) {
    PyObject *cap; int try_hits, alone, logging;
    if (!PyArg_ParseTuple(args, "Oppp", &cap, &try_hits, &alone, &logging)) return NULL;
    Holds *H = holds_of(cap);
    if (H == NULL) return NULL;
    H->try_hits = try_hits; H->alone = try_hits && alone; H->stopped = 0;
    H->logging = logging; H->log_n = 0; H->log_used = 0; H->log_full = 0;
    Py_RETURN_NONE;
}

/* holds_hold(holds, grant[, layer, experts, slots]): `grant` is held now (Python's acquire);
 * with a layer, its experts are mapped at `slots` (a lane layer: the holds map it). */
static PyObject *holds_hold(PyObject *self, PyObject *args) {
    PyObject *cap, *grant, *experts = Py_None, *slots = Py_None; Py_ssize_t layer = -1;
    if (!PyArg_ParseTuple(args, "OO|nOO", &cap, &grant, &layer, &experts, &slots)) return NULL;
    Holds *H = holds_of(cap);
    if (H == NULL) return NULL;
    if (H->grant != NULL || H->cur_n || H->whole || grant == Py_None) {
        PyErr_SetString(PyExc_ValueError, "the layer holds hold something already (or no grant was given)");
        return NULL;
    }
    LaneLayer *ly = NULL;
    Py_ssize_t n = 0;
    if (layer >= 0) {
        ly = layer < LANE_MAX_LAYERS ? H->layers[layer] : NULL;
        if (ly == NULL || !PyList_Check(experts) || !PyList_Check(slots) ||
            (n = PyList_GET_SIZE(experts)) != PyList_GET_SIZE(slots)) {
            PyErr_Format(PyExc_ValueError, "layer %zd is not a lane layer, or experts and slots differ", layer);
            return NULL;
        }
    }
    Py_INCREF(grant);
    H->grant = grant; /* held before anything is mapped: a failure below still lets it go at the end */
    /* (Python times this call as its show: not added to show_ns, which would count it twice) */
    for (Py_ssize_t j = 0; j < n; j++) {
        long long e = PyLong_AsLongLong(PyList_GET_ITEM(experts, j));
        unsigned long long s = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(slots, j));
        if (PyErr_Occurred()) return NULL;
        if (e < 0 || e >= H->n_experts) {
            PyErr_Format(PyExc_ValueError, "expert %lld out of range", e);
            return NULL;
        }
        if (lane_map(H, ly, (int64_t)e, (uint64_t)s, 0) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* holds_place(holds, layer, expert, slot[, populate]): map outside a decode (warm); populate
 * maps it again, page-table entries made now, so its first use in a matmul takes no fault. */
static PyObject *holds_place(PyObject *self, PyObject *args) {
    PyObject *cap; Py_ssize_t layer, expert; unsigned long long slot; int populate = 0;
    if (!PyArg_ParseTuple(args, "OnnK|p", &cap, &layer, &expert, &slot, &populate)) return NULL;
    Holds *H = holds_of(cap);
    if (H == NULL) return NULL;
    LaneLayer *ly = layer >= 0 && layer < LANE_MAX_LAYERS ? H->layers[layer] : NULL;
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

/* holds_fail(holds): the decode failed; no hit is tried and no grant passed until holds_end. */
static PyObject *holds_fail(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Holds *H = holds_any(cap);
    if (H == NULL) return NULL;
    H->try_hits = 0; H->alone = 0; H->stopped = 1;
    Py_RETURN_NONE;
}

/* holds_end(holds) -> (grant | None, hit_ok): after a decode, the hit grant let go (hit_ok
 * False: it was lost) and the Python grant given back for Python to let go. */
static PyObject *holds_end(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Holds *H = holds_any(cap);
    if (H == NULL) return NULL;
    int ok = H->live ? drop_hit(H) : 1;
    H->try_hits = 0; H->alone = 0; H->stopped = 0;
    PyObject *grant = H->grant != NULL ? H->grant : Py_None;
    if (H->grant == NULL) Py_INCREF(grant);
    H->grant = NULL;
    return Py_BuildValue("(NO)", grant, ok ? Py_True : Py_False);
}

/* holds_held(holds) -> None | ("hit", n) | ("grant", grant) | ("pin", model_id) */
static PyObject *holds_held(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Holds *H = holds_any(cap);
    if (H == NULL) return NULL;
    if (H->cur_n) return Py_BuildValue("(sn)", "hit", H->cur_n);
    if (H->grant != NULL) return Py_BuildValue("(sO)", "grant", H->grant);
    if (H->whole) return Py_BuildValue("(sL)", "pin", (long long)H->model_id);
    Py_RETURN_NONE;
}

/* Let the pin hold go (after the step's reads: ggml's threads are joined, so they came first). */
static void pin_release(Holds *H) {
    if (!H->whole) return;
    H->whole = 0;
    __atomic_store_n(&((uint64_t *)H->region.buf)[HP_W_PIN_HOLD], 0, __ATOMIC_SEQ_CST);
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
    Py_ssize_t n_table = H->table.len / 8;
    uint64_t expect = 0;
    if (!__atomic_compare_exchange_n(&region[HP_W_PIN_HOLD], &expect, (uint64_t)H->model_id + 1, 0,
                                     __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return 0; /* another engine of this connection has it */
    H->whole = 1;
    if (__atomic_load_n(&table[H->pin_word], __ATOMIC_SEQ_CST) != 1 ||
        __atomic_load_n(&region[HP_W_CLOSED], __ATOMIC_SEQ_CST) != 0)
        goto fail;
    for (int i = 0; i < LANE_MAX_LAYERS; i++) {
        LaneLayer *ly = H->layers[i];
        if (ly == NULL) continue;
        const uint64_t *states = (const uint64_t *)ly->states.buf;
        size_t n_states = (size_t)(ly->states.len / 8);
        for (int64_t e = 0; e < H->n_experts; e++) {
            if (ly->row_base + e >= n_table) goto fail;
            uint64_t entry = __atomic_load_n(&table[ly->row_base + e], __ATOMIC_SEQ_CST);
            uint64_t slot = hp_entry_slot(entry);
            if (entry == 0 || slot >= n_states) goto fail;
            if (__atomic_load_n(&states[slot], __ATOMIC_SEQ_CST) != hp_ready_state(hp_entry_gen(entry))) goto fail;
            if (lane_map(H, ly, e, slot, 0) < 0) goto fail;
        }
    }
    H->whole_decodes++;
    return 1;
fail:
    pin_release(H);
    return 0;
}

static PyObject *holds_disable(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Holds *H = holds_any(cap); /* freed holds take it too: a no-op */
    if (H == NULL) return NULL;
    H->disabled = 1;
    Py_RETURN_NONE;
}

/* holds_take_log(holds) -> ([(layer, [experts]), ...], full): the log since the last take, emptied. */
static PyObject *holds_take_log(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Holds *H = holds_of(cap);
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

/* holds_free(holds) -> grant | None: let the hit grant and the pin hold go and release the
 * buffers now; a Python grant still held is given back (for Python to let go). */
static PyObject *holds_free(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Holds *H = holds_any(cap);
    if (H == NULL) return NULL;
    if (H->live) { drop_hit(H); pin_release(H); }
    holds_release_buffers(H);
    PyObject *grant = H->grant != NULL ? H->grant : Py_None;
    if (H->grant == NULL) Py_INCREF(grant);
    H->grant = NULL;
    Py_CLEAR(H->route_fn); /* the streamer's bound method: no cycle outlives the model */
    return grant;
}

/* holds_pins(holds, model_id, pin_word): whole steps become possible (pin_word: a table word). */
static PyObject *holds_pins(PyObject *self, PyObject *args) {
    PyObject *cap; Py_ssize_t model_id, pin_word;
    if (!PyArg_ParseTuple(args, "Onn", &cap, &model_id, &pin_word)) return NULL;
    Holds *H = holds_of(cap);
    if (H == NULL) return NULL;
    if (!H->has_region || model_id < 0 || pin_word < 0 || pin_word >= H->table.len / 8) {
        PyErr_SetString(PyExc_ValueError, "whole steps need a region, a model id and a pin word inside the table");
        return NULL;
    }
    H->model_id = model_id; H->pin_word = pin_word;
    Py_RETURN_NONE;
}

static PyObject *holds_whole_begin(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Holds *H = holds_of(cap);
    if (H == NULL) return NULL;
    errno = 0;
    int ok = whole_core(H);
    if (!ok && errno) return PyErr_SetFromErrno(PyExc_OSError); /* a mapping failed: not a plain no */
    return PyBool_FromLong(ok);
}

/* holds_whole_end(holds, uses): the pin hold let go; `uses` added to the model's local-hit counter. */
static PyObject *holds_whole_end(PyObject *self, PyObject *args) {
    PyObject *cap; unsigned long long uses;
    if (!PyArg_ParseTuple(args, "OK", &cap, &uses)) return NULL;
    Holds *H = holds_any(cap);
    if (H == NULL) return NULL;
    if (!H->live || !H->whole) Py_RETURN_NONE;
    pin_release(H);
    hp_count((uint64_t *)H->region.buf, H->counter_word, uses);
    Py_RETURN_NONE;
}

static PyObject *holds_stats(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Holds *H = holds_any(cap);
    if (H == NULL) return NULL;
    return Py_BuildValue("{sKsKsKsKsKsKsKsi}", "layers", H->n_layers, "experts", H->n_experts_acq, "acquire_ns",
                         H->acquire_ns, "show_ns", H->show_ns, "maps", H->maps, "misses", H->misses, "whole_decodes",
                         H->whole_decodes, "map_errno", H->map_errno);
}

/* holds_crossings(holds) -> {outcome: (stops, to_python, from_python, most_from_python)} */
static PyObject *holds_crossings(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Holds *H = holds_any(cap);
    if (H == NULL) return NULL;
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    for (int i = 0; i < N_OUT; i++) {
        PyObject *v = Py_BuildValue("(KKKK)", H->stops[i], H->to_python[i], H->from_python[i], H->most_from_python[i]);
        if (v == NULL || PyDict_SetItemString(out, OUT_NAMES[i], v) < 0) { Py_XDECREF(v); Py_DECREF(out); return NULL; }
        Py_DECREF(v);
    }
    return out;
}

static PyObject *holds_layer_ns(PyObject *self, PyObject *args) {
    PyObject *cap; Py_ssize_t layer;
    if (!PyArg_ParseTuple(args, "On", &cap, &layer)) return NULL;
    Holds *H = holds_of(cap);
    if (H == NULL) return NULL;
    LaneLayer *ly = layer >= 0 && layer < LANE_MAX_LAYERS ? H->layers[layer] : NULL;
    return PyLong_FromUnsignedLongLong(ly ? ly->ns : 0);
}

/* set_holds(handle, holds | None) */
static PyObject *set_holds(PyObject *self, PyObject *args) {
    PyObject *cap, *hobj;
    if (!PyArg_ParseTuple(args, "OO", &cap, &hobj)) return NULL;
    Config *c = config_of(cap);
    if (c == NULL) return NULL;
    Holds *H = NULL;
    if (hobj != Py_None && (H = holds_of(hobj)) == NULL) return NULL;
    Py_XINCREF(hobj == Py_None ? NULL : hobj);
    Py_XDECREF(c->holds_obj);
    c->holds_obj = hobj == Py_None ? NULL : hobj;
    c->holds = H;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS, "make(fn, name_offset) -> handle"},
    {"set_router_input", set_router_input, METH_VARARGS,
     "set_router_input(handle, on[, prefix]): also stop at the router's input <prefix><n> (ffn_norm-<n>)"},
    {"set_route", set_route, METH_VARARGS, "set_route(handle, prefix): the routed layer's stop (b'ffn_moe_topk-')"},
    {"set_holds", set_holds, METH_VARARGS, "set_holds(handle, holds | None): the routed stops go to the layer holds"},
    {"user_data", user_data, METH_VARARGS, "the cb_eval_user_data pointer for a handle"},
    {"callback_address", callback_address, METH_NOARGS, "the address of the C eval callback"},
    {"holds_new", holds_new, METH_VARARGS, "the layer holds of a model (a hold region and table, or none)"},
    {"holds_layer", holds_layer, METH_VARARGS, "give the holds a lane layer (relaxed zero copy)"},
    {"holds_begin", holds_begin, METH_VARARGS, "holds_begin(holds, try_hits, alone, log): a decode's path choice"},
    {"holds_hold", holds_hold, METH_VARARGS, "holds_hold(holds, grant[, layer, experts, slots]): a grant held"},
    {"holds_place", holds_place, METH_VARARGS, "map an expert's slot at its addresses if it changed (outside a decode)"},
    {"holds_fail", holds_fail, METH_VARARGS, "the decode failed: no hit, no grant passed until holds_end"},
    {"holds_end", holds_end, METH_VARARGS, "after a decode: (the grant given back | None, the hit grant was not lost)"},
    {"holds_held", holds_held, METH_VARARGS, "what the holds hold now, or None"},
    {"holds_disable", holds_disable, METH_VARARGS, "no more hits (the connection is closing)"},
    {"holds_free", holds_free, METH_VARARGS, "let everything go and release the buffers now; the grant given back"},
    {"holds_stats", holds_stats, METH_VARARGS, "the hits' counters"},
    {"holds_crossings", holds_crossings, METH_VARARGS, "calls across C and Python per routed stop, by outcome"},
    {"holds_take_log", holds_take_log, METH_VARARGS, "the layers done alone since the last take, and whether the log filled"},
    {"holds_layer_ns", holds_layer_ns, METH_VARARGS, "ns in one layer's hits"},
    {"holds_pins", holds_pins, METH_VARARGS, "holds_pins(holds, model_id, pin_word): whole steps possible"},
    {"holds_whole_begin", holds_whole_begin, METH_VARARGS, "take the pin hold and check every expert; True: whole"},
    {"holds_whole_end", holds_whole_end, METH_VARARGS, "let the pin hold go, counting `uses` local hits"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "moed._evalcb",
    "llama.cpp's eval callback with the ask pass in C, and the layer holds.", -1, methods};

PyMODINIT_FUNC PyInit__evalcb(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "NOT_TRIED", ST_NOT_TRIED) < 0 || PyModule_AddIntConstant(m, "LOST", ST_LOST) < 0 ||
        PyModule_AddIntConstant(m, "MAP_FAILED", ST_MAP_FAILED) < 0 ||
        PyModule_AddIntConstant(m, "MISSED", ST_MISSED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
