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
 *   callback_address(), user_data(handle): what goes into llama_context_params
 * The handle owns a reference to fn and must outlive the context.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <string.h>

#define NORM_PREFIX_MAX 47 /* a ggml name is at most 63 bytes; the prefix leaves room for digits */

typedef struct {
    PyObject *fn;
    size_t name_offset;
    int norm;
    char norm_prefix[NORM_PREFIX_MAX + 1];
    size_t norm_len;
} Config;

static int digits_to_end(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return 0;
    return 1;
}

static bool wanted(const Config *c, const char *name) {
    if (strncmp(name, "ffn_moe_topk-", 13) == 0) return digits_to_end(name + 13);
    if (c->norm && strncmp(name, c->norm_prefix, c->norm_len) == 0) return digits_to_end(name + c->norm_len);
    return false;
}

static bool eval_callback(void *tensor, bool ask, void *user_data) {
    const Config *c = (const Config *)user_data;
    const char *name = (const char *)tensor + c->name_offset;
    if (!wanted(c, name)) return false;
    if (ask) return true;
    PyGILState_STATE g = PyGILState_Ensure();
    bool ok = false;
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
    Config *c = PyMem_Malloc(sizeof(Config));
    if (c == NULL) return PyErr_NoMemory();
    Py_INCREF(fn);
    c->fn = fn;
    c->name_offset = (size_t)off;
    c->norm = 0;
    strcpy(c->norm_prefix, "ffn_norm-");
    c->norm_len = strlen(c->norm_prefix);
    PyObject *cap = PyCapsule_New(c, "moed.evalcb", config_free);
    if (cap == NULL) { Py_DECREF(fn); PyMem_Free(c); }
    return cap;
}

static Config *config_of(PyObject *cap) {
    return (Config *)PyCapsule_GetPointer(cap, "moed.evalcb");
}

static PyObject *set_norm(PyObject *self, PyObject *args) {
    PyObject *cap; int on; const char *prefix = NULL; Py_ssize_t len = 0;
    if (!PyArg_ParseTuple(args, "Op|y#", &cap, &on, &prefix, &len)) return NULL;
    Config *c = config_of(cap);
    if (c == NULL) return NULL;
    if (prefix != NULL) {
        if (len < 1 || len > NORM_PREFIX_MAX || memchr(prefix, 0, (size_t)len) != NULL) {
            PyErr_SetString(PyExc_ValueError, "the norm prefix must be 1..47 bytes with no NUL");
            return NULL;
        }
        memcpy(c->norm_prefix, prefix, (size_t)len);
        c->norm_prefix[len] = 0;
        c->norm_len = (size_t)len;
    }
    c->norm = on;
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

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS, "make(fn, name_offset) -> handle"},
    {"set_norm", set_norm, METH_VARARGS, "set_norm(handle, on[, prefix]): also stop at <prefix><n> (ffn_norm-<n>)"},
    {"user_data", user_data, METH_VARARGS, "the cb_eval_user_data pointer for a handle"},
    {"callback_address", callback_address, METH_NOARGS, "the address of the C eval callback"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "moed._evalcb",
    "llama.cpp's eval callback with the ask pass in C.", -1, methods};

PyMODINIT_FUNC PyInit__evalcb(void) { return PyModule_Create(&module); }
