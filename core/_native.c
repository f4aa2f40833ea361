/* kvstrata._native: the two hot loops of kvstrata in C (optional; kvstrata falls back to Python).
 *
 * chain_xxh3_128(data, row_len, parent) -> list[bytes]
 *     key[i] = XXH3-128(key[i-1] || row[i]) over the rows of a contiguous buffer, key[-1] = parent;
 *     bit-exact with xxhash.xxh3_128_digest(parent + row) chained (seed 0, default secret).
 * memmove_runs(runs, start=0, stop=len(runs)) -> None
 *     memmove(dst, src, size) for each (dst, src, size) tuple of runs[start:stop], without the GIL.
 * memmove_arrays(dst, src, sizes) -> None
 *     The same for three int64 buffers of one length.
 * prefix_values(mapping, keys) / attr_values(mapping, keys, name, default) / prefix_run(masks, prefix)
 *     The inner loops of a lookup (kvstrata.engine.placement, kvstrata.engine.perlayer).
 *
 * XXH3-128 is written here from the public description of the algorithm (doc/xxhash_spec.md of
 * the xxHash project): the constants and the default secret are the ones the specification
 * gives; the code is our own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef uint64_t u64;
typedef uint32_t u32;

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define PMX1 0x165667919E3779F9ULL
#define PMX2 0x9FB21C651E98DF25ULL

#define SECRET_LEN 192
#define STRIPE 64
#define STRIPES_PER_BLOCK ((SECRET_LEN - STRIPE) / 8) /* 16 */
#define BLOCK_LEN (STRIPE * STRIPES_PER_BLOCK)          /* 1024 */

static const uint8_t SECRET[SECRET_LEN] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* ---- little helpers: little-endian reads, rotations, 64x64->128 products ---------------------- */

static inline u64 rd64(const uint8_t *p) {
    u64 v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline u32 rd32(const uint8_t *p) {
    u32 v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline u32 swap32(u32 x) {
    return ((x << 24) & 0xff000000U) | ((x << 8) & 0x00ff0000U) | ((x >> 8) & 0x0000ff00U) | (x >> 24);
}

static inline u64 swap64(u64 x) {
    return ((u64)swap32((u32)x) << 32) | swap32((u32)(x >> 32));
}

static inline u32 rotl32(u32 x, int r) { return (x << r) | (x >> (32 - r)); }
static inline u64 rotl64(u64 x, int r) { return (x << r) | (x >> (64 - r)); }

/* the full product of two 64-bit values: *lo, *hi */
static inline void mul128(u64 a, u64 b, u64 *lo, u64 *hi) {
#if defined(__SIZEOF_INT128__)
    unsigned __int128 p = (unsigned __int128)a * b;
    *lo = (u64)p;
    *hi = (u64)(p >> 64);
#else
    u64 a_lo = (u32)a, a_hi = a >> 32, b_lo = (u32)b, b_hi = b >> 32;
    u64 ll = a_lo * b_lo, lh = a_lo * b_hi, hl = a_hi * b_lo, hh = a_hi * b_hi;
    u64 mid = (ll >> 32) + (u32)lh + (u32)hl;
    *lo = (mid << 32) | (u32)ll;
    *hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
#endif
}

static inline u64 fold128(u64 a, u64 b) {
    u64 lo, hi;
    mul128(a, b, &lo, &hi);
    return lo ^ hi;
}

static inline u64 avalanche3(u64 x) { /* the spec's avalanche() */
    x ^= x >> 37;
    x *= PMX1;
    return x ^ (x >> 32);
}

static inline u64 avalanche64(u64 x) { /* the spec's avalanche_XXH64() */
    x ^= x >> 33;
    x *= P64_2;
    x ^= x >> 29;
    x *= P64_3;
    return x ^ (x >> 32);
}

/* ---- 0 to 16 bytes ----------------------------------------------------------------------------- */

static void h_0to16(const uint8_t *in, size_t len, u64 *lo, u64 *hi) {
    if (len > 8) {
        u64 first = rd64(in), last = rd64(in + len - 8);
        u64 v1 = (rd64(SECRET + 32) ^ rd64(SECRET + 40)) ^ first ^ last;
        u64 v2 = (rd64(SECRET + 48) ^ rd64(SECRET + 56)) ^ last;
        u64 mlo, mhi;
        mul128(v1, P64_1, &mlo, &mhi);
        u64 l = mlo + ((u64)(len - 1) << 54);
        u64 h = mhi + v2 + (u64)(u32)v2 * (P32_2 - 1);
        l ^= swap64(h);
        u64 m2lo, m2hi;
        mul128(l, P64_2, &m2lo, &m2hi);
        *lo = avalanche3(m2lo);
        *hi = avalanche3(m2hi + h * P64_2);
    } else if (len >= 4) {
        u32 first = rd32(in), last = rd32(in + len - 4);
        u64 combined = (u64)first | ((u64)last << 32);
        u64 v = (rd64(SECRET + 16) ^ rd64(SECRET + 24)) ^ combined; /* seed 0: modified seed 0 */
        u64 mlo, mhi;
        mul128(v, P64_1 + ((u64)len << 2), &mlo, &mhi);
        u64 h = mhi + (mlo << 1);
        u64 l = mlo ^ (h >> 3);
        l ^= l >> 35;
        l *= PMX2;
        l ^= l >> 28;
        *lo = l;
        *hi = avalanche3(h);
    } else if (len > 0) {
        u32 combined = (u32)in[len - 1] | ((u32)len << 8) | ((u32)in[0] << 16) | ((u32)in[len >> 1] << 24);
        u64 l = (u64)(rd32(SECRET) ^ rd32(SECRET + 4)) ^ (u64)combined;
        u64 h = (u64)(rd32(SECRET + 8) ^ rd32(SECRET + 12)) ^ (u64)rotl32(swap32(combined), 13);
        *lo = avalanche64(l);
        *hi = avalanche64(h);
    } else {
        *lo = avalanche64(rd64(SECRET + 64) ^ rd64(SECRET + 72));
        *hi = avalanche64(rd64(SECRET + 80) ^ rd64(SECRET + 88));
    }
}

/* ---- 17 to 240 bytes --------------------------------------------------------------------------- */

static inline u64 mix16(const uint8_t *data, const uint8_t *sec, u64 seed) {
    return fold128(rd64(data) ^ (rd64(sec) + seed), rd64(data + 8) ^ (rd64(sec + 8) - seed));
}

static inline void mix32(u64 acc[2], const uint8_t *d1, const uint8_t *d2, const uint8_t *sec, u64 seed) {
    acc[0] += mix16(d1, sec, seed);
    acc[1] += mix16(d2, sec + 16, seed);
    acc[0] ^= rd64(d2) + rd64(d2 + 8);
    acc[1] ^= rd64(d1) + rd64(d1 + 8);
}

static void h_17to240(const uint8_t *in, size_t len, u64 *lo, u64 *hi) {
    u64 acc[2] = {(u64)len * P64_1, 0};
    if (len <= 128) {
        for (long i = (long)((len - 1) >> 5); i >= 0; i--) {
            mix32(acc, in + i * 16, in + len - i * 16 - 16, SECRET + i * 32, 0);
        }
    } else {
        size_t chunks = len >> 5;
        for (size_t i = 0; i < 4; i++) {
            mix32(acc, in + i * 32, in + i * 32 + 16, SECRET + i * 32, 0);
        }
        acc[0] = avalanche3(acc[0]);
        acc[1] = avalanche3(acc[1]);
        for (size_t i = 4; i < chunks; i++) {
            mix32(acc, in + i * 32, in + i * 32 + 16, SECRET + (i - 4) * 32 + 3, 0);
        }
        mix32(acc, in + len - 16, in + len - 32, SECRET + 103, 0);
    }
    u64 l = acc[0] + acc[1];
    u64 h = acc[0] * P64_1 + acc[1] * P64_4 + (u64)len * P64_2;
    *lo = avalanche3(l);
    *hi = (u64)0 - avalanche3(h);
}

/* ---- more than 240 bytes ----------------------------------------------------------------------- */

static inline void accumulate(u64 acc[8], const uint8_t *stripe, const uint8_t *sec) {
    for (int i = 0; i < 8; i++) {
        u64 x = rd64(stripe + 8 * i);
        u64 v = x ^ rd64(sec + 8 * i);
        acc[i ^ 1] += x;
        acc[i] += (u64)(u32)v * (v >> 32);
    }
}

static inline void scramble(u64 acc[8]) {
    const uint8_t *sec = SECRET + SECRET_LEN - STRIPE;
    for (int i = 0; i < 8; i++) {
        u64 a = acc[i];
        a ^= a >> 47;
        a ^= rd64(sec + 8 * i);
        acc[i] = a * P32_1;
    }
}

static u64 merge(const u64 acc[8], u64 init, const uint8_t *sec) {
    u64 r = init;
    for (int i = 0; i < 4; i++) {
        r += fold128(acc[2 * i] ^ rd64(sec + 16 * i), acc[2 * i + 1] ^ rd64(sec + 16 * i + 8));
    }
    return avalanche3(r);
}

static void h_large(const uint8_t *in, size_t len, u64 *lo, u64 *hi) {
    u64 acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    size_t blocks = (len - 1) / BLOCK_LEN; /* the last block (1..BLOCK_LEN bytes) is left for below */
    const uint8_t *p = in;
    for (size_t b = 0; b < blocks; b++, p += BLOCK_LEN) {
        for (int n = 0; n < STRIPES_PER_BLOCK; n++) {
            accumulate(acc, p + n * STRIPE, SECRET + n * 8);
        }
        scramble(acc);
    }
    size_t rest = len - blocks * BLOCK_LEN;
    size_t stripes = (rest - 1) / STRIPE;
    for (size_t n = 0; n < stripes; n++) {
        accumulate(acc, p + n * STRIPE, SECRET + n * 8);
    }
    accumulate(acc, in + len - STRIPE, SECRET + SECRET_LEN - 71);
    *lo = merge(acc, (u64)len * P64_1, SECRET + 11);
    *hi = merge(acc, ~((u64)len * P64_2), SECRET + SECRET_LEN - 75);
}

static inline void xxh3_128(const uint8_t *in, size_t len, uint8_t out[16]) {
    u64 lo, hi;
    if (len <= 16) {
        h_0to16(in, len, &lo, &hi);
    } else if (len <= 240) {
        h_17to240(in, len, &lo, &hi);
    } else {
        h_large(in, len, &lo, &hi);
    }
    /* canonical form, as xxhash's *_digest: the high half first, each half big-endian */
    for (int i = 0; i < 8; i++) {
        out[i] = (uint8_t)(hi >> (56 - 8 * i));
        out[8 + i] = (uint8_t)(lo >> (56 - 8 * i));
    }
}

/* ---- chain_xxh3_128 ---------------------------------------------------------------------------- */

#define KEY_LEN 16

static PyObject *chain_xxh3_128(PyObject *self, PyObject *args) {
    Py_buffer data, parent;
    Py_ssize_t row_len;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*ny*:chain_xxh3_128", &data, &row_len, &parent)) {
        return NULL;
    }
    PyObject *out = NULL;
    uint8_t *buf = NULL;
    if (parent.len != KEY_LEN) {
        PyErr_Format(PyExc_ValueError, "parent must be %d bytes, got %zd", KEY_LEN, parent.len);
        goto done;
    }
    if (row_len <= 0) {
        PyErr_Format(PyExc_ValueError, "row_len must be positive, got %zd", row_len);
        goto done;
    }
    if (data.len % row_len) {
        PyErr_Format(PyExc_ValueError, "data of %zd bytes is not a whole number of %zd-byte rows", data.len, row_len);
        goto done;
    }
    Py_ssize_t n = data.len / row_len;
    size_t in_len = KEY_LEN + (size_t)row_len;
    uint8_t stack[KEY_LEN + 1024];
    if (in_len <= sizeof(stack)) {
        buf = stack;
    } else if ((buf = PyMem_Malloc(in_len)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    out = PyList_New(n);
    if (out == NULL) {
        goto done;
    }
    const uint8_t *rows = (const uint8_t *)data.buf;
    memcpy(buf, parent.buf, KEY_LEN);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize(NULL, KEY_LEN);
        if (key == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        memcpy(buf + KEY_LEN, rows + i * row_len, (size_t)row_len);
        uint8_t *k = (uint8_t *)PyBytes_AS_STRING(key);
        xxh3_128(buf, in_len, k);
        memcpy(buf, k, KEY_LEN);
        PyList_SET_ITEM(out, i, key);
    }
done:
    if (buf != NULL && buf != stack) {
        PyMem_Free(buf);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&parent);
    return out;
}

static PyObject *xxh3_128_digest(PyObject *self, PyObject *arg) {
    Py_buffer data;
    (void)self;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *key = PyBytes_FromStringAndSize(NULL, KEY_LEN);
    if (key != NULL) {
        xxh3_128((const uint8_t *)data.buf, (size_t)data.len, (uint8_t *)PyBytes_AS_STRING(key));
    }
    PyBuffer_Release(&data);
    return key;
}

/* ---- memmove_runs / memmove_arrays ------------------------------------------------------------- */

typedef struct {
    char *dst;
    const char *src;
    size_t size;
} run_t;

static int as_address(PyObject *v, const char *what, Py_ssize_t i, void **out) {
    PyObject *num = PyNumber_Index(v); /* an int, or anything with __index__ (numpy integers) */
    unsigned long long a = (unsigned long long)-1;
    if (num != NULL) {
        a = PyLong_AsUnsignedLongLong(num);
        Py_DECREF(num);
    }
    if (a == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "run %zd: %s %R is not an address", i, what, v);
        return -1;
    }
    *out = (void *)(uintptr_t)a;
    return 0;
}

static PyObject *memmove_runs(PyObject *self, PyObject *args) {
    PyObject *runs;
    Py_ssize_t start = 0, stop = PY_SSIZE_T_MAX;
    (void)self;
    if (!PyArg_ParseTuple(args, "O|nn:memmove_runs", &runs, &start, &stop)) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(runs, "runs must be a sequence of (dst, src, size) tuples");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (start < 0 || start > n) {
        start = start < 0 ? 0 : n;
    }
    if (stop > n) {
        stop = n;
    }
    if (stop < start) {
        stop = start;
    }
    run_t one[16];
    run_t *todo = one;
    Py_ssize_t count = stop - start;
    if (count > 16 && (todo = PyMem_Malloc(sizeof(run_t) * (size_t)count)) == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *run = items[start + i];
        if (!PyTuple_Check(run) || PyTuple_GET_SIZE(run) != 3) {
            PyErr_Format(PyExc_ValueError, "run %zd must be a (dst, src, size) tuple, got %R", start + i, run);
            goto fail;
        }
        void *d, *s;
        if (as_address(PyTuple_GET_ITEM(run, 0), "destination", start + i, &d) < 0 ||
            as_address(PyTuple_GET_ITEM(run, 1), "source", start + i, &s) < 0) {
            goto fail;
        }
        PyObject *num = PyNumber_Index(PyTuple_GET_ITEM(run, 2)); /* numpy integers too */
        Py_ssize_t k = -1;
        if (num != NULL) {
            k = PyLong_AsSsize_t(num);
            Py_DECREF(num);
        }
        if (k < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "run %zd: size %R is not a size", start + i, PyTuple_GET_ITEM(run, 2));
            goto fail;
        }
        todo[i].dst = d;
        todo[i].src = s;
        todo[i].size = (size_t)k;
    }
    Py_DECREF(seq);
    seq = NULL;
    if (count == 1 && todo[0].size < 4096) { /* a hand-off of the GIL costs more than that copy */
        memmove(todo[0].dst, todo[0].src, todo[0].size);
    } else {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++) {
            memmove(todo[i].dst, todo[i].src, todo[i].size);
        }
        Py_END_ALLOW_THREADS
    }
    if (todo != one) {
        PyMem_Free(todo);
    }
    Py_RETURN_NONE;
fail:
    Py_XDECREF(seq);
    if (todo != one) {
        PyMem_Free(todo);
    }
    return NULL;
}

static int int64_view(PyObject *obj, const char *name, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') {
        f++;
    }
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array, got format %s", name,
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *memmove_arrays(PyObject *self, PyObject *args) {
    PyObject *od, *os, *ok;
    Py_buffer vd, vs, vk;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO:memmove_arrays", &od, &os, &ok)) {
        return NULL;
    }
    if (int64_view(od, "dst", &vd) < 0) {
        return NULL;
    }
    if (int64_view(os, "src", &vs) < 0) {
        PyBuffer_Release(&vd);
        return NULL;
    }
    if (int64_view(ok, "sizes", &vk) < 0) {
        PyBuffer_Release(&vd);
        PyBuffer_Release(&vs);
        return NULL;
    }
    PyObject *ret = NULL;
    Py_ssize_t n = vd.len / 8;
    if (vs.len / 8 != n || vk.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%zd destinations, %zd sources and %zd sizes", n, vs.len / 8, vk.len / 8);
        goto done;
    }
    const int64_t *d = vd.buf, *s = vs.buf, *k = vk.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (k[i] < 0) {
            PyErr_Format(PyExc_ValueError, "size %lld of copy %zd is negative", (long long)k[i], i);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        memmove((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)k[i]);
    }
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&vd);
    PyBuffer_Release(&vs);
    PyBuffer_Release(&vk);
    return ret;
}

/* ---- lookup helpers ---------------------------------------------------------------------------- */

static PyObject *prefix_values(PyObject *self, PyObject *args) {
    PyObject *mapping, *keys;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O:prefix_values", &PyDict_Type, &mapping, &keys)) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (; i < n; i++) {
        PyObject *v = PyDict_GetItemWithError(mapping, items[i]); /* borrowed */
        if (v == NULL && PyErr_Occurred()) {
            Py_DECREF(seq);
            Py_DECREF(out);
            return NULL;
        }
        if (v == NULL || v == Py_None) {
            break;
        }
        Py_INCREF(v);
        PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    if (i < n && PyList_SetSlice(out, i, n, NULL) < 0) { /* the unset tail (NULLs) goes */
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *attr_values(PyObject *self, PyObject *args) {
    PyObject *mapping, *keys, *name, *dflt;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!OUO:attr_values", &PyDict_Type, &mapping, &keys, &name, &dflt)) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyDict_GetItemWithError(mapping, items[i]);
        if (v == NULL) {
            if (PyErr_Occurred()) {
                goto fail;
            }
            Py_INCREF(dflt);
            v = dflt;
        } else {
            PyObject *entry = v;
            Py_INCREF(entry); /* held across the getattr, which may run Python code */
            v = PyObject_GetAttr(entry, name);
            Py_DECREF(entry);
            if (v == NULL) {
                goto fail;
            }
        }
        PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

static PyObject *prefix_run(PyObject *self, PyObject *args) {
    PyObject *masks, *prefix;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO!:prefix_run", &masks, &PyLong_Type, &prefix)) {
        return NULL;
    }
    int overflow = 0;
    long long want = PyLong_AsLongLongAndOverflow(prefix, &overflow);
    if (want == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (overflow || want < 0) {
        PyErr_Format(PyExc_ValueError, "prefix mask %R does not fit in 63 bits", prefix);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(masks, "masks must be a sequence of ints");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (; i < n; i++) {
        if (!PyLong_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "mask %zd is %R, not an int", i, items[i]);
            Py_DECREF(seq);
            return NULL;
        }
        /* the low 64 bits (two's complement) decide m & want == want for a want below 2**63 */
        unsigned long long m = PyLong_AsUnsignedLongLongMask(items[i]);
        if ((m & (unsigned long long)want) != (unsigned long long)want) {
            break;
        }
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"chain_xxh3_128", chain_xxh3_128, METH_VARARGS,
     "chain_xxh3_128(data, row_len, parent) -> list of 16-byte keys, key[i] = xxh3_128(key[i-1] || row i)."},
    {"xxh3_128_digest", xxh3_128_digest, METH_O, "xxh3_128_digest(data) -> the 16-byte XXH3-128 digest (seed 0)."},
    {"memmove_runs", memmove_runs, METH_VARARGS,
     "memmove_runs(runs, start=0, stop=len(runs)): memmove each (dst, src, size) of runs[start:stop], GIL released."},
    {"memmove_arrays", memmove_arrays, METH_VARARGS,
     "memmove_arrays(dst, src, sizes): memmove for three int64 arrays of one length, GIL released."},
    {"prefix_values", prefix_values, METH_VARARGS,
     "prefix_values(mapping, keys) -> [mapping[k] for the keys before the first one absent (or mapped to None)]."},
    {"attr_values", attr_values, METH_VARARGS,
     "attr_values(mapping, keys, name, default) -> [getattr(mapping[k], name), or default where k is absent]."},
    {"prefix_run", prefix_run, METH_VARARGS,
     "prefix_run(masks, prefix) -> how many of masks, from the first, hold every bit of prefix (below 2**63)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstrata._native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
