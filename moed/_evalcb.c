/* llama.cpp's eval callback with the "ask" pass in C.
 *
 * ggml's scheduler calls the eval callback twice for the nodes it cares about:
 * once with ask=true for EVERY node of the graph ("do you want this one?"), and
 * once with ask=false for those the answer was yes to, after computing them. A
 * Python callback pays a ctypes transition and a name read on each of the ~500
 * ask calls a token makes on a 16-layer MoE; here the ask pass is a prefix
 * compare in C, and only the wanted nodes (`ffn_moe_topk-<n>`, and the router's
 * input `ffn_norm-<n>` while observing) reach Python, with the GIL taken for the call.
 *
 *   handle = make(fn, name_offset)   # fn(tensor_address) -> bool, called on the data pass
 *   set_norm(handle, on[, prefix])   # also stop at <prefix><n>; the prefix stays until
 *                                    # changed (b"ffn_norm-"; gpt-oss: b"attn_post_norm-")
 *   set_route(handle, prefix)        # the routed layer's stop: b"ffn_moe_topk-" (default), or
 *                                    # b"ffn_moe_weights-" for device expert slots (its ids are
 *                                    # rewritten after the routing weights were gathered)
 *   callback_address(), user_data(handle): what goes into llama_context_params
 * The handle owns a reference to fn and must outlive the context.
 *
 * The lane: a routed layer whose experts are all local hits, taken without Python.
 * Between two layers' callbacks the matmuls stream tens of MB of weights, so the
 * callback runs with cold caches and every Python instruction costs several times
 * what a warm loop says (bench/RESULTS.md: 115 us a layer of Python acquire and
 * show against 22 us warm). The lane does one layer's whole cycle in C: read the
 * topk ids, take the hit (moed/_hitproto.h: the same steps as moed._holds), release
 * the previous layer's lane lease, leave the touches, and map every expert whose
 * slot changed (MAP_FIXED of the daemon's read-only memfd; relaxed zero copy).
 *
 *   lane = lane_new(region, table, n_experts, hold_indexes, counter_word, tensor_layout)
 *   lane_layer(lane, layer, row_base, class_id, states, fd, [(addr, bytes, part_off, part_stride)])
 *   lane_step(lane, tensor) -> experts held | -1 (declined: ask Python's path) | -2 (lease lost)
 *   lane_place(lane, layer, expert, slot[, populate]) -> bool   (the slow path's show: mapped now?)
 *   lane_release(lane) -> bool, lane_python_held(lane, on), lane_disable(lane), lane_free(lane)
 *   lane_stats(lane), lane_layer_ns(lane, layer)
 *   lane_log(lane, on), lane_take_log(lane) -> ([(layer, [experts])], full): what it took
 *   set_lane(handle, lane | None, auto): with auto, a topk node tries the lane before Python
 *
 * Whole steps: when every expert of the model is pinned (the table's pin word reads 1),
 * a decode needs no per-layer stop at all. lane_whole_begin takes the region's pin hold
 * (moed.protocol.residency_words: one word that keeps every pinned slot of the model),
 * checks every expert is READY at the slot its addresses show (mapping those that are
 * not), and set_whole makes the ask pass answer no to every node, so ggml computes the
 * graph in one piece as it does with no callback; lane_whole_end lets the hold go.
 *
 *   lane_pins(lane, model_id, pin_word)    the model's id and its table's pin word
 *   lane_whole_begin(lane) -> bool         True: the pin hold is taken, every expert mapped
 *   lane_whole_end(lane, uses)             the pin hold let go; `uses` counted as local hits
 *   set_whole(handle, on)
 *
 * One owner for each thing the lane touches: it alone maps the addresses of the
 * layers given to it (the Python slow path maps through lane_place); its hold
 * indexes were handed to it by the client's region and are its own; the ring's
 * head is the region's word, which every recorder writes holding the GIL (the
 * lane always runs holding it). A lane declines (-1) whenever anything is not a
 * plain hit: a revoked or disabled region, an id out of range; nothing is
 * changed then, and Python's path does the layer. A hit tried and missed is
 * LANE_MISSED (-4), kept for Python's lane_step as any result of the callback's
 * try is: Python then asks the daemon with no second try (one hp_hit a layer). The auto path also leaves
 * the layer to Python while Python holds a grant (it must release it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "_hitproto.h"

#define NORM_PREFIX_MAX 47 /* a ggml name is at most 63 bytes; the prefix leaves room for digits */

#define LANE_MAX_PARTS 4
#define LANE_MAX_LAYERS 4096
#define LANE_DECLINE (-1)
#define LANE_LOST (-2)
#define LANE_MAPERR (-3)
#define LANE_MISSED (-4) /* hp_hit tried and missed: Python asks the daemon, with no second try */
#define LANE_LOG_LAYERS 1024
#define LANE_LOG_EXPERTS 16384

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
    uint64_t ns;     /* time in this layer's lane acquires */
} LaneLayer;

typedef struct {
    int live;
    int has_region;
    Py_buffer region, table;
    int64_t n_experts;
    int64_t counter_word;
    size_t name_off, type_off, ne_off, nb_off, data_off;
    int64_t *holds[2]; /* two sets of hold indexes: the lease held, and the next */
    Py_ssize_t set_size;
    int cur_set;        /* the set the held lease uses */
    Py_ssize_t cur_n;   /* experts in the held lease (0: none) */
    LaneLayer *cur;     /* its layer */
    int disabled, python_held;
    int64_t model_id, pin_word; /* pin_word < 0: no whole steps (lane_pins not called) */
    int whole;                  /* the region's pin hold is ours: a whole step is under way */
    uint64_t whole_steps;
    int pending;        /* an error met on the auto path, for Python's next lane_step */
    int pending_errno;
    LaneLayer *layers[LANE_MAX_LAYERS];
    unsigned char *mark;
    int64_t *experts, *rows;
    uint64_t *slots;
    uint64_t n_layers, n_experts_acq, acquire_ns, show_ns, maps, declines;
    /* While logging: the (layer, experts) of every layer taken, for the engine's cache
     * estimate (lane_take_log); a full log drops the rest and says so. */
    int logging, log_full;
    Py_ssize_t log_n, log_used;
    int32_t log_layer[LANE_LOG_LAYERS];
    Py_ssize_t log_start[LANE_LOG_LAYERS + 1];
    int32_t log_experts[LANE_LOG_EXPERTS];
} Lane;

typedef struct {
    PyObject *fn;
    size_t name_offset;
    int norm;
    char norm_prefix[NORM_PREFIX_MAX + 1];
    size_t norm_len;
    char route_prefix[NORM_PREFIX_MAX + 1];
    size_t route_len;
    PyObject *lane_obj; /* the capsule, referenced while set */
    Lane *lane;
    int lane_auto;
    int whole; /* a whole step: the ask pass wants no node */
} Config;

static int digits_to_end(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return 0;
    return 1;
}

static bool wanted(const Config *c, const char *name) {
    if (strncmp(name, c->route_prefix, c->route_len) == 0) return digits_to_end(name + c->route_len);
    if (c->norm && strncmp(name, c->norm_prefix, c->norm_len) == 0) return digits_to_end(name + c->norm_len);
    return false;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The layer number of a `ffn_moe_topk-<n>` name, or -1. */
static int topk_layer(const char *name) {
    if (strncmp(name, "ffn_moe_topk-", 13) != 0 || !digits_to_end(name + 13)) return -1;
    long n = strtol(name + 13, NULL, 10);
    return n >= 0 && n < LANE_MAX_LAYERS ? (int)n : -1;
}

/* Map every expert of the layer whose slot changed; MAP_FIXED replaces what was there. */
static int lane_map(Lane *L, LaneLayer *ly, int64_t expert, uint64_t slot, int populate) {
    if (ly->placed[expert] == (int64_t)slot && !populate) return 0;
    ly->placed[expert] = -1; /* until every part is mapped: a failure leaves it unknown */
    for (int p = 0; p < ly->n_parts; p++) {
        void *addr = (void *)(ly->addr[p] + (uintptr_t)expert * ly->bytes[p]);
        off_t off = (off_t)(ly->part_off[p] + slot * ly->part_stride[p]);
        int flags = MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0);
        if (mmap(addr, ly->bytes[p], PROT_READ, flags, ly->fd, off) == MAP_FAILED) return -1;
    }
    ly->placed[expert] = (int64_t)slot;
    L->maps++;
    return 1;
}

/* One layer's cycle (the module comment); the GIL is held. */
static int lane_step_core(Lane *L, const char *tensor) {
    if (!L->live || !L->has_region || L->disabled) return LANE_DECLINE;
    int layer = topk_layer(tensor + L->name_off);
    LaneLayer *ly = layer >= 0 ? L->layers[layer] : NULL;
    if (ly == NULL || *(const int *)(tensor + L->type_off) != 26 /* GGML_TYPE_I32 */) return LANE_DECLINE;
    const int64_t *ne = (const int64_t *)(tensor + L->ne_off);
    const size_t *nb = (const size_t *)(tensor + L->nb_off);
    const char *data = *(const char *const *)(tensor + L->data_off);
    int64_t n = L->n_experts, m = 0;
    int bad = 0;
    for (int64_t t = 0; t < ne[1]; t++)
        for (int64_t j = 0; j < ne[0]; j++) {
            int32_t id = *(const int32_t *)(data + t * nb[1] + j * nb[0]);
            if (id >= n) bad = 1;
            else if (id >= 0) L->mark[id] = 1;
        }
    for (int64_t e = 0; e < n; e++)
        if (L->mark[e]) { L->mark[e] = 0; L->experts[m++] = e; } /* ascending, as np.unique */
    if (bad || m == 0 || m > L->set_size) return LANE_DECLINE;
    uint64_t t0 = now_ns();
    const uint64_t *table = (const uint64_t *)L->table.buf;
    Py_ssize_t n_table = L->table.len / 8;
    for (int64_t j = 0; j < m; j++) {
        L->rows[j] = ly->row_base + L->experts[j];
        if (L->rows[j] >= n_table) return LANE_DECLINE;
    }
    uint64_t *region = (uint64_t *)L->region.buf;
    int next = L->cur_n ? 1 - L->cur_set : L->cur_set;
    int rc = hp_hit(table, L->rows, (size_t)m, (const uint64_t *)ly->states.buf, (size_t)(ly->states.len / 8),
                    region, L->holds[next], ly->class_id, L->slots);
    if (rc != HP_HIT) { L->declines++; return LANE_MISSED; }
    int lost = 0;
    if (L->cur_n)
        lost = !hp_release((const uint64_t *)L->cur->states.buf, (size_t)(L->cur->states.len / 8), region,
                           L->holds[L->cur_set], (size_t)L->cur_n);
    L->cur_set = next; L->cur_n = m; L->cur = ly;
    hp_record(region, ly->class_id, L->slots, (size_t)m, L->counter_word);
    uint64_t t1 = now_ns();
    for (int64_t j = 0; j < m; j++)
        if (lane_map(L, ly, L->experts[j], L->slots[j], 0) < 0) { L->pending_errno = errno; return LANE_MAPERR; }
    uint64_t t2 = now_ns();
    if (L->logging) {
        if (L->log_n < LANE_LOG_LAYERS && L->log_used + m <= LANE_LOG_EXPERTS) {
            L->log_layer[L->log_n] = layer;
            L->log_start[L->log_n] = L->log_used;
            for (int64_t j = 0; j < m; j++) L->log_experts[L->log_used++] = (int32_t)L->experts[j];
            L->log_n++;
        } else {
            L->log_full = 1;
        }
    }
    L->n_layers++; L->n_experts_acq += (uint64_t)m;
    L->acquire_ns += t1 - t0; L->show_ns += t2 - t1; ly->ns += t1 - t0;
    return lost ? LANE_LOST : (int)m;
}

static bool eval_callback(void *tensor, bool ask, void *user_data) {
    const Config *c = (const Config *)user_data;
    if (c->whole) return false; /* no stop: ggml computes the graph in one piece */
    const char *name = (const char *)tensor + c->name_offset;
    if (!wanted(c, name)) return false;
    if (ask) return true;
    PyGILState_STATE g = PyGILState_Ensure();
    bool ok = false;
    if (c->lane != NULL && c->lane_auto && !c->lane->python_held && c->route_len == 13) { /* the lane reads topk nodes */ /* a Python grant: Python releases it */
        int rc = lane_step_core(c->lane, (const char *)tensor);
        if (rc >= 0) { PyGILState_Release(g); return true; }
        if (rc != LANE_DECLINE) c->lane->pending = rc; /* Python's lane_step reports it */
    }
    PyObject *r = PyObject_CallFunction(c->fn, "K", (unsigned long long)(uintptr_t)tensor);
    if (r == NULL) {
        PyErr_WriteUnraisable(c->fn);     /* the Python side catches its own errors; a bug stops the graph */
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
        Py_XDECREF(c->lane_obj);
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
    Config *c = PyMem_Calloc(1, sizeof(Config)); /* every field not set below starts 0 (whole: off) */
    if (c == NULL) return PyErr_NoMemory();
    Py_INCREF(fn);
    c->fn = fn;
    c->name_offset = (size_t)off;
    c->norm = 0;
    c->lane_obj = NULL;
    c->lane = NULL;
    c->lane_auto = 0;
    strcpy(c->norm_prefix, "ffn_norm-");
    c->norm_len = strlen(c->norm_prefix);
    strcpy(c->route_prefix, "ffn_moe_topk-");
    c->route_len = strlen(c->route_prefix);
    PyObject *cap = PyCapsule_New(c, "moed.evalcb", config_free);
    if (cap == NULL) { Py_DECREF(fn); PyMem_Free(c); }
    return cap;
}

static Config *config_of(PyObject *cap) {
    return (Config *)PyCapsule_GetPointer(cap, "moed.evalcb");
}

/* Copy a 1..47-byte prefix with no NUL into `dst`; -1 with ValueError set otherwise. */
static int set_prefix(char *dst, size_t *len_out, const char *prefix, Py_ssize_t len) {
    if (len < 1 || len > NORM_PREFIX_MAX || memchr(prefix, 0, (size_t)len) != NULL) {
        PyErr_SetString(PyExc_ValueError, "a node prefix must be 1..47 bytes with no NUL");
        return -1;
    }
    memcpy(dst, prefix, (size_t)len);
    dst[len] = 0;
    *len_out = (size_t)len;
    return 0;
}

static PyObject *set_norm(PyObject *self, PyObject *args) {
    PyObject *cap; int on; const char *prefix = NULL; Py_ssize_t len = 0;
    if (!PyArg_ParseTuple(args, "Op|y#", &cap, &on, &prefix, &len)) return NULL;
    Config *c = config_of(cap);
    if (c == NULL) return NULL;
    if (prefix != NULL && set_prefix(c->norm_prefix, &c->norm_len, prefix, len) < 0) return NULL;
    c->norm = on;
    Py_RETURN_NONE;
}

static PyObject *set_route(PyObject *self, PyObject *args) {
    PyObject *cap; const char *prefix; Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "Oy#", &cap, &prefix, &len)) return NULL;
    Config *c = config_of(cap);
    if (c == NULL) return NULL;
    if (set_prefix(c->route_prefix, &c->route_len, prefix, len) < 0) return NULL;
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


/* ---- the lane's Python interface ---------------------------------------- */

static void lane_release_buffers(Lane *L) {
    if (!L->live) return;
    L->live = 0;
    for (int i = 0; i < LANE_MAX_LAYERS; i++) {
        LaneLayer *ly = L->layers[i];
        if (ly == NULL) continue;
        PyBuffer_Release(&ly->states);
        PyMem_Free(ly->placed);
        PyMem_Free(ly);
        L->layers[i] = NULL;
    }
    if (L->has_region) {
        PyBuffer_Release(&L->region);
        PyBuffer_Release(&L->table);
    }
}

static void lane_capsule_free(PyObject *capsule) {
    Lane *L = (Lane *)PyCapsule_GetPointer(capsule, "moed.lane");
    if (L == NULL) return;
    lane_release_buffers(L);
    PyMem_Free(L->holds[0]); PyMem_Free(L->holds[1]);
    PyMem_Free(L->mark); PyMem_Free(L->experts); PyMem_Free(L->rows); PyMem_Free(L->slots);
    PyMem_Free(L);
}

static Lane *lane_of(PyObject *cap) {
    Lane *L = (Lane *)PyCapsule_GetPointer(cap, "moed.lane");
    if (L != NULL && !L->live) {
        PyErr_SetString(PyExc_ValueError, "the lane was freed");
        return NULL;
    }
    return L;
}

/* lane_new(region | None, table | None, n_experts, hold_indexes, counter_word,
 *          (name_off, type_off, ne_off, nb_off, data_off)) -> lane
 * Without a region (local hits off) the lane only maps (lane_place); lane_step declines. */
static PyObject *lane_new(PyObject *self, PyObject *args) {
    PyObject *robj, *tobj, *holds; Py_ssize_t n_experts, counter;
    Py_ssize_t name_off, type_off, ne_off, nb_off, data_off;
    if (!PyArg_ParseTuple(args, "OOnOn(nnnnn)", &robj, &tobj, &n_experts, &holds, &counter, &name_off, &type_off,
                          &ne_off, &nb_off, &data_off))
        return NULL;
    if (!PyList_Check(holds) || PyList_GET_SIZE(holds) % 2 || n_experts < 1 || n_experts > 65536) {
        PyErr_SetString(PyExc_ValueError, "need an even list of hold indexes and 1..65536 experts");
        return NULL;
    }
    if ((robj == Py_None) != (tobj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "a region and a table, or neither");
        return NULL;
    }
    Lane *L = PyMem_Calloc(1, sizeof(Lane));
    if (L == NULL) return PyErr_NoMemory();
    Py_ssize_t half = PyList_GET_SIZE(holds) / 2;
    L->set_size = half;
    L->n_experts = n_experts;
    L->counter_word = counter;
    L->pin_word = -1;
    L->name_off = (size_t)name_off; L->type_off = (size_t)type_off; L->ne_off = (size_t)ne_off;
    L->nb_off = (size_t)nb_off; L->data_off = (size_t)data_off;
    L->holds[0] = PyMem_Calloc((size_t)(half ? half : 1), sizeof(int64_t));
    L->holds[1] = PyMem_Calloc((size_t)(half ? half : 1), sizeof(int64_t));
    L->mark = PyMem_Calloc((size_t)n_experts, 1);
    L->experts = PyMem_Calloc((size_t)n_experts, sizeof(int64_t));
    L->rows = PyMem_Calloc((size_t)n_experts, sizeof(int64_t));
    L->slots = PyMem_Calloc((size_t)n_experts, sizeof(uint64_t));
    PyObject *cap = NULL;
    if (!L->holds[0] || !L->holds[1] || !L->mark || !L->experts || !L->rows || !L->slots) {
        PyErr_NoMemory();
        goto fail;
    }
    if (robj != Py_None) {
        if (PyObject_GetBuffer(robj, &L->region, PyBUF_WRITABLE) < 0) goto fail;
        if (PyObject_GetBuffer(tobj, &L->table, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&L->region); goto fail; }
        L->has_region = 1;
        Py_ssize_t words = L->region.len / 8;
        int ok = ((uintptr_t)L->region.buf % 8 == 0) && ((uintptr_t)L->table.buf % 8 == 0) &&
                 words >= HP_REGION_WORDS && counter < words;
        for (Py_ssize_t i = 0; ok && i < 2 * half; i++) {
            Py_ssize_t h = PyLong_AsSsize_t(PyList_GET_ITEM(holds, i));
            if (PyErr_Occurred()) { PyErr_Clear(); ok = 0; break; }
            if (h < HP_HOLD_BASE || h >= HP_HOLD_BASE + HP_HOLD_WORDS) ok = 0; /* the region's hold words */
            L->holds[i / half][i % half] = h;
        }
        if (!ok) {
            PyBuffer_Release(&L->region); PyBuffer_Release(&L->table);
            L->has_region = 0;
            PyErr_SetString(PyExc_ValueError, "not a hold region and table, or a hold index outside its hold words");
            goto fail;
        }
    }
    L->live = 1;
    cap = PyCapsule_New(L, "moed.lane", lane_capsule_free);
    if (cap == NULL) { lane_release_buffers(L); goto fail; }
    return cap;
fail:
    PyMem_Free(L->holds[0]); PyMem_Free(L->holds[1]);
    PyMem_Free(L->mark); PyMem_Free(L->experts); PyMem_Free(L->rows); PyMem_Free(L->slots);
    PyMem_Free(L);
    return NULL;
}

/* lane_layer(lane, layer, row_base, class_id, states | None, fd, [(addr, bytes, part_off, part_stride), ...]) */
static PyObject *lane_layer(PyObject *self, PyObject *args) {
    PyObject *cap, *sobj, *parts; Py_ssize_t layer, row_base; unsigned long long class_id; int fd;
    if (!PyArg_ParseTuple(args, "OnnKOiO", &cap, &layer, &row_base, &class_id, &sobj, &fd, &parts)) return NULL;
    Lane *L = lane_of(cap);
    if (L == NULL) return NULL;
    if (layer < 0 || layer >= LANE_MAX_LAYERS || L->layers[layer] != NULL || !PyList_Check(parts) ||
        PyList_GET_SIZE(parts) < 1 || PyList_GET_SIZE(parts) > LANE_MAX_PARTS || row_base < 0 || fd < 0 ||
        (L->has_region && sobj == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "a new layer 0..4095, 1..4 parts, a row base, an fd and its states");
        return NULL;
    }
    LaneLayer *ly = PyMem_Calloc(1, sizeof(LaneLayer));
    if (ly == NULL) return PyErr_NoMemory();
    ly->placed = PyMem_Malloc((size_t)L->n_experts * sizeof(int64_t));
    if (ly->placed == NULL) { PyMem_Free(ly); return PyErr_NoMemory(); }
    for (int64_t e = 0; e < L->n_experts; e++) ly->placed[e] = -1;
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
    L->layers[layer] = ly;
    Py_RETURN_NONE;
}

static PyObject *lane_step(PyObject *self, PyObject *args) {
    PyObject *cap; unsigned long long tensor;
    if (!PyArg_ParseTuple(args, "OK", &cap, &tensor)) return NULL;
    Lane *L = lane_of(cap);
    if (L == NULL) return NULL;
    int rc = L->pending;
    if (rc == 0) rc = lane_step_core(L, (const char *)(uintptr_t)tensor);
    L->pending = 0;
    if (rc == LANE_MAPERR) {
        errno = L->pending_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(rc);
}

/* lane_place(lane, layer, expert, slot[, populate]): populate maps it again, page-table
 * entries made now (StreamedLlama.warm), so its first use in a matmul takes no fault. */
static PyObject *lane_place(PyObject *self, PyObject *args) {
    PyObject *cap; Py_ssize_t layer, expert; unsigned long long slot; int populate = 0;
    if (!PyArg_ParseTuple(args, "OnnK|p", &cap, &layer, &expert, &slot, &populate)) return NULL;
    Lane *L = lane_of(cap);
    if (L == NULL) return NULL;
    LaneLayer *ly = layer >= 0 && layer < LANE_MAX_LAYERS ? L->layers[layer] : NULL;
    if (ly == NULL || expert < 0 || expert >= L->n_experts) {
        PyErr_Format(PyExc_ValueError, "layer %zd expert %zd is not the lane's", layer, expert);
        return NULL;
    }
    uint64_t t0 = now_ns();
    int rc = lane_map(L, ly, expert, slot, populate);
    L->show_ns += now_ns() - t0;
    if (rc < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong(rc);
}

/* Let the pin hold go (after the step's reads: ggml's threads are joined, so they came first). */
static void lane_pin_release(Lane *L) {
    if (!L->whole) return;
    L->whole = 0;
    __atomic_store_n(&((uint64_t *)L->region.buf)[HP_W_PIN_HOLD], 0, __ATOMIC_SEQ_CST);
}

/* The engine's side of the whole-step protocol: cas the pin hold, then the pin word must
 * read 1 and the region be open (seq_cst loads after the cas: moed.protocol.residency_words
 * says why the daemon then sees the hold before any pinned slot may leave); then every
 * expert of every lane layer READY at its entry's slot, mapped there. Any doubt: let go. */
static int lane_whole_core(Lane *L) {
    if (!L->live || !L->has_region || L->disabled || L->pin_word < 0 || L->cur_n || L->whole) return 0;
    uint64_t *region = (uint64_t *)L->region.buf;
    const uint64_t *table = (const uint64_t *)L->table.buf;
    Py_ssize_t n_table = L->table.len / 8;
    uint64_t expect = 0;
    if (!__atomic_compare_exchange_n(&region[HP_W_PIN_HOLD], &expect, (uint64_t)L->model_id + 1, 0,
                                     __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return 0; /* another engine of this connection has it */
    L->whole = 1;
    if (__atomic_load_n(&table[L->pin_word], __ATOMIC_SEQ_CST) != 1 ||
        __atomic_load_n(&region[HP_W_CLOSED], __ATOMIC_SEQ_CST) != 0)
        goto fail;
    for (int i = 0; i < LANE_MAX_LAYERS; i++) {
        LaneLayer *ly = L->layers[i];
        if (ly == NULL) continue;
        const uint64_t *states = (const uint64_t *)ly->states.buf;
        size_t n_states = (size_t)(ly->states.len / 8);
        for (int64_t e = 0; e < L->n_experts; e++) {
            if (ly->row_base + e >= n_table) goto fail;
            uint64_t entry = __atomic_load_n(&table[ly->row_base + e], __ATOMIC_SEQ_CST);
            uint64_t slot = hp_entry_slot(entry);
            if (entry == 0 || slot >= n_states) goto fail;
            if (__atomic_load_n(&states[slot], __ATOMIC_SEQ_CST) != hp_ready_state(hp_entry_gen(entry))) goto fail;
            if (lane_map(L, ly, e, slot, 0) < 0) goto fail;
        }
    }
    L->whole_steps++;
    return 1;
fail:
    lane_pin_release(L);
    return 0;
}

/* Release the held lane lease, if any; 0: it was lost (a slot refilled while held). */
static int lane_drop_lease(Lane *L) {
    int ok = 1;
    if (L->cur_n)
        ok = hp_release((const uint64_t *)L->cur->states.buf, (size_t)(L->cur->states.len / 8),
                        (uint64_t *)L->region.buf, L->holds[L->cur_set], (size_t)L->cur_n);
    L->cur_n = 0; L->cur = NULL;
    return ok;
}

static PyObject *lane_release(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Lane *L = lane_of(cap);
    if (L == NULL) return NULL;
    return PyBool_FromLong(lane_drop_lease(L));
}

static PyObject *lane_flag(PyObject *args, int which) {
    PyObject *cap; int on = 1;
    if (!PyArg_ParseTuple(args, which ? "Op" : "O", &cap, &on)) return NULL;
    Lane *L = (Lane *)PyCapsule_GetPointer(cap, "moed.lane"); /* a freed lane takes flags too: no-ops */
    if (L == NULL) return NULL;
    if (which) L->python_held = on; else L->disabled = 1;
    Py_RETURN_NONE;
}
static PyObject *lane_python_held(PyObject *self, PyObject *args) { return lane_flag(args, 1); }
static PyObject *lane_disable(PyObject *self, PyObject *args) { return lane_flag(args, 0); }

/* lane_log(lane, on): keep a log of the layers taken (cleared). */
static PyObject *lane_log(PyObject *self, PyObject *args) {
    PyObject *cap; int on;
    if (!PyArg_ParseTuple(args, "Op", &cap, &on)) return NULL;
    Lane *L = lane_of(cap);
    if (L == NULL) return NULL;
    L->logging = on; L->log_n = 0; L->log_used = 0; L->log_full = 0;
    Py_RETURN_NONE;
}

/* lane_take_log(lane) -> ([(layer, [experts]), ...], full): the log since the last take, emptied. */
static PyObject *lane_take_log(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Lane *L = lane_of(cap);
    if (L == NULL) return NULL;
    PyObject *out = PyList_New(L->log_n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < L->log_n; i++) {
        Py_ssize_t a = L->log_start[i], b = i + 1 < L->log_n ? L->log_start[i + 1] : L->log_used;
        PyObject *ex = PyList_New(b - a);
        if (ex == NULL) { Py_DECREF(out); return NULL; }
        for (Py_ssize_t j = a; j < b; j++) PyList_SET_ITEM(ex, j - a, PyLong_FromLong(L->log_experts[j]));
        PyObject *item = Py_BuildValue("(iN)", L->log_layer[i], ex);
        if (item == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, item);
    }
    PyObject *res = Py_BuildValue("(NO)", out, L->log_full ? Py_True : Py_False);
    L->log_n = 0; L->log_used = 0; L->log_full = 0;
    return res;
}

/* lane_free(lane): release the buffers now (a lease still held is released first). */
static PyObject *lane_free(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Lane *L = (Lane *)PyCapsule_GetPointer(cap, "moed.lane");
    if (L == NULL) return NULL;
    if (L->live) { lane_drop_lease(L); lane_pin_release(L); }
    lane_release_buffers(L);
    Py_RETURN_NONE;
}

/* lane_pins(lane, model_id, pin_word): whole steps become possible (pin_word: a table word). */
static PyObject *lane_pins(PyObject *self, PyObject *args) {
    PyObject *cap; Py_ssize_t model_id, pin_word;
    if (!PyArg_ParseTuple(args, "Onn", &cap, &model_id, &pin_word)) return NULL;
    Lane *L = lane_of(cap);
    if (L == NULL) return NULL;
    if (!L->has_region || model_id < 0 || pin_word < 0 || pin_word >= L->table.len / 8) {
        PyErr_SetString(PyExc_ValueError, "whole steps need a region, a model id and a pin word inside the table");
        return NULL;
    }
    L->model_id = model_id; L->pin_word = pin_word;
    Py_RETURN_NONE;
}

static PyObject *lane_whole_begin(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Lane *L = lane_of(cap);
    if (L == NULL) return NULL;
    errno = 0;
    int ok = lane_whole_core(L);
    if (!ok && errno) return PyErr_SetFromErrno(PyExc_OSError); /* a mapping failed: not a plain no */
    return PyBool_FromLong(ok);
}

/* lane_whole_end(lane, uses): the pin hold let go; `uses` added to the model's local-hit counter. */
static PyObject *lane_whole_end(PyObject *self, PyObject *args) {
    PyObject *cap; unsigned long long uses;
    if (!PyArg_ParseTuple(args, "OK", &cap, &uses)) return NULL;
    Lane *L = (Lane *)PyCapsule_GetPointer(cap, "moed.lane");
    if (L == NULL) return NULL;
    if (!L->live || !L->whole) Py_RETURN_NONE;
    lane_pin_release(L);
    hp_count((uint64_t *)L->region.buf, L->counter_word, uses);
    Py_RETURN_NONE;
}

static PyObject *lane_stats(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Lane *L = (Lane *)PyCapsule_GetPointer(cap, "moed.lane");
    if (L == NULL) return NULL;
    return Py_BuildValue("{sKsKsKsKsKsKsnsK}", "layers", L->n_layers, "experts", L->n_experts_acq, "acquire_ns",
                         L->acquire_ns, "show_ns", L->show_ns, "maps", L->maps, "declines", L->declines, "held",
                         L->cur_n, "whole_steps", L->whole_steps);
}

static PyObject *lane_layer_ns(PyObject *self, PyObject *args) {
    PyObject *cap; Py_ssize_t layer;
    if (!PyArg_ParseTuple(args, "On", &cap, &layer)) return NULL;
    Lane *L = lane_of(cap);
    if (L == NULL) return NULL;
    LaneLayer *ly = layer >= 0 && layer < LANE_MAX_LAYERS ? L->layers[layer] : NULL;
    return PyLong_FromUnsignedLongLong(ly ? ly->ns : 0);
}

/* set_lane(handle, lane | None, auto) */
static PyObject *set_lane(PyObject *self, PyObject *args) {
    PyObject *cap, *lane; int on;
    if (!PyArg_ParseTuple(args, "OOp", &cap, &lane, &on)) return NULL;
    Config *c = config_of(cap);
    if (c == NULL) return NULL;
    Lane *L = NULL;
    if (lane != Py_None && (L = lane_of(lane)) == NULL) return NULL;
    Py_XINCREF(lane == Py_None ? NULL : lane);
    Py_XDECREF(c->lane_obj);
    c->lane_obj = lane == Py_None ? NULL : lane;
    c->lane = L;
    c->lane_auto = L != NULL && on;
    Py_RETURN_NONE;
}

/* set_whole(handle, on) */
static PyObject *set_whole(PyObject *self, PyObject *args) {
    PyObject *cap; int on;
    if (!PyArg_ParseTuple(args, "Op", &cap, &on)) return NULL;
    Config *c = config_of(cap);
    if (c == NULL) return NULL;
    c->whole = on;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS, "make(fn, name_offset) -> handle"},
    {"set_norm", set_norm, METH_VARARGS, "set_norm(handle, on[, prefix]): also stop at <prefix><n> (ffn_norm-<n>)"},
    {"set_route", set_route, METH_VARARGS, "set_route(handle, prefix): the routed layer's stop (b'ffn_moe_topk-')"},
    {"user_data", user_data, METH_VARARGS, "the cb_eval_user_data pointer for a handle"},
    {"callback_address", callback_address, METH_NOARGS, "the address of the C eval callback"},
    {"lane_new", lane_new, METH_VARARGS, "a lane over a hold region and a residency table"},
    {"lane_layer", lane_layer, METH_VARARGS, "give the lane a zero-copy layer"},
    {"lane_step", lane_step, METH_VARARGS, "one layer's hit cycle: experts held, -1 declined, -2 lease lost"},
    {"lane_place", lane_place, METH_VARARGS, "map an expert's slot at its addresses if it changed"},
    {"lane_release", lane_release, METH_VARARGS, "release the lane's lease; False if it was lost"},
    {"lane_python_held", lane_python_held, METH_VARARGS, "whether Python holds a lease (the lane declines)"},
    {"lane_disable", lane_disable, METH_VARARGS, "no more hits (the connection is closing)"},
    {"lane_free", lane_free, METH_VARARGS, "release the lane's lease and buffers now"},
    {"lane_stats", lane_stats, METH_VARARGS, "the lane's counters"},
    {"lane_log", lane_log, METH_VARARGS, "keep a log of the layers taken (or not)"},
    {"lane_take_log", lane_take_log, METH_VARARGS, "the layers taken since the last take, and whether the log filled"},
    {"lane_layer_ns", lane_layer_ns, METH_VARARGS, "ns in one layer's lane acquires"},
    {"set_lane", set_lane, METH_VARARGS, "set_lane(handle, lane | None, auto)"},
    {"set_whole", set_whole, METH_VARARGS, "set_whole(handle, on): the ask pass wants no node (a whole step)"},
    {"lane_pins", lane_pins, METH_VARARGS, "lane_pins(lane, model_id, pin_word): whole steps possible"},
    {"lane_whole_begin", lane_whole_begin, METH_VARARGS, "take the pin hold and check every expert; True: whole"},
    {"lane_whole_end", lane_whole_end, METH_VARARGS, "let the pin hold go, counting `uses` local hits"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "moed._evalcb",
    "llama.cpp's eval callback with the ask pass in C.", -1, methods};

PyMODINIT_FUNC PyInit__evalcb(void) { return PyModule_Create(&module); }
