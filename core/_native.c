/* kvstrata._native: the two hot loops of kvstrata in C (optional; kvstrata falls back to Python).
 *
 * chain_xxh3_128(data, row_len, parent) -> list[bytes]
 *     key[i] = XXH3-128(key[i-1] || row[i]) over the rows of a contiguous buffer, key[-1] = parent;
 *     bit-exact with xxhash.xxh3_128_digest(parent + row) chained (seed 0, default secret).
 * memmove_runs(runs, start=0, stop=len(runs)) -> None
 *     memmove(dst, src, size) for each (dst, src, size) tuple of runs[start:stop], without the GIL.
 * memmove_arrays(dst, src, sizes) -> None
 *     The same for three int64 buffers of one length.
 * xxh3_64_intdigest(data) / stage_in(...) / stage_out(...) / hash_records(...) / pwritev_all(...)
 *     The nvme tier's records: XXH3-64 checksums, a staging chunk's copies and checks, and the
 *     checksums and the gathered write of records written straight from the caller's memory.
 * record_addresses(...) / preadv_all(...) / hash_at(...)
 *     Records read straight into the caller's memory: their addresses, the scattered read, the checks.
 * prefix_values(mapping, keys) / attr_values(mapping, keys, name, default) / prefix_run(masks, prefix)
 *     The inner loops of a lookup (kvstrata.engine.placement, kvstrata.engine.perlayer).
 *
 * XXH3-128 is written here from the public description of the algorithm (doc/xxhash_spec.md of
 * the xxHash project): the constants and the default secret are the ones the specification
 * gives; the code is our own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <sys/uio.h>
#include <pthread.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

/* The accumulator's eight lanes and the two steps on them, on SSE2 where the CPU has it (every
 * x86-64 CPU does: no runtime dispatch; two lanes a register), else in scalar C (~12 GB/s here
 * against ~26 on SSE2, which bounds an nvme read's checksums). */
#if defined(__SSE2__) && !(defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__)
typedef struct {
    __m128i v[4];
} lanes_t;

static inline void lanes_load(lanes_t *a, const u64 acc[8]) {
    for (int i = 0; i < 4; i++) {
        a->v[i] = _mm_loadu_si128((const __m128i *)(const void *)(acc + 2 * i));
    }
}

static inline void lanes_store(const lanes_t *a, u64 acc[8]) {
    for (int i = 0; i < 4; i++) {
        _mm_storeu_si128((__m128i *)(void *)(acc + 2 * i), a->v[i]);
    }
}

static inline void accumulate(lanes_t *a, const uint8_t *stripe, const uint8_t *sec) {
    for (int i = 0; i < 4; i++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(const void *)(stripe + 16 * i));
        __m128i v = _mm_xor_si128(x, _mm_loadu_si128((const __m128i *)(const void *)(sec + 16 * i)));
        __m128i hi = _mm_shuffle_epi32(v, _MM_SHUFFLE(0, 3, 0, 1)); /* each lane's high half, low */
        __m128i swapped = _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 3, 2)); /* acc[i ^ 1] += x */
        a->v[i] = _mm_add_epi64(_mm_mul_epu32(v, hi), _mm_add_epi64(a->v[i], swapped));
    }
}

static inline void scramble(lanes_t *a) {
    const uint8_t *sec = SECRET + SECRET_LEN - STRIPE;
    const __m128i prime = _mm_set1_epi32((int)P32_1);
    for (int i = 0; i < 4; i++) {
        __m128i v = _mm_xor_si128(a->v[i], _mm_srli_epi64(a->v[i], 47));
        v = _mm_xor_si128(v, _mm_loadu_si128((const __m128i *)(const void *)(sec + 16 * i)));
        __m128i hi = _mm_shuffle_epi32(v, _MM_SHUFFLE(0, 3, 0, 1));
        a->v[i] = _mm_add_epi64(_mm_mul_epu32(v, prime), _mm_slli_epi64(_mm_mul_epu32(hi, prime), 32));
    }
}
#else
typedef struct {
    u64 v[8];
} lanes_t;

static inline void lanes_load(lanes_t *a, const u64 acc[8]) { memcpy(a->v, acc, sizeof(a->v)); }

static inline void lanes_store(const lanes_t *a, u64 acc[8]) { memcpy(acc, a->v, sizeof(a->v)); }

static inline void accumulate(lanes_t *a, const uint8_t *stripe, const uint8_t *sec) {
    for (int i = 0; i < 8; i++) {
        u64 x = rd64(stripe + 8 * i);
        u64 v = x ^ rd64(sec + 8 * i);
        a->v[i ^ 1] += x;
        a->v[i] += (u64)(u32)v * (v >> 32);
    }
}

static inline void scramble(lanes_t *a) {
    const uint8_t *sec = SECRET + SECRET_LEN - STRIPE;
    for (int i = 0; i < 8; i++) {
        u64 x = a->v[i];
        x ^= x >> 47;
        x ^= rd64(sec + 8 * i);
        a->v[i] = x * P32_1;
    }
}
#endif

static u64 merge(const u64 acc[8], u64 init, const uint8_t *sec) {
    u64 r = init;
    for (int i = 0; i < 4; i++) {
        r += fold128(acc[2 * i] ^ rd64(sec + 16 * i), acc[2 * i + 1] ^ rd64(sec + 16 * i + 8));
    }
    return avalanche3(r);
}

static void large_acc(const uint8_t *in, size_t len, u64 acc[8]) {
    static const u64 init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    lanes_t a;
    lanes_load(&a, init);
    size_t blocks = (len - 1) / BLOCK_LEN; /* the last block (1..BLOCK_LEN bytes) is left for below */
    const uint8_t *p = in;
    for (size_t b = 0; b < blocks; b++, p += BLOCK_LEN) {
        for (int n = 0; n < STRIPES_PER_BLOCK; n++) {
            accumulate(&a, p + n * STRIPE, SECRET + n * 8);
        }
        scramble(&a);
    }
    size_t rest = len - blocks * BLOCK_LEN;
    size_t stripes = (rest - 1) / STRIPE;
    for (size_t n = 0; n < stripes; n++) {
        accumulate(&a, p + n * STRIPE, SECRET + n * 8);
    }
    accumulate(&a, in + len - STRIPE, SECRET + SECRET_LEN - 71);
    lanes_store(&a, acc);
}

static void h_large(const uint8_t *in, size_t len, u64 *lo, u64 *hi) {
    u64 acc[8];
    large_acc(in, len, acc);
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

/* ---- XXH3-64 (seed 0): the records' checksum, bit-exact with xxhash.xxh3_64_intdigest ------- */
/* Over 240 bytes it is the low half of XXH3-128 (the same accumulation and merge); the short
 * paths are the specification's own for the 64-bit variant. */

static inline u64 rrmxmx(u64 h, u64 len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= PMX2;
    h ^= (h >> 35) + len;
    h *= PMX2;
    return h ^ (h >> 28);
}

static u64 xxh3_64(const uint8_t *in, size_t len) {
    if (len > 240) {
        u64 acc[8];
        large_acc(in, len, acc);
        return merge(acc, (u64)len * P64_1, SECRET + 11);
    }
    if (len > 128) {
        u64 acc = (u64)len * P64_1;
        size_t rounds = len / 16;
        for (size_t i = 0; i < 8; i++) {
            acc += mix16(in + 16 * i, SECRET + 16 * i, 0);
        }
        acc = avalanche3(acc);
        for (size_t i = 8; i < rounds; i++) {
            acc += mix16(in + 16 * i, SECRET + 16 * (i - 8) + 3, 0);
        }
        acc += mix16(in + len - 16, SECRET + 136 - 17, 0);
        return avalanche3(acc);
    }
    if (len > 16) {
        u64 acc = (u64)len * P64_1;
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += mix16(in + 48, SECRET + 96, 0);
                    acc += mix16(in + len - 64, SECRET + 112, 0);
                }
                acc += mix16(in + 32, SECRET + 64, 0);
                acc += mix16(in + len - 48, SECRET + 80, 0);
            }
            acc += mix16(in + 16, SECRET + 32, 0);
            acc += mix16(in + len - 32, SECRET + 48, 0);
        }
        acc += mix16(in, SECRET, 0);
        acc += mix16(in + len - 16, SECRET + 16, 0);
        return avalanche3(acc);
    }
    if (len > 8) {
        u64 lo = rd64(in) ^ (rd64(SECRET + 24) ^ rd64(SECRET + 32));
        u64 hi = rd64(in + len - 8) ^ (rd64(SECRET + 40) ^ rd64(SECRET + 48));
        return avalanche3((u64)len + swap64(lo) + hi + fold128(lo, hi));
    }
    if (len >= 4) {
        u64 v = (u64)rd32(in + len - 4) + ((u64)rd32(in) << 32);
        return rrmxmx(v ^ (rd64(SECRET + 8) ^ rd64(SECRET + 16)), (u64)len);
    }
    if (len > 0) {
        u32 combined = ((u32)in[0] << 16) | ((u32)in[len >> 1] << 24) | (u32)in[len - 1] | ((u32)len << 8);
        return avalanche64((u64)combined ^ (u64)(rd32(SECRET) ^ rd32(SECRET + 4)));
    }
    return avalanche64(rd64(SECRET + 56) ^ rd64(SECRET + 64));
}

static PyObject *xxh3_64_intdigest(PyObject *self, PyObject *arg) {
    Py_buffer data;
    (void)self;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    u64 h = xxh3_64((const uint8_t *)data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
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

/* glibc copies sizes from its rep_movsb_threshold (2 KiB and up) to its rep_movsb_stop_threshold
 * (on AMD: the L2 cache of a core) with ``rep movsb``, which runs 5-8x slower (AMD EPYC here: 2-3
 * GB/s against 14-20) when the destination lies 1-31 bytes past the source modulo a page (4K
 * aliasing). That is every load out of a page-aligned slot into a numpy array that malloc put 16
 * bytes into a page, at the sizes a DRAM tier's runs have (a layer's rows of 1 KiB layer-blocks:
 * 256 KiB), and every read of a record out of a staging buffer into one. Such copies take a loop
 * of 64-byte moves instead (13-14 GB/s there); the rest, and overlapping ones, stay glibc's. */
#define ALIAS_MIN 2048
static size_t alias_max = 1 << 20; /* the L2 cache of a core, read at import (sysconf) */

#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-loop-distribute-patterns")))
#endif
static void copy_vec(uint8_t *d, const uint8_t *s, size_t n) {
    /* a copy loop of 64-byte moves (never turned back into a memcpy call) */
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        uint8_t t[64];
        memcpy(t, s + i, 64);
        memcpy(d + i, t, 64);
    }
    if (i < n) {
        memcpy(d + i, s + i, n - i);
    }
}

/* Copies of at least STREAM_MIN bytes use non-temporal stores (SSE2): the destination is memory no
 * cache holds and the CPU does not read next (a tier's slot; a KV cache a restore fills; a record out
 * of a staging buffer), and skipping the read-for-ownership of every destination line is most of a
 * copy into such memory. On this project's VM: 8 MiB batches into a 16 MiB region 16.0 -> 19.7
 * GB/s, 256 MiB batches 8.3 -> 13.4; 64 KiB records out of a cold staging buffer 12.6 -> 17. glibc
 * streams only above ~3/4 of the L3 cache it reports (256 MiB here: never, for a tier's copies).
 * A caller of stream_bytes ends with STREAM_FENCE before it tells anyone the bytes are there. */
#if defined(__SSE2__)
#define STREAM 1
#define STREAM_FENCE() _mm_sfence()
#else
#define STREAM 0
#define STREAM_FENCE() ((void)0)
#endif
#define STREAM_MIN (32 * 1024)

static void stream_bytes(uint8_t *d, const uint8_t *s, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)d & 15)) & 15; /* streaming stores want 16-byte aligned addresses */
    if (head > n) {
        head = n;
    }
    memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 48));
        _mm_stream_si128((__m128i *)(void *)(d + i), a);
        _mm_stream_si128((__m128i *)(void *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(void *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(void *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
#else
    memcpy(d, s, n);
#endif
}

/* whether glibc's copy of n bytes src -> dst would be the slow case above */
static inline int aliased_copy(const void *dst, const void *src, size_t n) {
    size_t rel = (size_t)((uintptr_t)dst - (uintptr_t)src) & 4095;
    return rel > 0 && rel < 32 && n > ALIAS_MIN && n < alias_max;
}

/* memmove: streamed from STREAM_MIN up, around glibc's slow case below that; overlapping copies
 * stay memmove's. The caller ends with STREAM_FENCE. */
static inline void move_bytes(void *dst, const void *src, size_t n) {
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    if (d < s + n && s < d + n) {
        memmove(dst, src, n);
    } else if (STREAM && n >= STREAM_MIN) {
        stream_bytes((uint8_t *)dst, (const uint8_t *)src, n);
    } else if (aliased_copy(dst, src, n)) {
        copy_vec((uint8_t *)dst, (const uint8_t *)src, n);
    } else {
        memcpy(dst, src, n);
    }
}


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
        move_bytes(todo[0].dst, todo[0].src, todo[0].size);
    } else {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++) {
            move_bytes(todo[i].dst, todo[i].src, todo[i].size);
        }
        STREAM_FENCE(); /* the streamed stores are visible before the caller hears the copy is done */
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
        move_bytes((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)k[i]);
    }
    STREAM_FENCE();
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&vd);
    PyBuffer_Release(&vs);
    PyBuffer_Release(&vk);
    return ret;
}

/* ---- stage_in / stage_out: a chunk's records into or out of a staging buffer ------------------ */
/*
 * The nvme tier's per-record work for one staging chunk in one call, without the GIL: copy each
 * record in (zeroing its padding) and take its xxh3_64, or check each record's xxh3_64 and copy
 * the intact ones out. A record is a Python object per item: a (address, size) host span or a
 * C-contiguous buffer (numpy array, memoryview) of exactly its length.
 */

static inline void copy_record_bytes(uint8_t *d, const uint8_t *s, size_t n) {
    /* records never overlap: memcpy, around its slow case (see move_bytes) */
    if (aliased_copy(d, s, n)) {
        copy_vec(d, s, n);
    } else {
        memcpy(d, s, n);
    }
}

static void copy_out_bytes(uint8_t *d, const uint8_t *s, size_t n) {
    /* a record out of a staging buffer: streamed from STREAM_MIN up (see stream_bytes) */
    if (STREAM && n >= STREAM_MIN) {
        stream_bytes(d, s, n);
    } else {
        copy_record_bytes(d, s, n);
    }
}

typedef struct {
    Py_buffer stage, offsets, lengths, extra, sums;
    int has_extra, has_sums;
    PyObject *seq;
    Py_buffer *views; /* one per record; .obj NULL where the record is a span */
    uint8_t **addr;
    Py_ssize_t n;
} staging_t;

static int u64_view(PyObject *obj, const char *name, Py_buffer *view, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        return -1;
    }
    if (view->itemsize != 8) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous array of 8-byte items, got format %s", name,
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void staging_release(staging_t *st) {
    if (st->views != NULL) {
        for (Py_ssize_t i = 0; i < st->n; i++) {
            if (st->views[i].obj != NULL) {
                PyBuffer_Release(&st->views[i]);
            }
        }
        PyMem_Free(st->views);
    }
    PyMem_Free(st->addr);
    Py_XDECREF(st->seq);
    if (st->stage.obj) PyBuffer_Release(&st->stage);
    if (st->offsets.obj) PyBuffer_Release(&st->offsets);
    if (st->lengths.obj) PyBuffer_Release(&st->lengths);
    if (st->has_extra) PyBuffer_Release(&st->extra);
    if (st->has_sums) PyBuffer_Release(&st->sums);
}

/* the arrays of a call, checked: records [off, off + len (+ pad)) inside the stage */
static int staging_open(staging_t *st, PyObject *stage, PyObject *offsets, PyObject *bufs, PyObject *lengths,
                        PyObject *extra, const char *extra_name, PyObject *sums, int sums_writable, int pad) {
    memset(st, 0, sizeof(*st));
    if (PyObject_GetBuffer(stage, &st->stage, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        return -1;
    }
    if (int64_view(offsets, "offsets", &st->offsets) < 0 || int64_view(lengths, "lengths", &st->lengths) < 0) {
        return -1;
    }
    if (extra != Py_None) {
        if (u64_view(extra, extra_name, &st->extra, 0) < 0) {
            return -1;
        }
        st->has_extra = 1;
    }
    if (sums != Py_None) {
        if (u64_view(sums, "sums", &st->sums, sums_writable) < 0) {
            return -1;
        }
        st->has_sums = 1;
    }
    st->seq = PySequence_Fast(bufs, "bufs must be a sequence");
    if (st->seq == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(st->seq);
    if (st->offsets.len / 8 != n || st->lengths.len / 8 != n || (st->has_extra && st->extra.len / 8 != n) ||
        (st->has_sums && st->sums.len / 8 != n)) {
        PyErr_Format(PyExc_ValueError, "%zd records but %zd offsets, %zd lengths%s", n, st->offsets.len / 8,
                     st->lengths.len / 8, (st->has_extra || st->has_sums) ? " (or another array of another length)" : "");
        return -1;
    }
    const int64_t *o = st->offsets.buf, *k = st->lengths.buf;
    const int64_t *e = st->has_extra && pad ? st->extra.buf : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t end = e != NULL ? e[i] : k[i];
        if (o[i] < 0 || k[i] < 0 || end < k[i] || o[i] + end > (int64_t)st->stage.len) {
            PyErr_Format(PyExc_ValueError, "record %zd: offset %lld, length %lld (extent %lld) is outside a stage of %zd bytes",
                         i, (long long)o[i], (long long)k[i], (long long)end, st->stage.len);
            return -1;
        }
    }
    st->n = n;
    if ((st->views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer))) == NULL ||
        (st->addr = PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint8_t *))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* the address of record i's caller memory, or NULL (error set) when it is not n bytes of host memory */
static uint8_t *record_address(staging_t *st, Py_ssize_t i, int writable) {
    PyObject *item = PySequence_Fast_ITEMS(st->seq)[i];
    int64_t want = ((const int64_t *)st->lengths.buf)[i];
    if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2) {
        void *a;
        if (as_address(PyTuple_GET_ITEM(item, 0), "address", i, &a) < 0) {
            return NULL;
        }
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 1));
        if (size == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (size != want) {
            PyErr_Format(PyExc_ValueError, "record %zd: a span of %zd bytes for a record of %lld", i, size, (long long)want);
            return NULL;
        }
        return (uint8_t *)a;
    }
    if (PyObject_GetBuffer(item, &st->views[i], PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        st->views[i].obj = NULL;
        return NULL;
    }
    if (st->views[i].len != want) {
        PyErr_Format(PyExc_ValueError, "record %zd: a buffer of %zd bytes for a record of %lld", i, st->views[i].len,
                     (long long)want);
        return NULL;
    }
    return (uint8_t *)st->views[i].buf;
}

static PyObject *stage_in(PyObject *self, PyObject *args) {
    PyObject *stage, *offsets, *bufs, *lengths, *extents, *sums;
    staging_t st;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOO:stage_in", &stage, &offsets, &bufs, &lengths, &extents, &sums)) {
        return NULL;
    }
    PyObject *ret = NULL;
    if (staging_open(&st, stage, offsets, bufs, lengths, extents, "extents", sums, 1, 1) < 0) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < st.n; i++) {
        if ((st.addr[i] = record_address(&st, i, 0)) == NULL) {
            goto done;
        }
    }
    {
        uint8_t *base = st.stage.buf;
        const int64_t *o = st.offsets.buf, *k = st.lengths.buf;
        const int64_t *e = st.has_extra ? st.extra.buf : NULL;
        uint64_t *h = st.has_sums ? st.sums.buf : NULL;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < st.n; i++) {
            uint8_t *d = base + o[i];
            copy_record_bytes(d, st.addr[i], (size_t)k[i]);
            if (e != NULL && e[i] > k[i]) {
                memset(d + k[i], 0, (size_t)(e[i] - k[i]));
            }
            if (h != NULL) {
                h[i] = xxh3_64(d, (size_t)k[i]);
            }
        }
        Py_END_ALLOW_THREADS
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    staging_release(&st);
    return ret;
}

/* hash_records(bufs, lengths, sums, addrs, align=0): the XXH3-64 of each record (a buffer or an
 * (address, size) span of host memory, exactly lengths[i] bytes) into sums, its address into addrs;
 * the hashing without the GIL. With align > 0, nothing is hashed unless every address is a
 * multiple of align: returns whether it hashed. ValueError/TypeError for a record that is not
 * such host memory. */
static PyObject *hash_records(PyObject *self, PyObject *args) {
    PyObject *bufs, *lengths, *sums, *addrs;
    Py_ssize_t align = 0;
    staging_t st;
    Py_buffer vaddrs = {0};
    (void)self;
    memset(&st, 0, sizeof(st));
    if (!PyArg_ParseTuple(args, "OOOO|n:hash_records", &bufs, &lengths, &sums, &addrs, &align)) {
        return NULL;
    }
    PyObject *ret = NULL;
    if (int64_view(lengths, "lengths", &st.lengths) < 0) {
        goto done;
    }
    if (u64_view(sums, "sums", &st.sums, 1) < 0) {
        goto done;
    }
    st.has_sums = 1;
    if (u64_view(addrs, "addrs", &vaddrs, 1) < 0) {
        vaddrs.obj = NULL;
        goto done;
    }
    if ((st.seq = PySequence_Fast(bufs, "bufs must be a sequence")) == NULL) {
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(st.seq);
    if (st.lengths.len / 8 != n || st.sums.len / 8 != n || vaddrs.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%zd records but %zd lengths, %zd sums, %zd addrs", n, st.lengths.len / 8,
                     st.sums.len / 8, vaddrs.len / 8);
        goto done;
    }
    st.n = n;
    if ((st.views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer))) == NULL ||
        (st.addr = PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint8_t *))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((st.addr[i] = record_address(&st, i, 0)) == NULL) {
            goto done;
        }
        if (align > 0 && (uintptr_t)st.addr[i] % (uintptr_t)align != 0) {
            ret = Py_False;
            Py_INCREF(ret);
            goto done;
        }
    }
    {
        const int64_t *k = st.lengths.buf;
        uint64_t *h = st.sums.buf, *a = vaddrs.buf;
        uint8_t **addr = st.addr;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            a[i] = (uint64_t)(uintptr_t)addr[i];
            h[i] = xxh3_64(addr[i], (size_t)k[i]);
        }
        Py_END_ALLOW_THREADS
    }
    ret = Py_True;
    Py_INCREF(ret);
done:
    if (vaddrs.obj != NULL) {
        PyBuffer_Release(&vaddrs);
    }
    staging_release(&st);
    return ret;
}


/* record_addresses(bufs, lengths, addrs, align): the address of each record that is writable host
 * memory of exactly lengths[i] bytes (a buffer or an (address, size) span) at a multiple of align
 * into addrs (uint64), 0 for any other (no error: the caller stages those). Returns how many were
 * taken. */
static PyObject *record_addresses(PyObject *self, PyObject *args) {
    PyObject *bufs, *lengths, *addrs;
    Py_ssize_t align = 1;
    staging_t st;
    Py_buffer va = {0};
    (void)self;
    memset(&st, 0, sizeof(st));
    if (!PyArg_ParseTuple(args, "OOOn:record_addresses", &bufs, &lengths, &addrs, &align)) {
        return NULL;
    }
    PyObject *ret = NULL;
    if (align < 1) {
        PyErr_Format(PyExc_ValueError, "align %zd: must be at least 1", align);
        return NULL;
    }
    if (int64_view(lengths, "lengths", &st.lengths) < 0) {
        st.lengths.obj = NULL;
        goto done;
    }
    if (u64_view(addrs, "addrs", &va, 1) < 0) {
        va.obj = NULL;
        goto done;
    }
    if ((st.seq = PySequence_Fast(bufs, "bufs must be a sequence")) == NULL) {
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(st.seq);
    if (st.lengths.len / 8 != n || va.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%zd records but %zd lengths, %zd addrs", n, st.lengths.len / 8, va.len / 8);
        goto done;
    }
    st.n = n;
    if ((st.views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *a = va.buf;
    Py_ssize_t taken = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t *p = record_address(&st, i, 1);
        if (p == NULL) {
            PyErr_Clear();
        }
        a[i] = (p != NULL && (uintptr_t)p % (uintptr_t)align == 0) ? (uint64_t)(uintptr_t)p : 0;
        taken += a[i] != 0;
    }
    ret = PyLong_FromSsize_t(taken);
done:
    if (va.obj != NULL) {
        PyBuffer_Release(&va);
    }
    staging_release(&st);
    return ret;
}

/* The pieces of preadv_all/pwritev_all: addrs (uint64) and lengths (int64) of one length, every
 * length at least 0 and every address nonzero, from an offset of at least 0. Returns the count, -1
 * with an error set; pieces_release releases the views either way. */
static Py_ssize_t pieces_open(PyObject *addrs, PyObject *lengths, long long offset, Py_buffer *va, Py_buffer *vl) {
    va->obj = vl->obj = NULL;
    if (u64_view(addrs, "addrs", va, 0) < 0) {
        va->obj = NULL;
        return -1;
    }
    if (int64_view(lengths, "lengths", vl) < 0) {
        vl->obj = NULL;
        return -1;
    }
    Py_ssize_t n = va->len / 8;
    if (vl->len / 8 != n || offset < 0) {
        PyErr_Format(PyExc_ValueError, "%zd addresses but %zd lengths (offset %lld)", n, vl->len / 8, offset);
        return -1;
    }
    const uint64_t *a = va->buf;
    const int64_t *k = vl->buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (k[i] < 0 || a[i] == 0) {
            PyErr_Format(PyExc_ValueError, "piece %zd: length %lld at address %llu", i, (long long)k[i],
                         (unsigned long long)a[i]);
            return -1;
        }
    }
    return n;
}

static void pieces_release(Py_buffer *va, Py_buffer *vl) {
    if (va->obj != NULL) {
        PyBuffer_Release(va);
    }
    if (vl->obj != NULL) {
        PyBuffer_Release(vl);
    }
}

/* Write (read) the pieces one after another from offset, in pwritev (preadv) calls of at most 64
 * pieces and again after a short one; call without the GIL. Returns the bytes moved. *err: an
 * errno for a failed write or a write that moves nothing, and for a read that fails before any
 * byte came; a read stops where the file ends (a read returns nothing) or where a read after a
 * short one fails (O_DIRECT refuses to go on from an unaligned end), with *err 0. */
static long long pieces_io(int fd, const uint64_t *a, const int64_t *k, Py_ssize_t n, long long offset, int write,
                           int *err) {
    struct iovec iov[64];
    Py_ssize_t i = 0;
    size_t skip = 0; /* bytes of piece i already moved */
    long long total = 0;
    *err = 0;
    while (i < n) {
        int cnt = 0;
        for (Py_ssize_t j = i; j < n && cnt < 64; j++, cnt++) {
            size_t from = j == i ? skip : 0;
            iov[cnt].iov_base = (void *)(uintptr_t)(a[j] + from);
            iov[cnt].iov_len = (size_t)k[j] - from;
        }
        off_t pos = (off_t)(offset + total);
        ssize_t r = write ? pwritev(fd, iov, cnt, pos) : preadv(fd, iov, cnt, pos);
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (write || total == 0) {
                *err = errno;
            }
            break;
        }
        if (r == 0) {
            if (write) {
                *err = EIO;
            }
            break;
        }
        total += r;
        size_t left = (size_t)r;
        while (i < n && left >= (size_t)k[i] - skip) { /* pieces moved whole */
            left -= (size_t)k[i] - skip;
            skip = 0;
            i++;
        }
        skip += left;
    }
    return total;
}

/* preadv_all (write 0: the bytes read) and pwritev_all (write 1: None), one body */
static PyObject *pieces_call(PyObject *args, int write) {
    int fd;
    long long offset;
    PyObject *addrs, *lengths;
    Py_buffer va = {0}, vl = {0};
    if (!PyArg_ParseTuple(args, write ? "iOOL:pwritev_all" : "iOOL:preadv_all", &fd, &addrs, &lengths, &offset)) {
        return NULL;
    }
    PyObject *ret = NULL;
    Py_ssize_t n = pieces_open(addrs, lengths, offset, &va, &vl);
    if (n < 0) {
        goto done;
    }
    const uint64_t *a = va.buf;
    const int64_t *k = vl.buf;
    int err = 0;
    long long total;
    Py_BEGIN_ALLOW_THREADS
    total = pieces_io(fd, a, k, n, offset, write, &err);
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (write) {
        ret = Py_None;
        Py_INCREF(ret);
    } else {
        ret = PyLong_FromLongLong(total);
    }
done:
    pieces_release(&va, &vl);
    return ret;
}

/* preadv_all(fd, addrs, lengths, offset) -> bytes read: fill the pieces at addrs (lengths[i] bytes
 * each) one after another from fd at offset, in preadv calls of at most 64 pieces and again after a
 * short read, without the GIL; fewer bytes where the file ends (a read returns nothing) or a read
 * after a short one fails (O_DIRECT refuses to go on from an unaligned end). OSError for an error
 * before anything was read. The caller keeps the memory alive for the call. */
static PyObject *preadv_all(PyObject *self, PyObject *args) {
    (void)self;
    return pieces_call(args, 0);
}

/* hash_at(addrs, lengths, sums): the XXH3-64 of the memory at each of addrs (lengths[i] bytes) into
 * sums, without the GIL. The caller keeps that memory alive for the call. */
static PyObject *hash_at(PyObject *self, PyObject *args) {
    PyObject *addrs, *lengths, *sums;
    Py_buffer va = {0}, vl = {0}, vs = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO:hash_at", &addrs, &lengths, &sums)) {
        return NULL;
    }
    PyObject *ret = NULL;
    if (u64_view(addrs, "addrs", &va, 0) < 0) {
        va.obj = NULL;
        goto done;
    }
    if (int64_view(lengths, "lengths", &vl) < 0) {
        vl.obj = NULL;
        goto done;
    }
    if (u64_view(sums, "sums", &vs, 1) < 0) {
        vs.obj = NULL;
        goto done;
    }
    Py_ssize_t n = va.len / 8;
    if (vl.len / 8 != n || vs.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%zd addresses but %zd lengths, %zd sums", n, vl.len / 8, vs.len / 8);
        goto done;
    }
    {
        const uint64_t *a = va.buf;
        const int64_t *k = vl.buf;
        uint64_t *h = vs.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (k[i] < 0 || a[i] == 0) {
                PyErr_Format(PyExc_ValueError, "record %zd: length %lld at address %llu", i, (long long)k[i],
                             (unsigned long long)a[i]);
                goto done;
            }
        }
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            h[i] = xxh3_64((const uint8_t *)(uintptr_t)a[i], (size_t)k[i]);
        }
        Py_END_ALLOW_THREADS
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    if (va.obj != NULL) {
        PyBuffer_Release(&va);
    }
    if (vl.obj != NULL) {
        PyBuffer_Release(&vl);
    }
    if (vs.obj != NULL) {
        PyBuffer_Release(&vs);
    }
    return ret;
}

/* pwritev_all(fd, addrs, lengths, offset): write the memory at addrs[i] (lengths[i] bytes each),
 * one after another, to fd from offset, in pwritev calls of at most 64 pieces and again after
 * a short write, without the GIL. The caller keeps the memory alive for the call. OSError. */
static PyObject *pwritev_all(PyObject *self, PyObject *args) {
    (void)self;
    return pieces_call(args, 1);
}

static PyObject *stage_out(PyObject *self, PyObject *args) {
    PyObject *stage, *offsets, *bufs, *lengths, *expect, *status;
    staging_t st;
    Py_buffer vstatus = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOO:stage_out", &stage, &offsets, &bufs, &lengths, &expect, &status)) {
        return NULL;
    }
    PyObject *ret = NULL;
    if (staging_open(&st, stage, offsets, bufs, lengths, expect, "expect", Py_None, 0, 0) < 0) {
        goto done;
    }
    if (PyObject_GetBuffer(status, &vstatus, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        vstatus.obj = NULL;
        goto done;
    }
    if (vstatus.len != st.n) {
        PyErr_Format(PyExc_ValueError, "status must hold %zd bytes, got %zd", st.n, vstatus.len);
        goto done;
    }
    uint8_t *out = vstatus.buf;
    for (Py_ssize_t i = 0; i < st.n; i++) { /* a destination that is not host memory of its size: 2 */
        if ((st.addr[i] = record_address(&st, i, 1)) == NULL) {
            PyErr_Clear();
            out[i] = 2;
        } else {
            out[i] = 1;
        }
    }
    {
        const uint8_t *base = st.stage.buf;
        const int64_t *o = st.offsets.buf, *k = st.lengths.buf;
        const uint64_t *want = st.has_extra ? st.extra.buf : NULL;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < st.n; i++) {
            const uint8_t *s = base + o[i];
            if (want != NULL && xxh3_64(s, (size_t)k[i]) != want[i]) {
                out[i] = 0; /* corrupt: never copied out */
            } else if (out[i] == 1) {
                copy_out_bytes(st.addr[i], s, (size_t)k[i]);
            }
        }
        STREAM_FENCE(); /* the streamed stores are visible before the caller hears the copy is done */
        Py_END_ALLOW_THREADS
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    if (vstatus.obj != NULL) {
        PyBuffer_Release(&vstatus);
    }
    staging_release(&st);
    return ret;
}

/* ---- KeyTable: a hash table of 16-byte keys ---------------------------------------------------- */
/*
 * The engine's "which tier serves this key" map (kvstrata.engine.state.best) with its probes in
 * C: a dict probed with a fresh bytes key first computes that key's SipHash (~18 ns, a third of a
 * 128K-token prompt's lookup), where a key here is already the output of a 128-bit hash. This table
 * hashes a key with one multiply of its two halves, each mixed with a per-process secret (a key
 * crafted to collide does not collide in another process), and probes linearly over open slots.
 * Values are ints 0 .. 2**31-1. Keys that are not 16-byte bytes live in a plain dict beside it, so
 * the table behaves as a dict for any key.
 */

#define KT_EMPTY 0
#define KT_USED 1
#define KT_DELETED 2

typedef struct {
    PyObject_HEAD
    uint8_t *keys;     /* cap x KEY_LEN */
    int32_t *vals;     /* cap */
    uint8_t *ctrl;     /* cap: KT_EMPTY, KT_USED or KT_DELETED */
    Py_ssize_t cap;    /* a power of two, or 0 before the first insert */
    Py_ssize_t used;   /* live entries */
    Py_ssize_t filled; /* live and deleted slots */
    PyObject *other;   /* dict of every key that is not 16-byte bytes; NULL until one comes */
} KeyTable;

static u64 kt_secret[2];

static inline u64 kt_hash(const uint8_t *k) {
    u64 lo, hi;
    mul128(rd64(k) ^ kt_secret[0], rd64(k + 8) ^ kt_secret[1], &lo, &hi);
    return lo ^ hi;
}

/* the slot holding k, or -1 */
static inline Py_ssize_t kt_find(const KeyTable *t, const uint8_t *k) {
    if (t->cap == 0) {
        return -1;
    }
    size_t mask = (size_t)t->cap - 1, i = (size_t)kt_hash(k) & mask;
    for (;;) {
        uint8_t c = t->ctrl[i];
        if (c == KT_EMPTY) {
            return -1;
        }
        if (c == KT_USED && memcmp(t->keys + i * KEY_LEN, k, KEY_LEN) == 0) {
            return (Py_ssize_t)i;
        }
        i = (i + 1) & mask;
    }
}

/* 1: a 16-byte bytes key (*raw set); 0: any other key (the dict beside the table holds it) */
static inline int kt_raw(PyObject *key, const uint8_t **raw) {
    if (PyBytes_Check(key) && PyBytes_GET_SIZE(key) == KEY_LEN) {
        *raw = (const uint8_t *)PyBytes_AS_STRING(key);
        return 1;
    }
    return 0;
}

/* free the table's arrays and take these (NULL and 0: empty); filled starts at used */
static void kt_install(KeyTable *t, uint8_t *keys, int32_t *vals, uint8_t *ctrl, Py_ssize_t cap) {
    PyMem_Free(t->keys);
    PyMem_Free(t->vals);
    PyMem_Free(t->ctrl);
    t->keys = keys;
    t->vals = vals;
    t->ctrl = ctrl;
    t->cap = cap;
    t->filled = t->used;
}

static int kt_resize(KeyTable *t, Py_ssize_t want) {
    Py_ssize_t cap = 8;
    while (cap < want) {
        if (cap > PY_SSIZE_T_MAX / 2 / KEY_LEN) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    uint8_t *keys = PyMem_Malloc((size_t)cap * KEY_LEN);
    int32_t *vals = PyMem_Malloc((size_t)cap * sizeof(int32_t));
    uint8_t *ctrl = PyMem_Calloc((size_t)cap, 1);
    if (keys == NULL || vals == NULL || ctrl == NULL) {
        PyMem_Free(keys);
        PyMem_Free(vals);
        PyMem_Free(ctrl);
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = (size_t)cap - 1;
    for (Py_ssize_t j = 0; j < t->cap; j++) {
        if (t->ctrl[j] != KT_USED) {
            continue;
        }
        const uint8_t *k = t->keys + j * KEY_LEN;
        size_t i = (size_t)kt_hash(k) & mask;
        while (ctrl[i] != KT_EMPTY) {
            i = (i + 1) & mask;
        }
        memcpy(keys + i * KEY_LEN, k, KEY_LEN);
        vals[i] = t->vals[j];
        ctrl[i] = KT_USED;
    }
    kt_install(t, keys, vals, ctrl, cap);
    return 0;
}

static int kt_value(PyObject *value, int32_t *out) {
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "a KeyTable value must be an int, got %R", value);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || v < 0 || v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "a KeyTable value must be in 0..2**31-1, got %R", value);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static int kt_set_raw(KeyTable *t, const uint8_t *k, int32_t v) {
    if ((t->filled + 1) * 3 > t->cap * 2 && kt_resize(t, (t->used + 1) * 2) < 0) { /* load <= 2/3 */
        return -1;
    }
    size_t mask = (size_t)t->cap - 1, i = (size_t)kt_hash(k) & mask;
    Py_ssize_t free_slot = -1;
    for (;;) {
        uint8_t c = t->ctrl[i];
        if (c == KT_EMPTY) {
            break;
        }
        if (c == KT_USED) {
            if (memcmp(t->keys + i * KEY_LEN, k, KEY_LEN) == 0) {
                t->vals[i] = v;
                return 0;
            }
        } else if (free_slot < 0) {
            free_slot = (Py_ssize_t)i;
        }
        i = (i + 1) & mask;
    }
    if (free_slot >= 0) {
        i = (size_t)free_slot; /* a deleted slot is reused: filled stays */
    } else {
        t->filled++;
    }
    memcpy(t->keys + i * KEY_LEN, k, KEY_LEN);
    t->vals[i] = v;
    t->ctrl[i] = KT_USED;
    t->used++;
    return 0;
}

/* value of key (a new reference), NULL without an error when absent */
static PyObject *kt_get(KeyTable *t, PyObject *key) {
    const uint8_t *k;
    if (kt_raw(key, &k)) {
        Py_ssize_t i = kt_find(t, k);
        return i < 0 ? NULL : PyLong_FromLong(t->vals[i]);
    }
    if (t->other == NULL) {
        (void)PyObject_Hash(key); /* absent; an unhashable key raises as in a dict */
        return NULL;
    }
    PyObject *v = PyDict_GetItemWithError(t->other, key);
    Py_XINCREF(v);
    return v;
}

static int kt_set(KeyTable *t, PyObject *key, PyObject *value) {
    int32_t v;
    if (kt_value(value, &v) < 0) {
        return -1;
    }
    const uint8_t *k;
    if (kt_raw(key, &k)) {
        return kt_set_raw(t, k, v);
    }
    if (t->other == NULL && (t->other = PyDict_New()) == NULL) {
        return -1;
    }
    return PyDict_SetItem(t->other, key, value);
}

/* 1 removed (*old set, a new reference, when old is not NULL), 0 absent, -1 error */
static int kt_remove(KeyTable *t, PyObject *key, PyObject **old) {
    const uint8_t *k;
    if (kt_raw(key, &k)) {
        Py_ssize_t i = kt_find(t, k);
        if (i < 0) {
            return 0;
        }
        if (old != NULL && (*old = PyLong_FromLong(t->vals[i])) == NULL) {
            return -1;
        }
        t->ctrl[i] = KT_DELETED;
        t->used--;
        return 1;
    }
    if (t->other == NULL) {
        return PyObject_Hash(key) == -1 ? -1 : 0;
    }
    PyObject *v = PyDict_GetItemWithError(t->other, key);
    if (v == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    if (old != NULL) {
        Py_INCREF(v);
        *old = v;
    }
    if (PyDict_DelItem(t->other, key) < 0) {
        if (old != NULL) {
            Py_CLEAR(*old);
        }
        return -1;
    }
    return 1;
}

static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if ((kwds != NULL && PyDict_GET_SIZE(kwds) != 0) || !PyArg_ParseTuple(args, ":KeyTable")) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "KeyTable() takes no arguments");
        }
        return NULL;
    }
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0);
    return (PyObject *)t; /* every field zero: an empty table */
}

static void KeyTable_dealloc(KeyTable *t) {
    kt_install(t, NULL, NULL, NULL, 0);
    Py_XDECREF(t->other);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t KeyTable_len(KeyTable *t) {
    return t->used + (t->other == NULL ? 0 : PyDict_GET_SIZE(t->other));
}

static PyObject *KeyTable_subscript(KeyTable *t, PyObject *key) {
    PyObject *v = kt_get(t, key);
    if (v == NULL && !PyErr_Occurred()) {
        PyErr_SetObject(PyExc_KeyError, key);
    }
    return v;
}

static int KeyTable_ass_subscript(KeyTable *t, PyObject *key, PyObject *value) {
    if (value != NULL) {
        return kt_set(t, key, value);
    }
    int r = kt_remove(t, key, NULL);
    if (r == 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    return r < 0 ? -1 : 0;
}

static int KeyTable_contains(KeyTable *t, PyObject *key) {
    PyObject *v = kt_get(t, key);
    if (v == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_DECREF(v);
    return 1;
}

static PyObject *KeyTable_get_method(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "get expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *v = kt_get(t, args[0]);
    if (v == NULL && !PyErr_Occurred()) {
        v = nargs == 2 ? args[1] : Py_None;
        Py_INCREF(v);
    }
    return v;
}

static PyObject *KeyTable_pop(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "pop expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *old = NULL;
    int r = kt_remove(t, args[0], &old);
    if (r < 0) {
        return NULL;
    }
    if (r == 1) {
        return old;
    }
    if (nargs == 2) {
        Py_INCREF(args[1]);
        return args[1];
    }
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *KeyTable_set_many(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "set_many expected 2 arguments (keys, value), got %zd", nargs);
        return NULL;
    }
    int32_t v;
    if (kt_value(args[1], &v) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *k;
        int r = kt_raw(items[i], &k) ? kt_set_raw(t, k, v) : kt_set(t, items[i], args[1]);
        if (r < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *KeyTable_clear(KeyTable *t, PyObject *unused) {
    (void)unused;
    t->used = 0;
    kt_install(t, NULL, NULL, NULL, 0);
    Py_CLEAR(t->other);
    Py_RETURN_NONE;
}

/* [(key, value)] of every entry: the table's keys as new bytes, then the others */
static PyObject *KeyTable_items(KeyTable *t, PyObject *unused) {
    (void)unused;
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        if (t->ctrl[i] != KT_USED) {
            continue;
        }
        PyObject *pair = Py_BuildValue("(y#l)", (const char *)(t->keys + i * KEY_LEN), (Py_ssize_t)KEY_LEN,
                                       (long)t->vals[i]);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    if (t->other != NULL) {
        PyObject *rest = PyDict_Items(t->other);
        Py_ssize_t end = PyList_GET_SIZE(out);
        if (rest == NULL || PyList_SetSlice(out, end, end, rest) < 0) {
            Py_XDECREF(rest);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(rest);
    }
    return out;
}

static PyObject *KeyTable_keys(KeyTable *t, PyObject *unused) {
    PyObject *items = KeyTable_items(t, unused);
    if (items == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    PyObject *out = PyList_New(n);
    if (out != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *k = PyTuple_GET_ITEM(PyList_GET_ITEM(items, i), 0);
            Py_INCREF(k);
            PyList_SET_ITEM(out, i, k);
        }
    }
    Py_DECREF(items);
    return out;
}

static PyObject *KeyTable_iter(KeyTable *t) {
    PyObject *keys = KeyTable_keys(t, NULL);
    if (keys == NULL) {
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *KeyTable_repr(KeyTable *t) {
    return PyUnicode_FromFormat("<KeyTable of %zd keys>", KeyTable_len(t));
}

static PyMappingMethods KeyTable_as_mapping = {
    (lenfunc)KeyTable_len,
    (binaryfunc)KeyTable_subscript,
    (objobjargproc)KeyTable_ass_subscript,
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_contains = (objobjproc)KeyTable_contains,
};

static PyMethodDef KeyTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyTable_get_method, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))KeyTable_pop, METH_FASTCALL, "pop(key[, default])"},
    {"set_many", (PyCFunction)(void (*)(void))KeyTable_set_many, METH_FASTCALL,
     "set_many(keys, value): table[k] = value for each of keys"},
    {"clear", (PyCFunction)KeyTable_clear, METH_NOARGS, "remove every entry"},
    {"items", (PyCFunction)KeyTable_items, METH_NOARGS, "a list of (key, value)"},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "a list of the keys"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstrata._native.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_repr = (reprfunc)KeyTable_repr,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_as_mapping = &KeyTable_as_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_iter = (getiterfunc)KeyTable_iter,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KeyTable(): a dict of 16-byte bytes keys to ints 0..2**31-1, probed in C (any other key "
              "is kept in a dict beside it).",
    .tp_methods = KeyTable_methods,
    .tp_new = KeyTable_new,
};

/* ---- Entry: what one tier's index holds of one block --------------------------------------------
 * The fields of kvstrata.engine.index.Entry (a dataclass where the extension is off), in a type the
 * cyclic garbage collector does not know: an index of 1M entries in a dict was visited whole by
 * every full collection (115 ms; with the entries untracked but still collector objects, the dict
 * stayed tracked and cost 47 ms). Values of such a type leave a dict of bytes or int keys untracked
 * altogether. Safe because nothing an entry holds (ints, a key) can lead back to an entry: no cycle
 * passes through one, and reference counting frees every entry. */
typedef struct {
    PyObject_HEAD
    /* every field an object member (T_OBJECT_EX), as __slots__ are: CPython 3.11+ specializes
     * reading and writing such a member as it does a slot (a T_LONGLONG member took 3.6x as long
     * to read, and slowed the planner's simulator by 5-12%) */
    PyObject *layers; /* int: bitmask of the layers present */
    PyObject *nbytes; /* int */
    PyObject *parent; /* the previous block's key, or None */
    PyObject *pins;   /* int */
    PyObject *doomed; /* bool: forgotten while pinned, delete its bytes at the last unpin */
} IndexEntry;

/* the five fields are read and written as an array from &layers on */
_Static_assert(offsetof(IndexEntry, doomed) == offsetof(IndexEntry, layers) + 4 * sizeof(PyObject *),
               "IndexEntry's fields must be consecutive object pointers");

static PyTypeObject IndexEntryType;

static PyObject *IndexEntry_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"layers", "nbytes", "parent", "pins", "doomed", NULL};
    PyObject *f[5] = {NULL, NULL, Py_None, NULL, Py_False};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|OOO:Entry", kwlist, &f[0], &f[1], &f[2], &f[3], &f[4])) {
        return NULL;
    }
    IndexEntry *self = (IndexEntry *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    PyObject **slots = &self->layers;
    for (int i = 0; i < 5; i++) {
        slots[i] = f[i] != NULL ? Py_NewRef(f[i]) : PyLong_FromLong(0); /* pins defaults to 0 */
        if (slots[i] == NULL) {
            Py_DECREF(self);
            return NULL;
        }
    }
    return (PyObject *)self;
}

static void IndexEntry_dealloc(IndexEntry *self) {
    PyObject **slots = &self->layers;
    for (int i = 0; i < 5; i++) {
        Py_XDECREF(slots[i]);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *IndexEntry_repr(IndexEntry *self) {
    return PyUnicode_FromFormat("Entry(layers=%R, nbytes=%R, parent=%R, pins=%R, doomed=%R)", self->layers,
                                self->nbytes, self->parent, self->pins, self->doomed);
}

static PyObject *IndexEntry_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(b) != &IndexEntryType) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject **x = &((IndexEntry *)a)->layers, **y = &((IndexEntry *)b)->layers;
    int same = 1;
    for (int i = 0; i < 5 && same > 0; i++) {
        if (x[i] == NULL || y[i] == NULL) {
            same = x[i] == y[i];
        } else {
            same = PyObject_RichCompareBool(x[i], y[i], Py_EQ);
        }
    }
    if (same < 0) {
        return NULL;
    }
    return PyBool_FromLong(op == Py_EQ ? same : !same);
}

static PyMemberDef IndexEntry_members[] = {
    {"layers", T_OBJECT_EX, offsetof(IndexEntry, layers), 0, "bitmask of the layers present"},
    {"nbytes", T_OBJECT_EX, offsetof(IndexEntry, nbytes), 0, "bytes held"},
    {"parent", T_OBJECT_EX, offsetof(IndexEntry, parent), 0, "the previous block's key, or None"},
    {"pins", T_OBJECT_EX, offsetof(IndexEntry, pins), 0, "pins held"},
    {"doomed", T_OBJECT_EX, offsetof(IndexEntry, doomed), 0,
     "forgotten while pinned: delete its bytes at the last unpin"},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef IndexEntry_methods[] = {
    {"__class_getitem__", Py_GenericAlias, METH_O | METH_CLASS, "Entry[K]: a generic alias (for annotations)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexEntryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstrata._native.Entry",
    .tp_basicsize = sizeof(IndexEntry),
    .tp_dealloc = (destructor)IndexEntry_dealloc,
    .tp_repr = (reprfunc)IndexEntry_repr,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_richcompare = IndexEntry_richcompare,
    .tp_flags = Py_TPFLAGS_DEFAULT, /* no Py_TPFLAGS_HAVE_GC: the point of this type */
    .tp_doc = "Entry(layers, nbytes, parent=None, pins=0, doomed=False): what one tier's index holds of one "
              "block, in a type the garbage collector does not track.",
    .tp_members = IndexEntry_members,
    .tp_methods = IndexEntry_methods,
    .tp_new = IndexEntry_new,
};

/* ---- lookup helpers ---------------------------------------------------------------------------- */

/* The opening of a function mapping a sequence to a list of the same length: ``obj`` as a fast
 * sequence (*seq, a new reference) and a new list of its length; NULL (error set, nothing held) on
 * failure. */
static PyObject *list_for(PyObject *obj, const char *what, PyObject **seq) {
    *seq = PySequence_Fast(obj, what);
    if (*seq == NULL) {
        return NULL;
    }
    PyObject *out = PyList_New(PySequence_Fast_GET_SIZE(*seq));
    if (out == NULL) {
        Py_CLEAR(*seq);
    }
    return out;
}

static PyObject *prefix_values(PyObject *self, PyObject *args) {
    PyObject *mapping, *keys;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO:prefix_values", &mapping, &keys)) {
        return NULL;
    }
    int table = Py_IS_TYPE(mapping, &KeyTableType);
    if (!table && !PyDict_Check(mapping)) {
        PyErr_Format(PyExc_TypeError, "prefix_values needs a dict or a KeyTable, got %.100s", Py_TYPE(mapping)->tp_name);
        return NULL;
    }
    PyObject *seq;
    PyObject *out = list_for(keys, "keys must be a sequence", &seq);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (table) { /* the probe in C, no Python hash: see KeyTable */
        KeyTable *t = (KeyTable *)mapping;
        for (; i < n; i++) {
            const uint8_t *k;
            PyObject *v;
            if (kt_raw(items[i], &k)) {
                Py_ssize_t at = kt_find(t, k);
                if (at < 0) {
                    break;
                }
                v = PyLong_FromLong(t->vals[at]);
            } else {
                v = kt_get(t, items[i]);
            }
            if (v == NULL) {
                if (PyErr_Occurred()) {
                    Py_DECREF(seq);
                    Py_DECREF(out);
                    return NULL;
                }
                break;
            }
            PyList_SET_ITEM(out, i, v);
        }
    }
    for (; !table && i < n; i++) {
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
    PyObject *seq;
    PyObject *out = list_for(keys, "keys must be a sequence", &seq);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
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

/* untrack_atoms(obj) -> bool: the garbage collector stops tracking obj, a tuple or a dict (or a dict
 * subclass without instance attributes), when nothing it holds can be tracked (objects of types it
 * never tracks, such as bytes, int and None, or tuples it has untracked); False (nothing done)
 * otherwise. CPython itself untracks such tuples and dicts, lazily, at a collection that examines
 * them; a dict is tracked again when a trackable key or value goes in. For containers that would
 * otherwise be walked by every full collection: the eviction policies' OrderedDicts of keys (~35 ms
 * per 1M keys; CPython leaves a dict subclass tracked from birth) and the nvme mirror's tuples
 * (each fresh one, tracked until a collection reaches it, had the mirror dict tracked again). */
static int may_be_tracked(PyObject *o) {
    if (!PyObject_IS_GC(o)) {
        return 0;
    }
    return PyTuple_CheckExact(o) ? PyObject_GC_IsTracked(o) : 1;
}

static PyObject *untrack_atoms(PyObject *self, PyObject *d) {
    (void)self;
    if (PyTuple_Check(d)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(d); i++) {
            if (may_be_tracked(PyTuple_GET_ITEM(d, i))) {
                Py_RETURN_FALSE;
            }
        }
    } else if (PyDict_Check(d)) {
        PyObject **attrs = _PyObject_GetDictPtr(d);
        if (attrs != NULL && *attrs != NULL && PyDict_GET_SIZE(*attrs) > 0) {
            Py_RETURN_FALSE;
        }
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(d, &pos, &key, &value)) {
            if (may_be_tracked(key) || may_be_tracked(value)) {
                Py_RETURN_FALSE;
            }
        }
    } else {
        PyErr_Format(PyExc_TypeError, "untrack_atoms needs a dict or a tuple, got %.200s", Py_TYPE(d)->tp_name);
        return NULL;
    }
    if (PyObject_GC_IsTracked(d)) {
        PyObject_GC_UnTrack(d);
    }
    Py_RETURN_TRUE;
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

/* buffer_spans(objs, write) -> per object (address, nbytes, rows) of a C-contiguous buffer (rows: its
 * first dimension, -1 below two dimensions), or None for one that exports no such buffer (a torch
 * tensor, a strided view, read-only for write). One call for a layer list: reading an array's address
 * from Python (__array_interface__) costs ~1.5 us, through the buffer protocol ~0.1 us. */
static PyObject *buffer_spans(PyObject *self, PyObject *args) {
    PyObject *objs;
    int write = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "Op:buffer_spans", &objs, &write)) {
        return NULL;
    }
    PyObject *seq;
    PyObject *out = list_for(objs, "buffer_spans() needs a sequence of buffers", &seq);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int flags = PyBUF_C_CONTIGUOUS | (write ? PyBUF_WRITABLE : 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer view;
        PyObject *item;
        if (!PyObject_CheckBuffer(items[i]) || PyObject_GetBuffer(items[i], &view, flags) != 0) {
            PyErr_Clear();
            item = Py_None;
            Py_INCREF(item);
        } else {
            Py_ssize_t rows = (view.ndim >= 2 && view.shape != NULL) ? view.shape[0] : -1;
            item = Py_BuildValue("(Nnn)", PyLong_FromVoidPtr(view.buf), view.len, rows);
            PyBuffer_Release(&view);
            if (item == NULL) {
                Py_DECREF(out);
                Py_DECREF(seq);
                return NULL;
            }
        }
        PyList_SET_ITEM(out, i, item);
    }
    Py_DECREF(seq);
    return out;
}

/* ---- RunReader: a read call's runs read, checked and copied out by threads that never take the GIL */
/*
 * The nvme tier's staged reads: each run (fd, file offset, length: whole pages) is read into one of
 * the caller's staging buffers, each of its records (file offset, length, xxh3_64, destination
 * address) is checked there and copied out. The threads are pthreads that take runs from a queue
 * under a mutex: a thread whose pread returned starts its check and copy, and the next run's pread
 * starts at once on another, with no GIL to wait for (the Python pipeline's threads each needed it
 * between runs, and waited for it while the caller planned the next runs of the same call). At most
 * `depth` preads are in flight. feed() adds runs while the threads read the earlier ones; finish()
 * waits for them (the GIL released) and returns each record's status: 1 copied, 2 corrupt (never
 * copied), 3 beyond the bytes read (a short read: a truncated file), 4 an I/O error; the caller
 * reads those records again its own way. The caller keeps the staging buffers and the destinations
 * alive until finish() returns.
 */

typedef struct {
    int64_t fd, off, len, rec0, nrec;
} rr_run;

typedef struct {
    uint64_t off, len, sum, dst;
} rr_rec;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rr_run *runs;
    rr_rec *recs;
    uint8_t *status;
    Py_ssize_t nruns, cap_runs, nrecs, cap_recs, next, done;
    int closed, stop, inflight, depth, nthreads, started;
    int most_inflight;     /* the most preads in flight at once */
    uint64_t threads_read; /* bit i: thread i read a run */
    pthread_t *threads;
    uint64_t *stages;
    int64_t stage_bytes;
} RunReader;

typedef struct {
    RunReader *r;
    int index;
} rr_arg;

static void rr_read_run(const rr_run *run, uint8_t *stage, int64_t *got_out, int *err_out) {
    int64_t got = 0;
    int err = 0;
    while (got < run->len) {
        ssize_t k = pread((int)run->fd, stage + got, (size_t)(run->len - got), (off_t)(run->off + got));
        if (k < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (got == 0) {
                err = errno ? errno : EIO;
            }
            break;
        }
        if (k == 0) {
            break;
        }
        got += k;
    }
    *got_out = got;
    *err_out = err;
}

static void *rr_worker(void *p) {
    rr_arg *arg = p;
    RunReader *r = arg->r;
    int index = arg->index;
    uint8_t *stage = (uint8_t *)(uintptr_t)r->stages[index];
    free(arg);
    rr_rec *recs = NULL;
    uint8_t *st = NULL;
    Py_ssize_t cap = 0;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && (r->next >= r->nruns || r->inflight >= r->depth) && !(r->closed && r->next >= r->nruns)) {
            pthread_cond_wait(&r->cv, &r->mu);
        }
        if (r->stop || r->next >= r->nruns) {
            break;
        }
        rr_run run = r->runs[r->next++];
        if (run.nrec > cap) {
            rr_rec *nr = realloc(recs, (size_t)run.nrec * sizeof(rr_rec));
            uint8_t *ns = realloc(st, (size_t)run.nrec);
            if (nr != NULL) {
                recs = nr;
            }
            if (ns != NULL) {
                st = ns;
            }
            if (nr == NULL || ns == NULL) { /* out of memory: its records are errors, the caller rereads them */
                memset(r->status + run.rec0, 4, (size_t)run.nrec);
                r->done++;
                pthread_cond_broadcast(&r->cv);
                continue;
            }
            cap = run.nrec;
        }
        memcpy(recs, r->recs + run.rec0, (size_t)run.nrec * sizeof(rr_rec));
        if (++r->inflight > r->most_inflight) {
            r->most_inflight = r->inflight;
        }
        r->threads_read |= (uint64_t)1 << index;
        pthread_mutex_unlock(&r->mu);

        int64_t got;
        int err;
        rr_read_run(&run, stage, &got, &err);
        pthread_mutex_lock(&r->mu);
        r->inflight--;
        pthread_cond_broadcast(&r->cv); /* a pread slot is free */
        pthread_mutex_unlock(&r->mu);

        for (Py_ssize_t i = 0; i < run.nrec; i++) {
            const rr_rec *c = &recs[i];
            uint64_t rel = c->off - (uint64_t)run.off;
            if (err) {
                st[i] = 4;
            } else if (rel + c->len > (uint64_t)got) {
                st[i] = 3;
            } else if (xxh3_64(stage + rel, (size_t)c->len) != c->sum) {
                st[i] = 2;
            } else {
                copy_out_bytes((uint8_t *)(uintptr_t)c->dst, stage + rel, (size_t)c->len);
                st[i] = 1;
            }
        }
        STREAM_FENCE(); /* the streamed stores are visible before the caller hears the run is done */
        pthread_mutex_lock(&r->mu);
        memcpy(r->status + run.rec0, st, (size_t)run.nrec);
        r->done++;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
    free(recs);
    free(st);
    return NULL;
}

static void rr_stop(RunReader *r) {
    if (!r->started) {
        return;
    }
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < r->nthreads; i++) {
        pthread_join(r->threads[i], NULL);
    }
    r->started = 0;
}

static void RunReader_dealloc(RunReader *r) {
    if (r->started) {
        Py_BEGIN_ALLOW_THREADS
        rr_stop(r); /* abandoned before finish(): no run starts, the threads' current ones end */
        Py_END_ALLOW_THREADS
    }
    if (r->threads != NULL) {
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->cv);
    }
    free(r->threads);
    free(r->stages);
    free(r->runs);
    free(r->recs);
    free(r->status);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *RunReader_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"stages", "stage_bytes", "depth", NULL};
    PyObject *stages;
    long long stage_bytes;
    int depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLi:RunReader", kwlist, &stages, &stage_bytes, &depth)) {
        return NULL;
    }
    if (depth < 1 || stage_bytes < 1) {
        PyErr_Format(PyExc_ValueError, "RunReader: depth (%d) and stage_bytes (%lld) must be at least 1", depth,
                     stage_bytes);
        return NULL;
    }
    Py_buffer vs;
    if (PyObject_GetBuffer(stages, &vs, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    Py_ssize_t n = vs.len / (Py_ssize_t)sizeof(uint64_t);
    if (vs.itemsize != 8 || n < 1 || n > 64) {
        PyBuffer_Release(&vs);
        PyErr_Format(PyExc_ValueError, "RunReader: stages must be 1 to 64 uint64 addresses, got %zd bytes", vs.len);
        return NULL;
    }
    RunReader *r = (RunReader *)type->tp_alloc(type, 0);
    if (r == NULL) {
        PyBuffer_Release(&vs);
        return NULL;
    }
    r->stages = malloc((size_t)n * sizeof(uint64_t));
    r->threads = calloc((size_t)n, sizeof(pthread_t));
    if (r->stages == NULL || r->threads == NULL) {
        PyBuffer_Release(&vs);
        free(r->threads);
        r->threads = NULL;
        Py_DECREF(r);
        return PyErr_NoMemory();
    }
    memcpy(r->stages, vs.buf, (size_t)n * sizeof(uint64_t));
    PyBuffer_Release(&vs);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (r->stages[i] == 0) {
            free(r->threads);
            r->threads = NULL;
            Py_DECREF(r);
            PyErr_Format(PyExc_ValueError, "RunReader: staging buffer %zd has address 0", i);
            return NULL;
        }
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->stage_bytes = stage_bytes;
    r->depth = depth;
    for (Py_ssize_t i = 0; i < n; i++) {
        rr_arg *arg = malloc(sizeof(rr_arg));
        if (arg == NULL) {
            break;
        }
        arg->r = r;
        arg->index = (int)i;
        if (pthread_create(&r->threads[r->nthreads], NULL, rr_worker, arg) != 0) {
            free(arg);
            break;
        }
        r->nthreads++;
        r->started = 1;
    }
    if (r->nthreads == 0) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_OSError, "RunReader: could not start a thread");
        return NULL;
    }
    return (PyObject *)r;
}

/* grow *p (of *cap items of size bytes) to hold want items; lock held */
static int rr_grow(void **p, Py_ssize_t *cap, Py_ssize_t want, size_t size) {
    if (want <= *cap) {
        return 0;
    }
    Py_ssize_t c = *cap ? *cap : 64;
    while (c < want) {
        c *= 2;
    }
    void *q = realloc(*p, (size_t)c * size);
    if (q == NULL) {
        return -1;
    }
    *p = q;
    *cap = c;
    return 0;
}

/* feed(runs, recs): runs an int64 array [k, 4] of (fd, file offset, length, records), recs a uint64
 * array [m, 4] of (file offset, length, xxh3_64, destination address), each run's records in turn */
static PyObject *RunReader_feed(RunReader *r, PyObject *args) {
    PyObject *runs_obj, *recs_obj;
    if (!PyArg_ParseTuple(args, "OO:feed", &runs_obj, &recs_obj)) {
        return NULL;
    }
    Py_buffer vr, vc;
    if (PyObject_GetBuffer(runs_obj, &vr, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(recs_obj, &vc, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&vr);
        return NULL;
    }
    PyObject *ret = NULL;
    Py_ssize_t k = vr.len / (Py_ssize_t)(4 * sizeof(int64_t)), m = vc.len / (Py_ssize_t)sizeof(rr_rec);
    if (vr.itemsize != 8 || vc.itemsize != 8 || vr.len % (Py_ssize_t)(4 * sizeof(int64_t)) ||
        vc.len % (Py_ssize_t)sizeof(rr_rec)) {
        PyErr_SetString(PyExc_ValueError, "feed: runs must be int64 [k, 4] and recs uint64 [m, 4]");
        goto done;
    }
    const int64_t *rv = vr.buf;
    const rr_rec *cv = vc.buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        const int64_t *x = rv + 4 * j;
        if (x[0] < 0 || x[1] < 0 || x[2] < 1 || x[2] > r->stage_bytes || x[3] < 0) {
            PyErr_Format(PyExc_ValueError,
                         "feed: run %zd (fd %lld, offset %lld, length %lld, %lld records) is not a read of 1 to "
                         "%lld bytes",
                         j, (long long)x[0], (long long)x[1], (long long)x[2], (long long)x[3],
                         (long long)r->stage_bytes);
            goto done;
        }
        for (Py_ssize_t i = total; i < total + x[3] && i < m; i++) {
            if (cv[i].off < (uint64_t)x[1] || cv[i].off + cv[i].len > (uint64_t)(x[1] + x[2]) || cv[i].dst == 0) {
                PyErr_Format(PyExc_ValueError, "feed: record %zd (offset %llu, length %llu) is not inside run %zd "
                             "with a destination", i, (unsigned long long)cv[i].off, (unsigned long long)cv[i].len, j);
                goto done;
            }
        }
        total += x[3];
    }
    if (total != m) {
        PyErr_Format(PyExc_ValueError, "feed: the runs hold %zd records, recs has %zd", total, m);
        goto done;
    }
    pthread_mutex_lock(&r->mu);
    if (r->closed) {
        pthread_mutex_unlock(&r->mu);
        PyErr_SetString(PyExc_ValueError, "feed: the reader has finished");
        goto done;
    }
    if (rr_grow((void **)&r->runs, &r->cap_runs, r->nruns + k, sizeof(rr_run)) < 0 ||
        rr_grow((void **)&r->recs, &r->cap_recs, r->nrecs + m, sizeof(rr_rec)) < 0) {
        pthread_mutex_unlock(&r->mu);
        PyErr_NoMemory();
        goto done;
    }
    uint8_t *ns = realloc(r->status, (size_t)(r->cap_recs ? r->cap_recs : 1));
    if (ns == NULL) {
        pthread_mutex_unlock(&r->mu);
        PyErr_NoMemory();
        goto done;
    }
    r->status = ns;
    memset(r->status + r->nrecs, 0, (size_t)m);
    memcpy(r->recs + r->nrecs, cv, (size_t)m * sizeof(rr_rec));
    for (Py_ssize_t j = 0; j < k; j++) {
        const int64_t *x = rv + 4 * j;
        rr_run *run = &r->runs[r->nruns + j];
        run->fd = x[0];
        run->off = x[1];
        run->len = x[2];
        run->nrec = x[3];
        run->rec0 = r->nrecs;
        r->nrecs += x[3];
    }
    r->nruns += k;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&vr);
    PyBuffer_Release(&vc);
    return ret;
}

/* finish() -> bytes: every fed run read; each record's status in feed order (see above) */
static PyObject *RunReader_finish(RunReader *r, PyObject *unused) {
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&r->mu);
    r->closed = 1;
    pthread_cond_broadcast(&r->cv);
    while (r->done < r->nruns && r->nthreads > 0) {
        pthread_cond_wait(&r->cv, &r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    rr_stop(r);
    Py_END_ALLOW_THREADS
    return PyBytes_FromStringAndSize((const char *)r->status, r->nrecs);
}

/* stats() -> (runs read, the most preads in flight at once, threads that read a run) */
static PyObject *RunReader_stats(RunReader *r, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&r->mu);
    Py_ssize_t done = r->done;
    int most = r->most_inflight, used = __builtin_popcountll(r->threads_read);
    pthread_mutex_unlock(&r->mu);
    return Py_BuildValue("(nii)", done, most, used);
}

static PyMethodDef RunReader_methods[] = {
    {"stats", (PyCFunction)RunReader_stats, METH_NOARGS,
     "stats() -> (runs read, the most preads in flight at once, threads that read a run)."},
    {"feed", (PyCFunction)RunReader_feed, METH_VARARGS,
     "feed(runs, recs): runs int64 [k, 4] (fd, file offset, length, records), recs uint64 [m, 4] (file offset, "
     "length, xxh3_64, destination address); the threads start reading them at once."},
    {"finish", (PyCFunction)RunReader_finish, METH_NOARGS,
     "finish() -> bytes: wait (GIL released) until every run is read; per record 1 copied, 2 corrupt, "
     "3 past a short read, 4 an I/O error."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RunReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstrata._native.RunReader",
    .tp_basicsize = sizeof(RunReader),
    .tp_dealloc = (destructor)RunReader_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RunReader(stages, stage_bytes, depth): a thread per staging buffer (uint64 addresses of "
              "stage_bytes each) reads fed runs into it, at most depth preads in flight, checks each "
              "record's xxh3_64 and copies it out; no GIL taken.",
    .tp_methods = RunReader_methods,
    .tp_new = RunReader_new,
};

static PyMethodDef methods[] = {
    {"chain_xxh3_128", chain_xxh3_128, METH_VARARGS,
     "chain_xxh3_128(data, row_len, parent) -> list of 16-byte keys, key[i] = xxh3_128(key[i-1] || row i)."},
    {"xxh3_128_digest", xxh3_128_digest, METH_O, "xxh3_128_digest(data) -> the 16-byte XXH3-128 digest (seed 0)."},
    {"memmove_runs", memmove_runs, METH_VARARGS,
     "memmove_runs(runs, start=0, stop=len(runs)): memmove each (dst, src, size) of runs[start:stop], GIL released."},
    {"xxh3_64_intdigest", xxh3_64_intdigest, METH_O, "xxh3_64_intdigest(data) -> the XXH3-64 of data (seed 0) as an int."},
    {"stage_in", stage_in, METH_VARARGS,
     "stage_in(stage, offsets, bufs, lengths, extents, sums): copy records into stage, zero to their extents, "
     "their xxh3_64 into sums (None: not taken); GIL released."},
    {"hash_records", hash_records, METH_VARARGS,
     "hash_records(bufs, lengths, sums, addrs, align=0): each record's xxh3_64 into sums and its address into "
     "addrs (uint64 arrays), GIL released; with align, only if every address is a multiple of it (returns "
     "whether it hashed)."},
    {"pwritev_all", pwritev_all, METH_VARARGS,
     "pwritev_all(fd, addrs, lengths, offset): write the pieces at addrs (uint64) of lengths (int64) one after "
     "another from offset, again after short writes; GIL released."},
    {"record_addresses", record_addresses, METH_VARARGS,
     "record_addresses(bufs, lengths, addrs, align) -> how many: the address of each record that is writable host "
     "memory of its length at a multiple of align into addrs (uint64), 0 for the others."},
    {"preadv_all", preadv_all, METH_VARARGS,
     "preadv_all(fd, addrs, lengths, offset) -> bytes read: fill the pieces at addrs (uint64) of lengths (int64) one "
     "after another from offset, again after short reads, until the file ends; GIL released."},
    {"hash_at", hash_at, METH_VARARGS,
     "hash_at(addrs, lengths, sums): the xxh3_64 of the memory at each address into sums; GIL released."},
    {"untrack_atoms", untrack_atoms, METH_O,
     "untrack_atoms(obj) -> bool: the garbage collector stops tracking obj (a tuple or a dict) when nothing it "
     "holds can be tracked (an insert of a trackable object tracks a dict again)."},
    {"stage_out", stage_out, METH_VARARGS,
     "stage_out(stage, offsets, bufs, lengths, expect, status): copy out the records whose xxh3_64 is expect "
     "(None: every one); status[i] 1 copied, 0 corrupt, 2 a bad destination; GIL released."},
    {"memmove_arrays", memmove_arrays, METH_VARARGS,
     "memmove_arrays(dst, src, sizes): memmove for three int64 arrays of one length, GIL released."},
    {"prefix_values", prefix_values, METH_VARARGS,
     "prefix_values(mapping, keys) -> [mapping[k] for the keys before the first one absent (or mapped to None)]."},
    {"attr_values", attr_values, METH_VARARGS,
     "attr_values(mapping, keys, name, default) -> [getattr(mapping[k], name), or default where k is absent]."},
    {"buffer_spans", buffer_spans, METH_VARARGS,
     "buffer_spans(objs, write) -> per object (address, nbytes, rows) of its C-contiguous buffer (rows -1 below "
     "2 dimensions), or None where it exports none (writable too, for write)."},
    {"prefix_run", prefix_run, METH_VARARGS,
     "prefix_run(masks, prefix) -> how many of masks, from the first, hold every bit of prefix (below 2**63)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstrata._native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
#if defined(_SC_LEVEL2_CACHE_SIZE)
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 > ALIAS_MIN) {
        alias_max = (size_t)l2;
    }
#endif
    /* KeyTable's secret: from CPython's own per-process hash secret (PYTHONHASHSEED), so it
     * differs between processes exactly as str and bytes hashes do */
    static const char a[] = "kvstrata-keytable-0", b[] = "kvstrata-keytable-1";
#if PY_VERSION_HEX >= 0x030E0000
    kt_secret[0] = (u64)Py_HashBuffer(a, sizeof(a) - 1);
    kt_secret[1] = (u64)Py_HashBuffer(b, sizeof(b) - 1);
#else
    kt_secret[0] = (u64)_Py_HashBytes(a, sizeof(a) - 1);
    kt_secret[1] = (u64)_Py_HashBytes(b, sizeof(b) - 1);
#endif
    if (PyType_Ready(&KeyTableType) < 0 || PyType_Ready(&IndexEntryType) < 0 || PyType_Ready(&RunReaderType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&KeyTableType);
    if (PyModule_AddObject(m, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(&KeyTableType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&IndexEntryType);
    if (PyModule_AddObject(m, "Entry", (PyObject *)&IndexEntryType) < 0) {
        Py_DECREF(&IndexEntryType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&RunReaderType);
    if (PyModule_AddObject(m, "RunReader", (PyObject *)&RunReaderType) < 0) {
        Py_DECREF(&RunReaderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
