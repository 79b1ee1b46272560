/* The two byte moves of repack on read (moed/gguf/interleave.py), in C.
 *
 * moed.gguf.interleave holds every layout's knowledge (which field goes where, in
 * what pieces, with what XOR) and runs it with numpy; numpy moves an 8-byte piece at
 * about 2.5 GB/s here, which costs the daemon 0.5-0.8 CPU-s per GB read on the cores
 * llama.cpp computes on (bench/RESULTS.md, "Repack on read"). These two functions do
 * the same moves in plain loops (about 8 GB/s), and know nothing of any layout:
 *
 *   chunks(src, dst, G, nb, R, bb, foff, fsize, chunk, o, xor)
 *       for every group g of R rows and block column x: piece k of field
 *       [foff, foff + fsize) of row r's block goes to o + (k*R + r)*chunk of the
 *       interleaved block (g, x), XORed with `xor` (a chunk-wide word);
 *   kscales(src, dst, G, nb, bb, foff, o)
 *       ggml's make_block_q4_Kx8 regrouping of 8 rows' 12-byte 6-bit scales and mins
 *       into 96 bytes at o (Q4_K and Q5_K).
 *
 * Layouts (both buffers one expert's part): the plain block (row, x) at
 * (g*R + r)*nb*bb + x*bb; the interleaved block (g, x) at (g*nb + x)*R*bb. Every
 * argument is checked against the buffers' lengths (ValueError), so no call reads
 * or writes outside them. The loops run without the GIL: reader threads transform
 * in parallel.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    Py_buffer src, dst;
} Buffers;

static int buffers_get(PyObject *s, PyObject *d, Buffers *b) {
    if (PyObject_GetBuffer(s, &b->src, PyBUF_SIMPLE) < 0) return -1;
    if (PyObject_GetBuffer(d, &b->dst, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&b->src);
        return -1;
    }
    return 0;
}

static void buffers_release(Buffers *b) {
    PyBuffer_Release(&b->src);
    PyBuffer_Release(&b->dst);
}

/* The geometry fits both buffers: G groups of R rows of nb blocks of bb bytes each. */
static int geometry_ok(Buffers *b, Py_ssize_t G, Py_ssize_t nb, Py_ssize_t R, Py_ssize_t bb) {
    if (G < 0 || nb < 0 || R <= 0 || bb <= 0) {
        PyErr_SetString(PyExc_ValueError, "negative or zero geometry");
        return 0;
    }
    Py_ssize_t need = G * R * nb * bb;
    if (need / R / bb != G * nb || b->src.len < need || b->dst.len < need) {
        PyErr_Format(PyExc_ValueError, "the geometry needs %zd bytes; the buffers are %zd and %zd", need,
                     b->src.len, b->dst.len);
        return 0;
    }
    return 1;
}

#define PIECES(T)                                                                          \
    for (Py_ssize_t g = 0; g < G; g++)                                                     \
        for (Py_ssize_t x = 0; x < nb; x++) {                                              \
            const uint8_t *s = src + g * R * row + x * bb + foff;                          \
            uint8_t *d = dst + (g * nb + x) * gout + o;                                    \
            for (Py_ssize_t k = 0; k < nk; k++)                                            \
                for (Py_ssize_t r = 0; r < R; r++) {                                       \
                    T v;                                                                   \
                    memcpy(&v, s + r * row + k * (Py_ssize_t)sizeof(T), sizeof(T));        \
                    v ^= (T)xor;                                                           \
                    memcpy(d + (k * R + r) * (Py_ssize_t)sizeof(T), &v, sizeof(T));        \
                }                                                                          \
        }

static PyObject *chunks(PyObject *self, PyObject *args) {
    PyObject *so, *dobj;
    Py_ssize_t G, nb, R, bb, foff, fsize, chunk, o;
    unsigned long long xor;
    Buffers b;
    if (!PyArg_ParseTuple(args, "OOnnnnnnnnK", &so, &dobj, &G, &nb, &R, &bb, &foff, &fsize, &chunk, &o, &xor))
        return NULL;
    if (buffers_get(so, dobj, &b) < 0) return NULL;
    if (!geometry_ok(&b, G, nb, R, bb)) goto fail;
    if (!(chunk == 1 || chunk == 2 || chunk == 4 || chunk == 8) || fsize <= 0 || fsize % chunk || foff < 0 ||
        foff + fsize > bb || o < 0 || o + R * fsize > R * bb) {
        PyErr_Format(PyExc_ValueError, "field [%zd, +%zd) in %zd-byte pieces to %zd does not fit %zd-byte blocks",
                     foff, fsize, chunk, o, bb);
        goto fail;
    }
    {
        const uint8_t *src = b.src.buf;
        uint8_t *dst = b.dst.buf;
        Py_ssize_t nk = fsize / chunk, row = nb * bb, gout = R * bb;
        Py_BEGIN_ALLOW_THREADS
        switch (chunk) {
        case 1: PIECES(uint8_t) break;
        case 2: PIECES(uint16_t) break;
        case 4: PIECES(uint32_t) break;
        default: PIECES(uint64_t) break;
        }
        Py_END_ALLOW_THREADS
    }
    buffers_release(&b);
    Py_RETURN_NONE;
fail:
    buffers_release(&b);
    return NULL;
}

/* make_block_q4_Kx8's 12 bytes for one sub-block pair from 8 rows' 6-bit scales s and mins m. */
static void pack12(uint8_t *out, const uint8_t s[8], const uint8_t m[8]) {
    for (int c = 0; c < 4; c++) {
        out[c] = (uint8_t)((s[c] & 63) + ((s[c + 4] & 48) << 2));
        out[4 + c] = (uint8_t)((m[c] & 63) + ((m[c + 4] & 48) << 2));
        out[8 + c] = (uint8_t)((s[c + 4] & 15) + ((m[c + 4] & 15) << 4));
    }
}

static PyObject *kscales(PyObject *self, PyObject *args) {
    PyObject *so, *dobj;
    Py_ssize_t G, nb, bb, foff, o;
    const Py_ssize_t R = 8;
    Buffers b;
    if (!PyArg_ParseTuple(args, "OOnnnnn", &so, &dobj, &G, &nb, &bb, &foff, &o)) return NULL;
    if (buffers_get(so, dobj, &b) < 0) return NULL;
    if (!geometry_ok(&b, G, nb, R, bb)) goto fail;
    if (foff < 0 || foff + 12 > bb || o < 0 || o + 96 > R * bb) {
        PyErr_Format(PyExc_ValueError, "scales at %zd to %zd do not fit %zd-byte blocks", foff, o, bb);
        goto fail;
    }
    {
        const uint8_t *src = b.src.buf;
        uint8_t *dst = b.dst.buf;
        Py_ssize_t row = nb * bb, gout = R * bb;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t g = 0; g < G; g++)
            for (Py_ssize_t x = 0; x < nb; x++) {
                const uint8_t *in[8];
                for (int j = 0; j < 8; j++) in[j] = src + (g * R + j) * row + x * bb + foff;
                uint8_t *out = dst + (g * nb + x) * gout + o;
                uint8_t s[8], m[8];
                for (int i = 0; i < 4; i++) {
                    for (int j = 0; j < 8; j++) {
                        s[j] = in[j][i] & 63;
                        m[j] = in[j][i + 4] & 63;
                    }
                    pack12(out + i * 12, s, m);
                }
                for (int i = 0; i < 4; i++) {
                    for (int j = 0; j < 8; j++) {
                        s[j] = (uint8_t)(((in[j][i] & 192) >> 2) | (in[j][i + 8] & 15));
                        m[j] = (uint8_t)(((in[j][i + 4] & 192) >> 2) | ((in[j][i + 8] & 240) >> 4));
                    }
                    pack12(out + 48 + i * 12, s, m);
                }
            }
        Py_END_ALLOW_THREADS
    }
    buffers_release(&b);
    Py_RETURN_NONE;
fail:
    buffers_release(&b);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chunks", chunks, METH_VARARGS, "one field of R rows interleaved in pieces (see the module comment)"},
    {"kscales", kscales, METH_VARARGS, "Q4_K/Q5_K scales of 8 rows regrouped as make_block_q4_Kx8 does"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_interleave", NULL, -1, methods};

PyMODINIT_FUNC PyInit__interleave(void) { return PyModule_Create(&module); }
