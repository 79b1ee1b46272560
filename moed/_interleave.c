/* The two byte moves of repack on read (moed/gguf/interleave.py), in C.
 *
 * moed.gguf.interleave holds every layout's knowledge (which field goes where, in
 * what pieces, with what XOR) and runs it with numpy; numpy moves an 8-byte piece at
 * about 2.5 GB/s here, which costs the daemon 0.5-0.8 CPU-s per GB read on the cores
 * llama.cpp computes on (bench/RESULTS.md, "Repack on read"). These two functions do
 * the same moves in plain loops (0.23-0.30 CPU-s per GB on cold bytes, against 0.14 for a
 * plain copy; x86's 8-row layouts on an SSE2 path), and know nothing of any layout:
 *
 *   chunks(src, dst, G, nb, R, bb, foff, fsize, chunk, o, xor)
 *       for every group g of R rows and block column x: piece k of field
 *       [foff, foff + fsize) of row r's block goes to o + (k*R + r)*chunk of the
 *       interleaved block (g, x), XORed with `xor` (a chunk-wide word);
 *   kscales(src, dst, G, nb, bb, foff, o)
 *       ggml's make_block_q4_Kx8 regrouping of 8 rows' 12-byte 6-bit scales and mins
 *       into 96 bytes at o (Q4_K and Q5_K);
 *   moves(src, dst, G, nb, R, bb, plan)
 *       a layout's whole plan, moves (kind, foff, fsize, chunk, o, xor) with kind 0 a
 *       `chunks` and 1 a `kscales`, done block by block in one pass over src.
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
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

/* One move of a layout, checked against the block and the interleaved block. */
typedef struct {
    int kind; /* MOVE_CHUNKS or MOVE_KSCALES */
    Py_ssize_t foff, fsize, chunk, o;
    unsigned long long xor;
} Move;

enum { MOVE_CHUNKS = 0, MOVE_KSCALES = 1, MAX_MOVES = 8 };

static int move_ok(const Move *m, Py_ssize_t R, Py_ssize_t bb) {
    if (m->kind == MOVE_KSCALES) {
        if (R != 8 || m->foff < 0 || m->foff + 12 > bb || m->o < 0 || m->o + 96 > R * bb) {
            PyErr_Format(PyExc_ValueError, "scales at %zd to %zd do not fit %zd-byte blocks of %zd rows", m->foff,
                         m->o, bb, R);
            return 0;
        }
        return 1;
    }
    if (m->kind != MOVE_CHUNKS || !(m->chunk == 1 || m->chunk == 2 || m->chunk == 4 || m->chunk == 8) ||
        m->fsize <= 0 || m->fsize % m->chunk || m->foff < 0 || m->foff + m->fsize > bb || m->o < 0 ||
        m->o + R * m->fsize > R * bb) {
        PyErr_Format(PyExc_ValueError, "field [%zd, +%zd) in %zd-byte pieces to %zd does not fit %zd-byte blocks",
                     m->foff, m->fsize, m->chunk, m->o, bb);
        return 0;
    }
    return 1;
}

/* Piece k of field [foff, foff + fsize) of row r's block (rows `row` bytes apart from s) goes
 * to d + (k*R + r)*sizeof(T), XORed with a chunk-wide word. */
#define PIECES(T)                                                                     \
    for (Py_ssize_t k = 0; k < nk; k++)                                               \
        for (Py_ssize_t r = 0; r < R; r++) {                                          \
            T v;                                                                      \
            memcpy(&v, s + r * row + k * (Py_ssize_t)sizeof(T), sizeof(T));           \
            v ^= (T)m->xor;                                                           \
            memcpy(d + (k * R + r) * (Py_ssize_t)sizeof(T), &v, sizeof(T));           \
        }

#if defined(__SSE2__)
/* x86's 8x8 layouts (q4_0, q4_K, q5_K, q6_K, q2_K, iq4_nl, mxfp4): 8 rows in 8-byte pieces,
 * the field whole 16-byte words. Each row's word holds its pieces k and k + 1; two rows'
 * words unpacked give piece k of both rows, then piece k + 1: 8 loads and 8 stores for 128
 * bytes, where the general loop below makes 16 of each. The moves cost, not only memory:
 * q4_0_8x8 0.276 -> 0.229 CPU-s/GB (bench/RESULTS.md, "Issue 41"). */
static int rows8_words(const Move *m, Py_ssize_t R) { return R == 8 && m->chunk == 8 && m->fsize % 16 == 0; }
static void block_rows8_words(const Move *m, const uint8_t *s, uint8_t *d, Py_ssize_t row) {
    const __m128i x = _mm_set1_epi64x((long long)m->xor);
    for (Py_ssize_t k = 0; k < m->fsize / 8; k += 2) {
        uint8_t *lo = d + k * 64, *hi = lo + 64; /* piece k of rows 0-7, then piece k + 1 */
        for (int r = 0; r < 8; r += 2) {
            __m128i a = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(s + r * row + k * 8)), x);
            __m128i b = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(s + (r + 1) * row + k * 8)), x);
            _mm_storeu_si128((__m128i *)(lo + r * 8), _mm_unpacklo_epi64(a, b));
            _mm_storeu_si128((__m128i *)(hi + r * 8), _mm_unpackhi_epi64(a, b));
        }
    }
}
#endif

static void block_pieces(const Move *m, const uint8_t *s, uint8_t *d, Py_ssize_t R, Py_ssize_t row) {
    Py_ssize_t nk = m->fsize / m->chunk;
#if defined(__SSE2__)
    if (rows8_words(m, R)) {
        block_rows8_words(m, s, d, row);
        return;
    }
#endif
    switch (m->chunk) {
    case 1: PIECES(uint8_t) break;
    case 2: PIECES(uint16_t) break;
    case 4: PIECES(uint32_t) break;
    default: PIECES(uint64_t) break;
    }
}

/* make_block_q4_Kx8's 12 bytes for one sub-block pair from 8 rows' 6-bit scales s and mins m. */
static void pack12(uint8_t *out, const uint8_t s[8], const uint8_t m[8]) {
    for (int c = 0; c < 4; c++) {
        out[c] = (uint8_t)((s[c] & 63) + ((s[c + 4] & 48) << 2));
        out[4 + c] = (uint8_t)((m[c] & 63) + ((m[c + 4] & 48) << 2));
        out[8 + c] = (uint8_t)((s[c + 4] & 15) + ((m[c + 4] & 15) << 4));
    }
}

/* ggml's make_block_q4_Kx8 regrouping of 8 rows' 12-byte scales (rows `row` bytes apart from
 * src) into 96 bytes at out. */
static void block_kscales(const uint8_t *src, uint8_t *out, Py_ssize_t row) {
    const uint8_t *in[8];
    for (int j = 0; j < 8; j++) in[j] = src + j * row;
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

/* Streaming stores (x86's non-temporal moves; elsewhere a plain copy): whole 16-byte
 * pieces of an interleaved block at a 16-byte aligned destination. */
enum { STREAM_MAX = 4096 };
#if defined(__SSE2__)
static int streamable(const uint8_t *dst, Py_ssize_t gout) {
    return ((uintptr_t)dst % 16) == 0 && gout % 16 == 0 && gout <= STREAM_MAX;
}
static void stream_out(uint8_t *out, const uint8_t *tmp, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i += 16)
        _mm_stream_si128((__m128i *)(out + i), _mm_load_si128((const __m128i *)(tmp + i)));
}
static void stream_end(void) { _mm_sfence(); }
#else
static int streamable(const uint8_t *dst, Py_ssize_t gout) { return 0; }
static void stream_out(uint8_t *out, const uint8_t *tmp, Py_ssize_t n) { memcpy(out, tmp, (size_t)n); }
static void stream_end(void) {}
#endif

/* Every move, block by block: each block column of each group is read once, all its fields
 * moved while its rows are in cache (field by field over a whole chunk read the chunk from
 * memory once per field: 1 MiB outgrows L2). */
static PyObject *run_moves(Buffers *b, Py_ssize_t G, Py_ssize_t nb, Py_ssize_t R, Py_ssize_t bb, const Move *mv,
                           int n) {
    if (!geometry_ok(b, G, nb, R, bb)) return NULL;
    for (int i = 0; i < n; i++)
        if (!move_ok(&mv[i], R, bb)) return NULL;
    const uint8_t *src = b->src.buf;
    uint8_t *dst = b->dst.buf;
    Py_ssize_t row = nb * bb, gout = R * bb;
    /* Each interleaved block is made in a buffer on the stack and streamed out: the slot is
     * written once, without reading its lines first (a store that misses reads the line). */
    Py_ssize_t covered = 0; /* only a plan that writes every byte of the block streams it */
    for (int i = 0; i < n; i++) covered += mv[i].kind == MOVE_KSCALES ? 96 : R * mv[i].fsize;
    int stream = covered == gout && streamable(dst, gout);
    uint8_t tmp[STREAM_MAX] __attribute__((aligned(64)));
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t g = 0; g < G; g++)
        for (Py_ssize_t x = 0; x < nb; x++) {
            const uint8_t *blk = src + g * R * row + x * bb;
            uint8_t *out = dst + (g * nb + x) * gout;
            uint8_t *to = stream ? tmp : out;
            for (int i = 0; i < n; i++) {
                const Move *m = &mv[i];
                if (m->kind == MOVE_KSCALES)
                    block_kscales(blk + m->foff, to + m->o, row);
                else
                    block_pieces(m, blk + m->foff, to + m->o, R, row);
            }
            if (stream) stream_out(out, tmp, gout);
        }
    stream_end();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *with_buffers(PyObject *so, PyObject *dobj, Py_ssize_t G, Py_ssize_t nb, Py_ssize_t R,
                              Py_ssize_t bb, const Move *mv, int n) {
    Buffers b;
    if (buffers_get(so, dobj, &b) < 0) return NULL;
    PyObject *out = run_moves(&b, G, nb, R, bb, mv, n);
    buffers_release(&b);
    return out;
}

static PyObject *moves(PyObject *self, PyObject *args) {
    PyObject *so, *dobj, *plan;
    Py_ssize_t G, nb, R, bb;
    if (!PyArg_ParseTuple(args, "OOnnnnO", &so, &dobj, &G, &nb, &R, &bb, &plan)) return NULL;
    PyObject *seq = PySequence_Fast(plan, "the plan is a sequence of moves");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Move mv[MAX_MOVES];
    if (n < 1 || n > MAX_MOVES) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "a plan has 1 to %d moves, not %zd", MAX_MOVES, n);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Move *m = &mv[i];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "innnnK;a move is (kind, foff, fsize, chunk, o, xor)",
                              &m->kind, &m->foff, &m->fsize, &m->chunk, &m->o, &m->xor)) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return with_buffers(so, dobj, G, nb, R, bb, mv, (int)n);
}

static PyObject *chunks(PyObject *self, PyObject *args) {
    PyObject *so, *dobj;
    Py_ssize_t G, nb, R, bb;
    Move m = {MOVE_CHUNKS, 0, 0, 0, 0, 0};
    if (!PyArg_ParseTuple(args, "OOnnnnnnnnK", &so, &dobj, &G, &nb, &R, &bb, &m.foff, &m.fsize, &m.chunk, &m.o,
                          &m.xor))
        return NULL;
    return with_buffers(so, dobj, G, nb, R, bb, &m, 1);
}

static PyObject *kscales(PyObject *self, PyObject *args) {
    PyObject *so, *dobj;
    Py_ssize_t G, nb, bb;
    Move m = {MOVE_KSCALES, 0, 12, 1, 0, 0};
    if (!PyArg_ParseTuple(args, "OOnnnnn", &so, &dobj, &G, &nb, &bb, &m.foff, &m.o)) return NULL;
    return with_buffers(so, dobj, G, nb, 8, bb, &m, 1);
}

static PyMethodDef methods[] = {
    {"chunks", chunks, METH_VARARGS, "one field of R rows interleaved in pieces (see the module comment)"},
    {"kscales", kscales, METH_VARARGS, "Q4_K/Q5_K scales of 8 rows regrouped as make_block_q4_Kx8 does"},
    {"moves", moves, METH_VARARGS, "a plan of (kind, foff, fsize, chunk, o, xor) moves, block by block, in one pass"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_interleave", NULL, -1, methods};

PyMODINIT_FUNC PyInit__interleave(void) { return PyModule_Create(&module); }
