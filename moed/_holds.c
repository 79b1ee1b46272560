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

#include "_hitproto.h"

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
 * The client's whole hit in one call (moed/_hitproto.h: hp_hit): every expert's entry,
 * a hold each in the caller's own region, one fence, the states and the region's closed
 * word checked; None (every hold written cleared) on a miss: take the socket path. */
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
    int64_t rows[4096], hidx[4096];
    uint64_t slots[4096];
    PyObject *out = NULL;
    if (!in_range(&R, HP_W_CLOSED)) goto done;
    for (Py_ssize_t j = 0; j < k; j++) {  /* every index checked before anything is written */
        Py_ssize_t e = PyLong_AsSsize_t(PyList_GET_ITEM(experts, j));
        Py_ssize_t h = PyLong_AsSsize_t(PyList_GET_ITEM(holds, j));
        if (PyErr_Occurred() || !in_range(&E, base + e) || !in_range(&R, h)) goto done;
        rows[j] = base + e;
        hidx[j] = h;
    }
    int rc = hp_hit(E.words, rows, (size_t)k, S.words, (size_t)S.n, R.words, hidx, class_id, slots);
    if (rc == HP_BAD) {
        PyErr_Format(PyExc_IndexError, "a residency entry names a slot outside %zd states", S.n);
        goto done;
    }
    if (rc == HP_MISS) { out = Py_None; Py_INCREF(out); goto done; }
    out = PyList_New(k);
    if (out == NULL) goto done;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *v = PyLong_FromUnsignedLongLong(slots[j]);
        if (v == NULL) {  /* the holds stay: the caller gives its indexes back after clearing */
            Py_CLEAR(out);
            for (Py_ssize_t i = 0; i < k; i++) __atomic_store_n(&R.words[hidx[i]], 0, __ATOMIC_SEQ_CST);
            goto done;
        }
        PyList_SET_ITEM(out, j, v);
    }
done:
    PyBuffer_Release(&E.view); PyBuffer_Release(&S.view); PyBuffer_Release(&R.view);
    return out;
}

/* Hold indexes from a list, each checked against the region (nothing is touched on a bad one). */
static int hold_list(PyObject *holds, Words *R, int64_t *hidx, Py_ssize_t cap, Py_ssize_t *k) {
    *k = PyList_GET_SIZE(holds);
    if (*k > cap) { PyErr_SetString(PyExc_ValueError, "too many hold indexes"); return -1; }
    for (Py_ssize_t j = 0; j < *k; j++) {
        Py_ssize_t h = PyLong_AsSsize_t(PyList_GET_ITEM(holds, j));
        if (PyErr_Occurred() || !in_range(R, h)) return -1;
        hidx[j] = h;
    }
    return 0;
}

/* release(states, region, hold_indexes) -> bool: the client's release of a local lease
 * (moed/_hitproto.h: hp_release). False: some slot got a new residency while held
 * (the daemon revoked the region and its grace ended): the bytes read may be wrong. */
static PyObject *release(PyObject *self, PyObject *args) {
    PyObject *sobj, *robj, *holds; Words S, R;
    if (!PyArg_ParseTuple(args, "OOO", &sobj, &robj, &holds) || !PyList_Check(holds)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "hold_indexes must be a list");
        return NULL;
    }
    if (words_get(sobj, &S, 0) < 0) return NULL;
    if (words_get(robj, &R, 1) < 0) { PyBuffer_Release(&S.view); return NULL; }
    int64_t hidx[4096]; Py_ssize_t k;
    PyObject *out = NULL;
    if (hold_list(holds, &R, hidx, 4096, &k) == 0)
        out = PyBool_FromLong(hp_release(S.words, (size_t)S.n, R.words, hidx, (size_t)k));
    PyBuffer_Release(&S.view); PyBuffer_Release(&R.view);
    return out;
}

/* record(region, class_id, slots, counter_word): a hit's touches into the ring, then the
 * head, then the model's local-hit counter (counter_word < 0: none); moed/_hitproto.h. */
static PyObject *record(PyObject *self, PyObject *args) {
    PyObject *robj, *slots; unsigned long long class_id; Py_ssize_t counter; Words R;
    if (!PyArg_ParseTuple(args, "OKOn", &robj, &class_id, &slots, &counter) || !PyList_Check(slots)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "slots must be a list");
        return NULL;
    }
    if (words_get(robj, &R, 1) < 0) return NULL;
    Py_ssize_t k = PyList_GET_SIZE(slots);
    uint64_t s[4096];
    PyObject *out = NULL;
    if (R.n < HP_REGION_WORDS || k > 4096 || (counter >= 0 && !in_range(&R, counter))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "not a hold region, or too many slots");
        goto done;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        s[j] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(slots, j));
        if (PyErr_Occurred()) goto done;
    }
    hp_record(R.words, class_id, s, (size_t)k, counter);
    out = Py_None; Py_INCREF(out);
done:
    PyBuffer_Release(&R.view);
    return out;
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
    {"record", record, METH_VARARGS, "a hit's touches into the region's ring, then its head and the model's counter"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "moed._holds",
    "Sequentially consistent atomics on shared memory (moed's no-round-trip hits).", -1, methods};

PyMODINIT_FUNC PyInit__holds(void) { return PyModule_Create(&module); }
