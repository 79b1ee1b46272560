/* Sequentially consistent atomics on shared memory for moed's no-round-trip hits.
 *
 * Python cannot order loads and stores on shared memory; this module does the
 * few operations the hit protocol needs with the C11 builtins, so the argument
 * in moed/protocol/residency_words.py holds on ARM as on x86:
 *
 *   client hit:   store hold (seq_cst); fence (seq_cst); load slot state (seq_cst);
 *                 load the region's closed word (seq_cst)
 *   daemon evict: CAS state READY->EVICTING (seq_cst); fence; load every hold (seq_cst)
 *   daemon revoke: store the closed word (seq_cst); fence; load every hold (seq_cst)
 *
 * Every word is a naturally aligned uint64 in a buffer (a mapping of a memfd).
 * Indexes are checked against the buffer's length: a bad index raises
 * IndexError, never touches memory outside the buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define W_CLOSED 2 /* moed.protocol.residency_words.W_CLOSED: nonzero once the daemon revoked the region */

typedef struct {
    Py_buffer view;
    uint64_t *words;
    Py_ssize_t n;
} Words;

static int words_get(PyObject *obj, Words *w, int writable) {
    if (PyObject_GetBuffer(obj, &w->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    if (((uintptr_t)w->view.buf) % 8) {
        PyBuffer_Release(&w->view);
        PyErr_SetString(PyExc_ValueError, "buffer is not 8-byte aligned");
        return -1;
    }
    w->words = (uint64_t *)w->view.buf;
    w->n = w->view.len / 8;
    return 0;
}

static int in_range(Words *w, Py_ssize_t i) {
    if (i < 0 || i >= w->n) {
        PyErr_Format(PyExc_IndexError, "word %zd outside a buffer of %zd words", i, w->n);
        return 0;
    }
    return 1;
}

/* load(buf, index) -> int */
static PyObject *load(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t i; Words w;
    if (!PyArg_ParseTuple(args, "On", &obj, &i) || words_get(obj, &w, 0) < 0) return NULL;
    if (!in_range(&w, i)) { PyBuffer_Release(&w.view); return NULL; }
    uint64_t v = __atomic_load_n(&w.words[i], __ATOMIC_SEQ_CST);
    PyBuffer_Release(&w.view);
    return PyLong_FromUnsignedLongLong(v);
}

/* store(buf, index, value) */
static PyObject *store(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t i; unsigned long long v; Words w;
    if (!PyArg_ParseTuple(args, "OnK", &obj, &i, &v) || words_get(obj, &w, 1) < 0) return NULL;
    if (!in_range(&w, i)) { PyBuffer_Release(&w.view); return NULL; }
    __atomic_store_n(&w.words[i], (uint64_t)v, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&w.view);
    Py_RETURN_NONE;
}

/* cas(buf, index, expected, desired) -> bool */
static PyObject *cas(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t i; unsigned long long expected, desired; Words w;
    if (!PyArg_ParseTuple(args, "OnKK", &obj, &i, &expected, &desired) || words_get(obj, &w, 1) < 0)
        return NULL;
    if (!in_range(&w, i)) { PyBuffer_Release(&w.view); return NULL; }
    uint64_t e = expected;
    int ok = __atomic_compare_exchange_n(&w.words[i], &e, (uint64_t)desired, 0,
                                         __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&w.view);
    return PyBool_FromLong(ok);
}

/* find(buf, start, count, word) -> bool: is `word` in buf[start:start+count]? (seq_cst loads,
 * after a seq_cst fence: the daemon's side of the protocol, run after its EVICTING store) */
static PyObject *find(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t start, count; unsigned long long word; Words w;
    if (!PyArg_ParseTuple(args, "OnnK", &obj, &start, &count, &word) || words_get(obj, &w, 0) < 0)
        return NULL;
    if (start < 0 || count < 0 || start + count > w.n) {
        PyBuffer_Release(&w.view);
        PyErr_SetString(PyExc_IndexError, "range outside the buffer");
        return NULL;
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int found = 0;
    for (Py_ssize_t i = start; i < start + count; i++) {
        if (__atomic_load_n(&w.words[i], __ATOMIC_SEQ_CST) == word) { found = 1; break; }
    }
    PyBuffer_Release(&w.view);
    return PyBool_FromLong(found);
}

/* count(buf, start, n) -> number of nonzero words (holds in a region). A fence, then
 * seq_cst loads: after a revoke's closed store, zero means no hit holds or will hold. */
static PyObject *count(PyObject *self, PyObject *args) {
    PyObject *obj; Py_ssize_t start, n; Words w;
    if (!PyArg_ParseTuple(args, "Onn", &obj, &start, &n) || words_get(obj, &w, 0) < 0) return NULL;
    if (start < 0 || n < 0 || start + n > w.n) {
        PyBuffer_Release(&w.view);
        PyErr_SetString(PyExc_IndexError, "range outside the buffer");
        return NULL;
    }
    Py_ssize_t c = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (Py_ssize_t i = start; i < start + n; i++)
        c += __atomic_load_n(&w.words[i], __ATOMIC_SEQ_CST) != 0;
    PyBuffer_Release(&w.view);
    return PyLong_FromSsize_t(c);
}

/* hit(entries, entry_base, experts, states, region, hold_indexes, class_id) -> list[slot] | None
 *
 * The client's whole hit in one call. For each expert: read its residency entry
 * (0: not resident -> None, nothing written); store a hold naming (class, slot,
 * generation) in the caller's own region. Then one fence, then every slot's state
 * must still read READY with that generation, and the region must not be revoked
 * (its closed word zero); if either fails, every hold just written is cleared and
 * the answer is None (take the socket path).
 *   entry  = (generation & 2^40-1) << 24 | (slot + 1)
 *   state  = (generation & 2^40-1) << 2 | 1  (READY)
 *   hold   = (class & 0xFFFF) << 48 | (slot & 0xFFFFFF) << 24 | (generation & 0xFFFFFF)
 */
static PyObject *hit(PyObject *self, PyObject *args) {
    PyObject *eobj, *experts, *sobj, *robj, *holds;
    Py_ssize_t base; unsigned long long class_id;
    if (!PyArg_ParseTuple(args, "OnOOOOK", &eobj, &base, &experts, &sobj, &robj, &holds, &class_id))
        return NULL;
    if (!PyList_Check(experts) || !PyList_Check(holds) || PyList_GET_SIZE(experts) != PyList_GET_SIZE(holds)) {
        PyErr_SetString(PyExc_TypeError, "experts and hold_indexes must be lists of one length");
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(experts);
    if (k > 4096) { PyErr_SetString(PyExc_ValueError, "too many experts"); return NULL; }
    Words E, S, R;
    if (words_get(eobj, &E, 0) < 0) return NULL;
    if (words_get(sobj, &S, 0) < 0) { PyBuffer_Release(&E.view); return NULL; }
    if (words_get(robj, &R, 1) < 0) { PyBuffer_Release(&E.view); PyBuffer_Release(&S.view); return NULL; }
    uint64_t slots[4096], expect[4096];
    Py_ssize_t hidx[4096];
    PyObject *out = NULL;
    Py_ssize_t written = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_ssize_t e = PyLong_AsSsize_t(PyList_GET_ITEM(experts, j));
        Py_ssize_t h = PyLong_AsSsize_t(PyList_GET_ITEM(holds, j));
        if (PyErr_Occurred()) goto clear;
        if (!in_range(&E, base + e) || !in_range(&R, h)) goto clear;
        uint64_t entry = __atomic_load_n(&E.words[base + e], __ATOMIC_ACQUIRE);
        if (entry == 0) goto miss;
        uint64_t slot = (entry & 0xFFFFFF) - 1, gen = entry >> 24;
        if (!in_range(&S, (Py_ssize_t)slot)) goto clear;
        slots[j] = slot;
        expect[j] = (gen << 2) | 1;
        hidx[j] = h;
        uint64_t word = ((class_id & 0xFFFF) << 48) | ((slot & 0xFFFFFF) << 24) | (gen & 0xFFFFFF);
        __atomic_store_n(&R.words[h], word, __ATOMIC_SEQ_CST);
        written = j + 1;
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (Py_ssize_t j = 0; j < k; j++) {
        if (__atomic_load_n(&S.words[slots[j]], __ATOMIC_SEQ_CST) != expect[j]) goto miss;
    }
    /* After the fence, as the states: a daemon that revoked the region before this load
     * sees these holds in its scan after its closed store (Dekker again). */
    if (R.n <= W_CLOSED || __atomic_load_n(&R.words[W_CLOSED], __ATOMIC_SEQ_CST) != 0) goto miss;
    out = PyList_New(k);
    if (out == NULL) goto clear;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *v = PyLong_FromUnsignedLongLong(slots[j]);
        if (v == NULL) { Py_CLEAR(out); goto clear; }
        PyList_SET_ITEM(out, j, v);
    }
    goto done;
miss:
    for (Py_ssize_t j = 0; j < written; j++) __atomic_store_n(&R.words[hidx[j]], 0, __ATOMIC_SEQ_CST);
    out = Py_None; Py_INCREF(out);
    goto done;
clear:
    for (Py_ssize_t j = 0; j < written; j++) __atomic_store_n(&R.words[hidx[j]], 0, __ATOMIC_SEQ_CST);
done:
    PyBuffer_Release(&E.view); PyBuffer_Release(&S.view); PyBuffer_Release(&R.view);
    return out;
}

/* release(states, region, hold_indexes) -> bool: the client's release of a local lease.
 * A fence (the lease's byte reads come before it), then every held slot's state must
 * still name the hold's generation (its low 24 bits), READY or EVICTING (a claim
 * that will find this hold and put the state back); then the holds are cleared.
 * False: some slot got a new residency while held, which happens only once the
 * daemon revoked the region and its grace ended, so the bytes read may not be the
 * expert's. (A refill not yet published is not seen: this check is a net, not the
 * protocol.) */
static PyObject *release(PyObject *self, PyObject *args) {
    PyObject *sobj, *robj, *holds; Words S, R;
    if (!PyArg_ParseTuple(args, "OOO", &sobj, &robj, &holds) || !PyList_Check(holds)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "hold_indexes must be a list");
        return NULL;
    }
    if (words_get(sobj, &S, 0) < 0) return NULL;
    if (words_get(robj, &R, 1) < 0) { PyBuffer_Release(&S.view); return NULL; }
    Py_ssize_t k = PyList_GET_SIZE(holds);
    for (Py_ssize_t j = 0; j < k; j++) {  /* indexes first: nothing is cleared on a bad one */
        Py_ssize_t h = PyLong_AsSsize_t(PyList_GET_ITEM(holds, j));
        if (PyErr_Occurred() || !in_range(&R, h)) {
            PyBuffer_Release(&S.view); PyBuffer_Release(&R.view); return NULL;
        }
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    int ok = 1;
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_ssize_t h = PyLong_AsSsize_t(PyList_GET_ITEM(holds, j));
        uint64_t word = __atomic_load_n(&R.words[h], __ATOMIC_RELAXED);  /* only we write it */
        Py_ssize_t slot = (Py_ssize_t)((word >> 24) & 0xFFFFFF);
        uint64_t st = slot < S.n ? __atomic_load_n(&S.words[slot], __ATOMIC_SEQ_CST) : 0;
        if (((st & 3) != 1 && (st & 3) != 2) || ((st >> 2) & 0xFFFFFF) != (word & 0xFFFFFF)) ok = 0;
        __atomic_store_n(&R.words[h], 0, __ATOMIC_RELEASE);
    }
    PyBuffer_Release(&S.view); PyBuffer_Release(&R.view);
    return PyBool_FromLong(ok);
}

/* clear(region, hold_indexes): the client's release, no round trip */
static PyObject *clear(PyObject *self, PyObject *args) {
    PyObject *robj, *holds; Words R;
    if (!PyArg_ParseTuple(args, "OO", &robj, &holds) || !PyList_Check(holds)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "hold_indexes must be a list");
        return NULL;
    }
    if (words_get(robj, &R, 1) < 0) return NULL;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(holds); j++) {
        Py_ssize_t h = PyLong_AsSsize_t(PyList_GET_ITEM(holds, j));
        if (PyErr_Occurred() || !in_range(&R, h)) { PyBuffer_Release(&R.view); return NULL; }
        __atomic_store_n(&R.words[h], 0, __ATOMIC_RELEASE);
    }
    PyBuffer_Release(&R.view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "seq_cst load of word `index`"},
    {"store", store, METH_VARARGS, "seq_cst store of word `index`"},
    {"cas", cas, METH_VARARGS, "seq_cst compare-and-swap of word `index`; True if it swapped"},
    {"find", find, METH_VARARGS, "fence, then whether `word` is among words [start, start+count)"},
    {"count", count, METH_VARARGS, "nonzero words among [start, start+n)"},
    {"hit", hit, METH_VARARGS, "the client's hit: holds, fence, state check; slots or None"},
    {"clear", clear, METH_VARARGS, "clear hold words (release)"},
    {"release", release, METH_VARARGS, "fence, check the held slots' states, clear the holds; False if one changed"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "moed._holds",
    "Sequentially consistent atomics on shared memory (moed's no-round-trip hits).", -1, methods};

PyMODINIT_FUNC PyInit__holds(void) { return PyModule_Create(&module); }
