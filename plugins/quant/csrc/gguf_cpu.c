/* Matrix x packed GGUF blocks on CPU: out[M, N] = x[M, K] @ W[N, K]^T, W kept in ggml's blocks.
 *
 * Weight types (ggml's block layouts, one row of W = K / block elements of blocks, row-major):
 *   Q4_0  (2) 32 elements, 18 bytes: fp16 d, 16 bytes of nibbles; w = d * (q - 8)
 *   Q4_1  (3) 32 elements, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
 *   Q5_0  (6) 32 elements, 22 bytes: fp16 d, 4 bytes qh, 16 bytes of nibbles; w = d * (q - 16)
 *   Q5_1  (7) 32 elements, 24 bytes: fp16 d, fp16 m, 4 bytes qh, 16 bytes of nibbles; w = d * q + m
 *   Q8_0  (8) 32 elements, 34 bytes: fp16 d, 32 int8; w = d * q
 *   (in the 4- and 5-bit types byte i holds element i in its low nibble and element i + 16 in its
 *   high; in the 5-bit ones bit e of the little-endian 32-bit qh is bit 4 of element e)
 *   Q4_K (12) 256 elements, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for
 *             8 sub-blocks of 32, 128 bytes of nibbles (byte 32 j + l: element 64 j + l low,
 *             64 j + 32 + l high); w = d * sc[s] * q - dmin * mn[s]
 *   Q5_K (13) 256 elements, 176 bytes: as Q4_K plus 32 bytes qh before the nibbles: bit s of
 *             qh[l] is bit 4 of element 32 s + l
 *   Q3_K (11) 256 elements, 110 bytes: hmask[32], qs[64], 12 bytes of 6-bit scales (one per 16
 *             elements), fp16 d; element 128 n + 32 j + l (l < 32) has low bits
 *             (qs[32 n + l] >> 2 j) & 3 and bit 2 from bit 4 n + j of hmask[l]; w = d * (sc - 32) * (q - 4)
 *   Q6_K (14) 256 elements, 210 bytes: ql[128], qh[64], int8 scales[16] (one per 16 elements),
 *             fp16 d; element 128 h + 32 t + l (t < 4, l < 32) has low bits from
 *             ql[64 h + 32 (t & 1) + l] >> 4 (t >> 1), high bits (qh[32 h + l] >> 2 t) & 3;
 *             w = d * sc[e / 16] * (q - 32)
 *   IQ4_NL (20) 32 elements, 18 bytes: fp16 d, 16 bytes of nibbles (as Q4_0's); w = d * KV[q], KV
 *             ggml's kvalues_iq4nl (16 signed values, -127 .. 113)
 *   IQ4_XS (23) 256 elements, 136 bytes: fp16 d, u16 scales_h, scales_l[4], qs[128]; sub-block s of
 *             32 is an IQ4_NL block over qs[16 s ..] with scale d * (ls - 32), ls the 6-bit
 *             ((scales_l[s / 2] >> 4 (s % 2)) & 15) | ((scales_h >> 2 s) & 3) << 4
 *   (the IQ types' SIMD kernels give the portable kernels' bits: the integer sums, then the
 *   portable float operations in its order)
 *
 * The activations are quantized first, per row and block, to int8 with one float32 scale:
 * d = amax / 127, q = round-to-nearest-even(x / d) (x * (1 / d), as written below) in
 * [-127, 127], plus the integer sum of every 16 (k-quants, blocks of 256) or 32 (the others,
 * blocks of 32) values, and for Q4_1 / Q5_1 d times that sum (its offset term). Each output is then a sum over blocks of exact integer dot products
 * times float scales (see each type's generic kernel: it is the definition; the SIMD kernels
 * compute the same integers and do the same float operations in the same order: the same bits).
 *
 * Loops: output rows (weight rows) are split into chunks the threads claim in turn; a thread
 * walks a chunk in tiles of NT weight rows, and for each tile the activation rows in groups
 * of up to MR (the panel kernels: 4 or 8 at a time): each weight block is unpacked once for the rows of a group
 * (the GEMV case, M <= MR, reads every weight byte once), and a tile's weights stay in cache
 * while the groups pass over it (GEMM). Every output element is computed by one thread with one fixed sequence
 * of operations, so the result does not depend on the number of threads or on M. A kernel call
 * takes all the rows of a tile (one after the other: the weights are read in memory order,
 * which the hardware prefetcher follows; interleaving 4 rows to share the activation loads
 * measured slower here, 4 streams at once being prefetched worse); the panel kernels prefetch
 * into L2 from 3 rows (gguf_avx512.c's prefetch_l2).
 *
 * Kernels: a portable C one per type, and on x86-64 the sets over 16-row panels repacked at load
 * (gguf_repack.c: AVX-512 in gguf_avx512.c, AVX-VNNI and AVX2 in gguf_vnni256.c), compiled with
 * target attributes and chosen at run time when the CPU reports them
 * (__builtin_cpu_supports), so the library is built without -march and runs on any x86-64;
 * on aarch64 NEON ones and NEON + dotprod ones (gguf_neon.c; dotprod chosen when
 * getauxval(AT_HWCAP) reports it), likewise built without -march.
 * Threads: a pool of pthreads kept between calls (see "thread pool" below; 1 thread: none); no
 * OpenMP, whose runtime would be a second one next to torch's. A call with little work uses
 * fewer threads (MIN_WORK each). The AVX2 set quantizes the activations with AVX2 too (the same
 * float operations, so the same bytes).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86 1
#include <immintrin.h>
#else
#define HAVE_X86 0
#endif
/* aarch64 with GCC: clang (14 tested) declares vdotq_s32 only when the whole build targets
 * dotprod, so a clang build keeps the portable kernels */
#if defined(__aarch64__) && defined(__GNUC__) && !defined(__clang__)
#define HAVE_ARM 1
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#else
#define HAVE_ARM 0
#endif

#define MR 8            /* activation rows that share one unpacked weight block */
#define NT 16           /* weight rows per cache tile */
#define MIN_WORK (64 * 1024) /* weight elements x row groups a thread is worth waking for */
#define MAX_THREADS 256

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
       T_IQ4_NL = 20, T_IQ4_XS = 23 };
enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVXVNNI = 2, ISA_AVX512 = 3 }; /* AVX512: F, BW, VL and VNNI */
enum { ISA_NEON = 1, ISA_DOTPROD = 2 }; /* aarch64's sets, numbered as x86-64's (one library runs one) */
#define PACKED_FLAG 0x100 /* a type | this: the weights are 16-row panels (gguf_repack.c) */

/* The quantized activations: row m's int8 values at q + m * K, its nb block scales at
 * d + m * ld, its sums of 16 or 32 values at s + m * ns, and (Q4_1, Q5_1) each block's scale
 * times its sum at ds + m * ld. ld is nb rounded up to 4, the pad zeros, so the AVX2 kernels
 * load 4 blocks' values at once. */
typedef struct {
    const int8_t *q;
    const float *d, *ds;
    const int16_t *s;
    int64_t K, nb, ns, ld;
} acts_t;

/* One weight row times activation rows m0 .. m0 + mc - 1 -> out[r * ldo] (a portable kernel). */
typedef void (*row_fn)(const uint8_t *w, const acts_t *a, int64_t m0, int mc, float *out, int64_t ldo);
/* The same for nr weight rows at w + i * ws, one after the other -> out[r * ldo + i]. */
typedef void (*rows_fn)(const uint8_t *w, int64_t ws, int64_t nr, const acts_t *a, int64_t m0, int mc, float *out,
                        int64_t ldo);

static inline float fp16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* ---------------------------------------------------------------- activations */

/* Block of n values -> int8 q, scale (return), sums of each `group` values into s. */
static float quantize_block(const float *x, int n, int group, int8_t *q, int16_t *s) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        const float v = x[i] < 0 ? -x[i] : x[i];
        amax = v > amax ? v : amax;
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: (v + shifter) - shifter rounds v to nearest even */
    for (int i = 0; i < n; i++) {
        float v = (x[i] * id + shifter) - shifter;
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[i] = (int8_t)v;
    }
    for (int g = 0; g < n / group; g++) {
        int sum = 0;
        for (int i = 0; i < group; i++) sum += q[g * group + i];
        s[g] = (int16_t)sum;
    }
    return d;
}

/* ---------------------------------------------------------------- 6-bit scales of Q4_K/Q5_K */

static inline void k_scales(const uint8_t *p, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 63;
        mn[j] = p[j + 4] & 63;
        sc[j + 4] = (p[j + 8] & 0x0F) | ((p[j] >> 6) << 4);
        mn[j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
}

/* Q3_K's 16 scales (the 12 bytes at p), each minus 32: scale j has its low 4 bits in byte j % 8
 * (j < 8: low nibble, else high) and its top 2 in bits 2 (j / 4) of byte 8 + j % 4; with 32-bit
 * operations, as ggml's kmask1/kmask2 code. */
static inline void q3_scales(const uint8_t *p, int8_t sc[16]) {
    uint32_t u[4];
    memcpy(u, p, 12);
    const uint32_t top = u[2], low4 = 0x0f0f0f0f, two = 0x03030303;
    u[2] = ((u[0] >> 4) & low4) | (((top >> 4) & two) << 4);
    u[3] = ((u[1] >> 4) & low4) | (((top >> 6) & two) << 4);
    u[0] = (u[0] & low4) | ((top & two) << 4);
    u[1] = (u[1] & low4) | (((top >> 2) & two) << 4);
    memcpy(sc, u, 16);
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)(sc[j] - 32);
}

/* ---------------------------------------------------------------- portable kernels */

#define ROW(a, m) ((a)->q + (m) * (a)->K)

/* The 32 values of a Q4_0 / Q4_1 / Q5_0 / Q5_1 block, unsigned (before the _0 types' offset). */
static void unpack32(const uint8_t *blk, int type, uint8_t qw[32]) {
    const int five = type == T_Q5_0 || type == T_Q5_1, head = type == T_Q4_1 || type == T_Q5_1 ? 4 : 2;
    const uint8_t *qs = blk + head + (five ? 4 : 0);
    uint32_t qh = 0;
    if (five) memcpy(&qh, blk + head, sizeof qh);
    for (int i = 0; i < 16; i++) {
        qw[i] = (uint8_t)((qs[i] & 0x0F) | ((qh >> i) & 1) << 4);
        qw[i + 16] = (uint8_t)((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
    }
}

/* Q4_0, Q4_1, Q5_0 and Q5_1: d * (q - offset), plus m * (d_x * the block's activation sum) for
 * the _1 types. */
static void small_generic(const uint8_t *w, const acts_t *a, int64_t m0, int mc, float *out, int64_t ldo,
                          int type) {
    const int bytes = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
    const int offset = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0, with_min = type == T_Q4_1 || type == T_Q5_1;
    float acc[MR] = {0};
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * bytes;
        const float dw = fp16_to_f32(load_u16(blk)), mw = with_min ? fp16_to_f32(load_u16(blk + 2)) : 0.0f;
        uint8_t qw[32];
        unpack32(blk, type, qw);
        for (int r = 0; r < mc; r++) {
            const int64_t m = m0 + r;
            const int8_t *qx = ROW(a, m) + b * 32;
            int32_t isum = 0;
            for (int i = 0; i < 32; i++) isum += (qw[i] - offset) * qx[i];
            if (with_min)
                acc[r] += dw * a->d[m * a->ld + b] * (float)isum + mw * a->ds[m * a->ld + b];
            else
                acc[r] += dw * a->d[m * a->ld + b] * (float)isum;
        }
    }
    for (int r = 0; r < mc; r++) out[r * ldo] = acc[r];
}

#define SMALL_GENERIC(name, type)                                                                         \
    static void name##_generic(const uint8_t *w, const acts_t *a, int64_t m0, int mc, float *out, int64_t ldo) { \
        small_generic(w, a, m0, mc, out, ldo, type);                                                       \
    }
SMALL_GENERIC(q4_0, T_Q4_0)
SMALL_GENERIC(q4_1, T_Q4_1)
SMALL_GENERIC(q5_0, T_Q5_0)
SMALL_GENERIC(q5_1, T_Q5_1)

/* acc[r] += d_w * d_x * (32 int8 weights . row r's block b): Q8_0's and IQ4_NL's block step */
static inline void int8_block_rows(const int8_t *qw, float dw, const acts_t *a, int64_t m0, int mc, int64_t b,
                                   float *acc) {
    for (int r = 0; r < mc; r++) {
        const int8_t *qx = ROW(a, m0 + r) + b * 32;
        int32_t isum = 0;
        for (int i = 0; i < 32; i++) isum += qw[i] * qx[i];
        acc[r] += dw * a->d[(m0 + r) * a->ld + b] * (float)isum;
    }
}

static void q8_0_generic(const uint8_t *w, const acts_t *a, int64_t m0, int mc, float *out, int64_t ldo) {
    float acc[MR] = {0};
    for (int64_t b = 0; b < a->nb; b++)
        int8_block_rows((const int8_t *)(w + b * 34 + 2), fp16_to_f32(load_u16(w + b * 34)), a, m0, mc, b, acc);
    for (int r = 0; r < mc; r++) out[r * ldo] = acc[r];
}

/* A Q4_K / Q5_K block's 256 values, unsigned (sub-block s: the low nibbles of bytes 32 (s / 2) ..
 * for even s, the high ones for odd s; Q5_K's bit s of qh[l] is bit 4 of its value l). */
static void k45_unpack(const uint8_t *blk, const int five, uint8_t qw[256]) {
    const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            qw[64 * j + l] = qs[32 * j + l] & 0x0F;
            qw[64 * j + 32 + l] = qs[32 * j + l] >> 4;
        }
    if (five)
        for (int s = 0; s < 8; s++)
            for (int l = 0; l < 32; l++) qw[32 * s + l] |= ((qh[l] >> s) & 1) << 4;
}

/* Q4_K and Q5_K: unsigned 4/5-bit values with a scale and a min per sub-block of 32. */
static void k45_generic(const uint8_t *w, const acts_t *a, int64_t m0, int mc, float *out, int64_t ldo,
                        int five) {
    const int bytes = five ? 176 : 144;
    float acc[MR] = {0};
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * bytes;
        const float d = fp16_to_f32(load_u16(blk)), dmin = fp16_to_f32(load_u16(blk + 2));
        uint8_t sc[8], mn[8], qw[256];
        k_scales(blk + 4, sc, mn);
        k45_unpack(blk, five, qw);
        for (int r = 0; r < mc; r++) {
            const int64_t m = m0 + r;
            const int8_t *qx = ROW(a, m) + b * 256;
            const int16_t *bs = a->s + m * a->ns + b * 16;
            int32_t isum = 0, msum = 0;
            for (int s = 0; s < 8; s++) {
                int32_t dot = 0;
                for (int l = 0; l < 32; l++) dot += qw[32 * s + l] * qx[32 * s + l];
                isum += sc[s] * dot;
                msum += mn[s] * (bs[2 * s] + bs[2 * s + 1]);
            }
            const float dx = a->d[m * a->ld + b];
            acc[r] += d * dx * (float)isum - dmin * dx * (float)msum;
        }
    }
    for (int r = 0; r < mc; r++) out[r * ldo] = acc[r];
}

static void q4_k_generic(const uint8_t *w, const acts_t *a, int64_t m0, int mc, float *out, int64_t ldo) {
    k45_generic(w, a, m0, mc, out, ldo, 0);
}

static void q5_k_generic(const uint8_t *w, const acts_t *a, int64_t m0, int mc, float *out, int64_t ldo) {
    k45_generic(w, a, m0, mc, out, ldo, 1);
}

/* Q6_K and Q3_K: one block's 256 values (qw: stored + offset) with 16 int8 scales (one per 16)
 * times each activation row: acc[r] += d * d_x * sum_j sc_j (dot_j - offset * bs_j). */
static void k16_generic(const uint8_t *qw, const int8_t *sc, const int offset, const float d, const acts_t *a,
                        int64_t m0, int mc, int64_t b, float *acc) {
    for (int r = 0; r < mc; r++) {
        const int64_t m = m0 + r;
        const int8_t *qx = ROW(a, m) + b * 256;
        const int16_t *bs = a->s + m * a->ns + b * 16;
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            int32_t dot = 0;
            for (int l = 0; l < 16; l++) dot += qw[16 * j + l] * qx[16 * j + l];
            isum += sc[j] * (dot - offset * bs[j]);
        }
        acc[r] += d * a->d[m * a->ld + b] * (float)isum;
    }
}

/* A Q6_K block's 256 values, unsigned 0..63 (the value is q - 32): ql's nibbles, qh's 2-bit pairs. */
static void q6_k_unpack(const uint8_t *blk, uint8_t qw[256]) {
    const uint8_t *ql = blk, *qh = blk + 128;
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++)
                qw[128 * h + 32 * t + l] = (uint8_t)(((ql[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 0x0F) |
                                                     (((qh[32 * h + l] >> (2 * t)) & 3) << 4));
}

/* A Q3_K block's 256 values, unsigned 0..7 (the value is q - 4): qs's 2-bit pairs, hmask's bit above. */
static void q3_k_unpack(const uint8_t *blk, uint8_t qw[256]) {
    const uint8_t *hm = blk, *qs = blk + 32;
    for (int n = 0; n < 2; n++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                qw[128 * n + 32 * j + l] = (uint8_t)(((qs[32 * n + l] >> (2 * j)) & 3) | ((hm[l] >> (4 * n + j)) & 1) << 2);
}

static void q6_k_generic(const uint8_t *w, const acts_t *a, int64_t m0, int mc, float *out, int64_t ldo) {
    float acc[MR] = {0};
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * 210;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16_to_f32(load_u16(blk + 208));
        uint8_t qw[256];
        q6_k_unpack(blk, qw);
        k16_generic(qw, sc, 32, d, a, m0, mc, b, acc);
    }
    for (int r = 0; r < mc; r++) out[r * ldo] = acc[r];
}

static void q3_k_generic(const uint8_t *w, const acts_t *a, int64_t m0, int mc, float *out, int64_t ldo) {
    float acc[MR] = {0};
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * 110;
        const float d = fp16_to_f32(load_u16(blk + 108));
        int8_t sc[16];
        q3_scales(blk + 96, sc);
        uint8_t qw[256];
        q3_k_unpack(blk, qw);
        k16_generic(qw, sc, 4, d, a, m0, mc, b, acc);
    }
    for (int r = 0; r < mc; r++) out[r * ldo] = acc[r];
}

/* IQ4_NL / IQ4_XS: each 4-bit index stands for this value (ggml's kvalues_iq4nl). */
static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* The 32 values of 16 bytes of IQ4 nibbles: byte i's low nibble is element i, its high i + 16. */
static void iq4_unpack32(const uint8_t *qs, int8_t qw[32]) {
    for (int i = 0; i < 16; i++) {
        qw[i] = KVALUES_IQ4NL[qs[i] & 0x0F];
        qw[i + 16] = KVALUES_IQ4NL[qs[i] >> 4];
    }
}

/* IQ4_XS: sub-block s's 6-bit scale minus 32. */
static inline int iq4_xs_scale(const uint8_t *blk, int s) {
    const int h = (load_u16(blk + 2) >> (2 * s)) & 3;
    return (((blk[4 + s / 2] >> (4 * (s % 2))) & 0x0F) | h << 4) - 32;
}

static void iq4_nl_generic(const uint8_t *w, const acts_t *a, int64_t m0, int mc, float *out, int64_t ldo) {
    float acc[MR] = {0};
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * 18;
        int8_t qw[32];
        iq4_unpack32(blk + 2, qw);
        int8_block_rows(qw, fp16_to_f32(load_u16(blk)), a, m0, mc, b, acc);
    }
    for (int r = 0; r < mc; r++) out[r * ldo] = acc[r];
}

/* IQ4_XS: one exact integer sum over the block's 8 sub-blocks (scale times dot product), then
 * acc += d * d_x * that sum (as the k-quants). */
static void iq4_xs_generic(const uint8_t *w, const acts_t *a, int64_t m0, int mc, float *out, int64_t ldo) {
    float acc[MR] = {0};
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * 136;
        const float d = fp16_to_f32(load_u16(blk));
        int8_t qw[256];
        int sc[8];
        for (int s = 0; s < 8; s++) {
            iq4_unpack32(blk + 8 + 16 * s, qw + 32 * s);
            sc[s] = iq4_xs_scale(blk, s);
        }
        for (int r = 0; r < mc; r++) {
            const int64_t m = m0 + r;
            const int8_t *qx = ROW(a, m) + b * 256;
            int32_t isum = 0;
            for (int s = 0; s < 8; s++) {
                int32_t dot = 0;
                for (int l = 0; l < 32; l++) dot += qw[32 * s + l] * qx[32 * s + l];
                isum += sc[s] * dot;
            }
            acc[r] += d * a->d[m * a->ld + b] * (float)isum;
        }
    }
    for (int r = 0; r < mc; r++) out[r * ldo] = acc[r];
}

/* The portable kernels over nr weight rows. */
#define ROWS(name)                                                                                   \
    static void name##_rows(const uint8_t *w, int64_t ws, int64_t nr, const acts_t *a, int64_t m0, int mc,    \
                            float *out, int64_t ldo) {                                                   \
        for (int64_t i = 0; i < nr; i++) name##_generic(w + i * ws, a, m0, mc, out + i, ldo);           \
    }
ROWS(q4_0)
ROWS(q4_1)
ROWS(q5_0)
ROWS(q5_1)
ROWS(q8_0)
ROWS(q3_k)
ROWS(q4_k)
ROWS(q5_k)
ROWS(q6_k)
ROWS(iq4_nl)
ROWS(iq4_xs)

/* ---------------------------------------------------------------- x86-64 SIMD sets
 * Every x86 set reads the weights in 16-row panels repacked at load (gguf_repack.c): AVX-512 in
 * gguf_avx512.c, AVX-VNNI and AVX2 in gguf_vnni256.c (included below). */
#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

#define INLINE __attribute__((always_inline))

/* quantize_block with AVX2 (n a multiple of 32, group 16 or 32): the same float operations
 * element by element (max is exact in any order), so the same q, d and sums. */
static AVX2 float quantize_block_avx2(const float *x, int n, int group, int8_t *q, int16_t *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.0f;
    const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    const __m256 shifter = _mm256_set1_ps(12582912.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (int c = 0; c < n; c += 32) {
        __m256i v[4];
        for (int k = 0; k < 4; k++) {
            const __m256 xi = _mm256_mul_ps(_mm256_loadu_ps(x + c + 8 * k), id);
            const __m256 r = _mm256_sub_ps(_mm256_add_ps(xi, shifter), shifter);
            v[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undo the packs' lane interleave */
        _mm256_storeu_si256((__m256i *)(q + c), _mm256_permutevar8x32_epi32(packed, order));
        const __m256i h[2] = {_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])};
        for (int g = 0; g < 32 / group; g++) {
            const __m256i t = group == 32 ? _mm256_add_epi32(h[0], h[1]) : h[g];
            __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
            s[c / group + g] = (int16_t)_mm_cvtsi128_si32(u);
        }
    }
    return d;
}

#include "gguf_avx512.c"

/* The panel kernels of gguf_vnni256.c three times: the AVX-VNNI set, VEX for the CPUs that have
 * AVX-VNNI and EVEX for those with AVX-512 VL + VNNI instead (GCC 11 and clang 12 first knew the
 * avxvnni target), and the AVX2 set's panel kernels, whose vpdpbusd is vpmaddubsw's int16 pair
 * sums added up and widened by vpmaddwd (DOT_ADD, DOT_SUM). A pair sum is exact while it fits in
 * int16 (2 x 127 x the weight's largest value: up to 6 bits; the activations are clamped to
 * +-127), and so is their int16 total over DOT_RUN(bits) chunks of 4 values a lane: the same
 * integers, hence the same bits. The 8-bit values (Q8_0's, the IQ4 lookups) would overflow: the
 * AVX2 twin (V256_DPBUSD 0) takes them signed (Q8_0: stored - 128; the IQ4 table's own values),
 * |w| times x with w's sign, each pair sum (at most 2 x 128 x 127) widened at once (sdot), and
 * leaves out the + 128 offset's correction: the same integers again. */
#define V256_DPBUSD 1
#define DOT_ADD(acc, u, s) DPBUSD(acc, u, s)
#define DOT_SUM(acc) (acc)
#define DOT_RUN(bits) 8 /* chunks of 4 values a DOT_ADD total may hold (every loop's count) */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define HAVE_VEX_VNNI 1
#define V256 __attribute__((target("avx2,fma,f16c,avxvnni")))
#define VN(x) x##_vex
#define DPBUSD _mm256_dpbusd_avx_epi32
#define DPWSSD _mm256_dpwssd_avx_epi32
#include "gguf_vnni256.c"
#undef V256
#undef VN
#undef DPBUSD
#undef DPWSSD
#define VEX_KERNEL(name) name##_v256_vex
#else
#define HAVE_VEX_VNNI 0
#define VEX_KERNEL(name) NULL
#endif
#define V256 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))
#define VN(x) x##_evex
#define DPBUSD _mm256_dpbusd_epi32
#define DPWSSD _mm256_dpwssd_epi32
#include "gguf_vnni256.c"
#undef V256
#undef VN
#undef DPBUSD
#undef DPWSSD
#undef V256_DPBUSD
#undef DOT_ADD
#undef DOT_SUM
#undef DOT_RUN
#define V256_DPBUSD 0
#define V256 AVX2
#define VN(x) x##_avx2p
#define DOT_ADD(acc, u, s) _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s))
#define DOT_SUM(acc) _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
#define DOT_RUN(bits) (32767 / (2 * 127 * ((1 << (bits)) - 1)))
_Static_assert(DOT_RUN(5) >= 4, "small_half adds 4 chunks of 5-bit products in one run");
#define DPWSSD(acc, u, v) _mm256_add_epi32(acc, _mm256_madd_epi16(u, v))
#include "gguf_vnni256.c"
#undef V256
#undef VN
#undef DPWSSD
#endif /* HAVE_X86 */

#if HAVE_ARM
#include "gguf_neon.c"
#endif

/* ---------------------------------------------------------------- dispatch */

typedef struct {
    int type, elems, bytes, group; /* group: activation sum size (16 for k-quants, else 32) */
    rows_fn rows;    /* the portable kernel over the rows (aarch64: gguf_neon.c's where it has one) */
    rows_fn packed;  /* the AVX-512 kernel over 16-row panels */
    rows_fn vnni[2]; /* the AVX-VNNI set's over the same panels: VEX, EVEX (gguf_vnni256.c) */
    rows_fn avx2p;   /* the AVX2 set's over the same panels (gguf_vnni256.c) */
} type_t;

static const type_t TYPES[] = {
#if HAVE_X86
#define KERNELS(name) name##_rows, name##_avx512, {VEX_KERNEL(name), name##_v256_evex}, name##_v256_avx2p
#else
#define KERNELS(name) name##_rows, NULL, {NULL, NULL}, NULL
#endif
    {T_Q4_0, 32, 18, 32, KERNELS(q4_0)}, {T_Q4_1, 32, 20, 32, KERNELS(q4_1)},
    {T_Q5_0, 32, 22, 32, KERNELS(q5_0)}, {T_Q5_1, 32, 24, 32, KERNELS(q5_1)},
    {T_Q8_0, 32, 34, 32, KERNELS(q8_0)}, {T_Q3_K, 256, 110, 16, KERNELS(q3_k)}, {T_Q4_K, 256, 144, 16, KERNELS(q4_k)},
    {T_Q5_K, 256, 176, 16, KERNELS(q5_k)}, {T_Q6_K, 256, 210, 16, KERNELS(q6_k)},
    {T_IQ4_NL, 32, 18, 32, KERNELS(iq4_nl)}, {T_IQ4_XS, 256, 136, 16, KERNELS(iq4_xs)},
};

static const type_t *find_type(int type) {
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i].type == type) return &TYPES[i];
    return NULL;
}

/* One product, as the threads share it: rows [chunk * c, chunk * (c + 1)) of W are chunk c. */
typedef struct {
    rows_fn fn;
    const uint8_t *w;
    int64_t w_stride, N, M, chunk, nchunks;
    const acts_t *a;
    float *out;
    int64_t ldo; /* out's row stride (N, or more where this product fills columns of a wider one) */
    int threads; /* the pool workers with index < threads take part (the caller is index 0) */
    void (*range)(const void *ctx, int64_t n0, int64_t n1); /* set: rows [n0, n1) of another kernel's job */
    const void *ctx;
} job_t;

static void run(const job_t *j, int64_t n0, int64_t n1) {
    if (j->range) {
        j->range(j->ctx, n0, n1);
        return;
    }
    for (int64_t t0 = n0; t0 < n1; t0 += NT) {
        const int64_t t1 = t0 + NT < n1 ? t0 + NT : n1;
        for (int64_t m0 = 0; m0 < j->M; m0 += MR) {
            const int mc = j->M - m0 < MR ? (int)(j->M - m0) : MR;
            j->fn(j->w + t0 * j->w_stride, j->w_stride, t1 - t0, j->a, m0, mc, j->out + m0 * j->ldo + t0, j->ldo);
        }
    }
}

/* ---------------------------------------------------------------- thread pool
 *
 * Workers are started once (lazily, more when a call asks for more) and kept. A call publishes
 * its job in `pool.job`, then `pool.state` = (generation << CHUNK_BITS) | next unclaimed chunk,
 * and bumps `pool.wake`. The caller and the woken workers claim chunks with a compare-and-swap
 * on `state` (a claim for an older generation fails), so a worker that wakes late finds no work
 * and the caller, which takes chunks too, never waits for a worker that has not started: it waits
 * only for claimed chunks (`pool.done`). Which thread computes a row does not change its math.
 * An idle worker spins about SPIN_NS on `wake` (the next product of a decode step often comes
 * within microseconds), then sleeps on a condition variable: it holds no core between tokens.
 * One call at a time uses the pool (`pool.busy`, try-locked: a concurrent call runs alone).
 * After fork() the child has none of the workers: the atfork handler forgets them. */

#define CHUNK_BITS 24
#define SPIN_NS 50000 /* long enough to outlast the Python between a decode step's products (5 us let the workers sleep there) */

#if HAVE_X86
#define PAUSE() __builtin_ia32_pause()
#elif HAVE_ARM
#define PAUSE() __asm__ __volatile__("yield")
#else
#define PAUSE() ((void)0)
#endif

static struct {
    pthread_mutex_t busy;        /* held by the call using the pool */
    pthread_mutex_t lock;        /* guards the sleeps on `wake_cv` and `done_cv` */
    pthread_cond_t wake_cv, done_cv;
    int workers;                 /* started, indices 1..workers */
    int atfork;                  /* the fork handler is registered */
    job_t job;
    uint64_t wake;               /* bumped (under `lock`) for every job */
    uint64_t state;              /* generation << CHUNK_BITS | next chunk */
    int64_t done;                /* chunks of the current job finished */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, {0}, 0, 0, 0};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Claims and runs chunks of the job of generation `gen` until none is left; `j` is a copy. */
static void take_chunks(const job_t *j, uint64_t gen) {
    uint64_t s = __atomic_load_n(&pool.state, __ATOMIC_ACQUIRE);
    for (;;) {
        if (s >> CHUNK_BITS != gen || (int64_t)(s & ((1u << CHUNK_BITS) - 1)) >= j->nchunks) return;
        if (!__atomic_compare_exchange_n(&pool.state, &s, s + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
        const int64_t c = (int64_t)(s & ((1u << CHUNK_BITS) - 1)), n0 = c * j->chunk;
        run(j, n0, n0 + j->chunk < j->N ? n0 + j->chunk : j->N);
        if (__atomic_add_fetch(&pool.done, 1, __ATOMIC_ACQ_REL) == j->nchunks) {
            pthread_mutex_lock(&pool.lock); /* the caller may be asleep on done_cv */
            pthread_cond_broadcast(&pool.done_cv);
            pthread_mutex_unlock(&pool.lock);
        }
        s = __atomic_load_n(&pool.state, __ATOMIC_ACQUIRE);
    }
}

static void *worker(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint64_t seen = __atomic_load_n(&pool.wake, __ATOMIC_ACQUIRE);
    for (;;) {
        const uint64_t until = now_ns() + SPIN_NS;
        for (int i = 0; __atomic_load_n(&pool.wake, __ATOMIC_ACQUIRE) == seen; i++) {
            PAUSE();
            if ((i & 63) == 63 && now_ns() > until) {
                pthread_mutex_lock(&pool.lock);
                while (__atomic_load_n(&pool.wake, __ATOMIC_ACQUIRE) == seen)
                    pthread_cond_wait(&pool.wake_cv, &pool.lock);
                pthread_mutex_unlock(&pool.lock);
            }
        }
        seen = __atomic_load_n(&pool.wake, __ATOMIC_ACQUIRE);
        /* Read the job while its generation is current: it is rewritten only after every chunk of
         * it was claimed and finished, and then a claim with this generation fails. */
        const uint64_t s = __atomic_load_n(&pool.state, __ATOMIC_ACQUIRE);
        job_t j;
        memcpy(&j, &pool.job, sizeof j);
        if (index < j.threads) take_chunks(&j, s >> CHUNK_BITS);
    }
    return NULL;
}

static void forget_workers(void) { /* in the child after fork(): the workers stayed in the parent */
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake_cv, NULL);
    pthread_cond_init(&pool.done_cv, NULL);
    pool.workers = 0;
}

/* Starts workers up to index `threads - 1` (pool.busy held); returns how many exist. */
static int grow(int threads) {
    if (!pool.atfork) pool.atfork = pthread_atfork(NULL, NULL, forget_workers) == 0;
    while (pool.workers < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&t, &attr, worker, (void *)(intptr_t)(pool.workers + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.workers++;
    }
    return pool.workers;
}

/* Runs `j` (threads, chunk and nchunks set) on the caller and up to j->threads - 1 workers. */
static void run_job(job_t *j) {
    if (j->threads < 2 || pthread_mutex_trylock(&pool.busy) != 0) { /* alone, or the pool is in use */
        run(j, 0, j->N);
        return;
    }
    if (grow(j->threads) < 1 || !pool.atfork) {
        pthread_mutex_unlock(&pool.busy);
        run(j, 0, j->N);
        return;
    }
    const uint64_t gen = (__atomic_load_n(&pool.state, __ATOMIC_RELAXED) >> CHUNK_BITS) + 1;
    pool.job = *j;
    __atomic_store_n(&pool.done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.state, gen << CHUNK_BITS, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool.lock);
    __atomic_add_fetch(&pool.wake, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.wake_cv);
    pthread_mutex_unlock(&pool.lock);
    take_chunks(j, gen);
    const uint64_t until = now_ns() + SPIN_NS;
    for (int i = 0; __atomic_load_n(&pool.done, __ATOMIC_ACQUIRE) < j->nchunks; i++) {
        PAUSE();
        if ((i & 63) == 63 && now_ns() > until) {
            pthread_mutex_lock(&pool.lock);
            while (__atomic_load_n(&pool.done, __ATOMIC_ACQUIRE) < j->nchunks)
                pthread_cond_wait(&pool.done_cv, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
    }
    pthread_mutex_unlock(&pool.busy);
}

#define EXPORT __attribute__((visibility("default")))

#include "gguf_repack.c"
#include "gguf_dequant.c"

/* Which twin of the AVX-VNNI set runs here: 1 VEX (the CPU has AVX-VNNI), 2 EVEX (AVX-512 VL +
 * VNNI, no AVX-VNNI), 0 neither. Asked once (mul_mat_into reads it on every product). */
static int vnni_encoding(void) {
#if HAVE_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c")) return 0;
#if HAVE_VEX_VNNI
    if (__builtin_cpu_supports("avxvnni")) return 1;
#endif
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return 2;
#endif
    return 0;
}

EXPORT int gguf_cpu_vnni_encoding(void) {
    static int known = -1; /* the same answer from every thread: a race only repeats the question */
    int e = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (e < 0) __atomic_store_n(&known, e = vnni_encoding(), __ATOMIC_RELAXED);
    return e;
}

/* The best kernel set this CPU runs: 3 (AVX-512 F/BW/VL/VNNI, and the sets below), 2 (AVX-VNNI:
 * AVX2 + FMA + F16C and a 256-bit vpdpbusd, gguf_cpu_vnni_encoding), 1 (AVX2 + FMA + F16C) or 0
 * (portable C); on aarch64 2 (NEON + dotprod, as Linux's AT_HWCAP reports it) or 1 (NEON). */
EXPORT int gguf_cpu_isa(void) {
#if HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return ISA_AVX512;
    if (gguf_cpu_vnni_encoding()) return ISA_AVXVNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#elif HAVE_ARM
#if defined(__linux__) && defined(HWCAP_ASIMDDP)
    if (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) return ISA_DOTPROD;
#endif
    return ISA_NEON;
#endif
    return ISA_GENERIC;
}

/* The threads a product uses: num_threads, fewer when each would get less than MIN_WORK
 * weight elements times activation row groups, at most one per weight row. */
EXPORT int gguf_cpu_threads(int64_t M, int64_t K, int64_t N, int num_threads) {
    const int64_t work = N * K * ((M + MR - 1) / MR);
    int64_t workers = num_threads < 1 ? 1 : num_threads;
    if (workers > MAX_THREADS) workers = MAX_THREADS;
    if (workers > work / MIN_WORK) workers = work / MIN_WORK > 1 ? work / MIN_WORK : 1;
    return (int)(workers > N ? N : workers);
}

/* Another kernel's rows on this pool (the MXFP4 kernel's, csrc/mxfp4_cpu.c, handed this function's
 * address): range(ctx, n0, n1) over [0, N) in chunks, on the caller and up to threads - 1 workers. */
EXPORT void gguf_cpu_parallel_for(void (*range)(const void *, int64_t, int64_t), const void *ctx, int64_t N,
                                  int threads) {
    job_t j = {NULL, NULL, 0, N, 0, N, 1, NULL, NULL, 0, threads < 1 ? 1 : threads, range, ctx};
    if (j.threads > 1) { /* about 16 chunks a thread, as gguf_mul_mat */
        j.chunk = (N + 16 * j.threads - 1) / (16 * j.threads);
        if (j.chunk < (N >> CHUNK_BITS) + 1) j.chunk = (N >> CHUNK_BITS) + 1;
        j.nchunks = (N + j.chunk - 1) / j.chunk;
    }
    run_job(&j);
}

/* The pool's started workers (besides the calling thread): 0 until a call uses 2 threads, and
 * 0 again in a child after fork(). */
EXPORT int gguf_cpu_pool_workers(void) { return __atomic_load_n(&pool.workers, __ATOMIC_ACQUIRE); }

/* The kernel of set `isa` over 16-row panels of type t (gguf_repack.c): every x86 SIMD set has
 * one for every type; NULL for the portable and NEON sets, which read the rows. */
static rows_fn panel_kernel(const type_t *t, int isa) {
#if HAVE_X86
    if (isa == ISA_AVX512) return t->packed;
    if (isa == ISA_AVXVNNI) return t->vnni[gguf_cpu_vnni_encoding() == 1 ? 0 : 1];
    if (isa == ISA_AVX2) return t->avx2p;
#endif
    (void)t, (void)isa;
    return NULL;
}

/* 1: the kernel set `isa` reads weights of `type` in 16-row panels (to be repacked at load,
 * gguf_repack, and passed with PACKED_FLAG); 0: it reads the rows; -2: no such type. */
EXPORT int gguf_cpu_panels(int type, int isa) {
    const type_t *t = find_type(type);
    return t ? panel_kernel(t, isa) != NULL : -2;
}

/* out[M, N] (float32, row stride ldo) = x[M, K] (contiguous float32) @ W^T: gguf_mul_mat's
 * work, for a product that may fill some columns of a wider output (gguf_layer_product). */
static int mul_mat_into(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t w_stride, int64_t N,
                        int type, float *out, int64_t ldo, int num_threads, int isa) {
    const int packed = (type & PACKED_FLAG) != 0;
    const type_t *t = find_type(type & ~PACKED_FLAG);
    if (!t) return -2;
    if (K <= 0 || K % t->elems) return -3;
    if (isa < 0 || isa > gguf_cpu_isa()) return -4;
    rows_fn fn = t->rows, panel_fn = panel_kernel(t, isa); /* panel_fn: over 16-row panels */
#if HAVE_ARM
    if (isa > ISA_GENERIC && neon_kernel(t->type, isa)) fn = neon_kernel(t->type, isa);
#endif
    if (packed && !panel_fn) return -4;
    if (M <= 0 || N <= 0) return 0;
    uint8_t *panels = NULL; /* plain rows repacked for this call (the panel sets' path of gguf_mul_mat) */
    if (panel_fn) {
        if (!packed) {
            panels = malloc((size_t)gguf_packed_bytes(t->type, N, K));
            if (!panels) return -1;
            gguf_repack(t->type, w, w_stride, N, K, panels);
            w = panels;
        }
        fn = panel_fn;
        w_stride = K / t->elems * packed_block_bytes(t->type); /* a panel: 16 of these, from row 16 p */
    }
    const int64_t nb = K / t->elems, ns = K / t->group, ld = (nb + 3) / 4 * 4;
    int8_t *q = malloc((size_t)(M * K));
    float *d = calloc((size_t)(2 * M * ld), sizeof *d), *ds = d + M * ld;
    int16_t *s = malloc((size_t)(M * ns) * sizeof *s);
    if (!q || !d || !s) {
        free(q); free(d); free(s); free(panels);
        return -1;
    }
    float (*quantize)(const float *, int, int, int8_t *, int16_t *) = quantize_block;
#if HAVE_X86
    if (isa >= ISA_AVX2) quantize = quantize_block_avx2;
#endif
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float db = quantize(x + m * K + b * t->elems, t->elems, t->group, q + m * K + b * t->elems,
                                      s + m * ns + b * (t->elems / t->group));
            d[m * ld + b] = db;
            if (t->type == T_Q4_1 || t->type == T_Q5_1) ds[m * ld + b] = db * (float)s[m * ns + b];
        }
    const acts_t a = {q, d, ds, s, K, nb, ns, ld};

    job_t j = {fn, w, w_stride, N, M, N, 1, &a, out, ldo, gguf_cpu_threads(M, K, N, num_threads)};
    if (j.threads > 1) { /* about 4 chunks a thread (16 measured slower at 2 threads on 135M shapes: more claims on one cache line, shorter streams), whole tiles, so a late thread's share is taken */
        j.chunk = (N + 4 * j.threads - 1) / (4 * j.threads);
        j.chunk = (j.chunk + NT - 1) / NT * NT;
        if (j.chunk < (N >> CHUNK_BITS) + 1) j.chunk = (N >> CHUNK_BITS) + 1;
        j.nchunks = (N + j.chunk - 1) / j.chunk;
    }
    run_job(&j);
    free(q); free(d); free(s); free(panels);
    return 0;
}

/* out[M, N] (contiguous float32) = x[M, K] (contiguous float32) @ W^T, W's row n at
 * w + n * w_stride (K / elems blocks of `type`). isa: the kernel set wanted (at most
 * gguf_cpu_isa()'s). Returns 0; -1 when scratch memory cannot be allocated, -2 for a type
 * not listed here, -3 for K not a multiple of the type's block, -4 for an isa not available. */
EXPORT int gguf_mul_mat(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t w_stride, int64_t N,
                        int type, float *out, int num_threads, int isa) {
    return mul_mat_into(x, M, K, w, w_stride, N, type, out, N, num_threads, isa);
}

/* ---------------------------------------------------------------- a layer's product, bound
 *
 * The product function of lmplug's native-step ABI (lmplug.kit.native): a fused linear
 * layer's runs of equal type, each filling its columns of one output row, plus the bias. A run
 * with type GGUF_DENSE holds float32 rows (a float shard of a mixed layer, e.g. a BF16 v next
 * to Q4_K q/k), or GGUF_DENSE_T float32 columns (a layer the file stores in F16/F32 whole):
 * computed here in float32 on the calling thread. */

#define GGUF_DENSE (-1)   /* float32 rows [N, K] */
#define GGUF_DENSE_T (-2) /* float32 W^T, [K, N] rows (a dense layer as the Unquantized path keeps it) */
#define MAX_RUNS 8

typedef struct {
    const uint8_t *w; /* rows of ggml blocks (or of F32 / F16 / BF16 values), float32 for GGUF_DENSE */
    int64_t w_stride; /* bytes between rows */
    int64_t N;        /* the run's rows (output columns) */
    int64_t type;
} gguf_run_t;

typedef struct {
    int64_t K, N, isa, n_runs; /* N: all runs' rows */
    int64_t threads;           /* > 0: this many threads whatever the caller asks (LMPLUG_GGUF_THREADS) */
    const float *bias;         /* [N] or NULL */
    gguf_run_t runs[MAX_RUNS];
} gguf_layer_t;

#define T_F32 0
#define T_F16 1
#define T_BF16 30

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* Rows of float32 (GGUF_DENSE, T_F32), float16 or bfloat16 values (a shard the file stores
 * unquantized), each dotted with x in float32, 8 lanes. */
static void dense_rows(const float *x, int64_t M, int64_t K, const gguf_run_t *r, float *out, int64_t ldo) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < r->N; n++) {
            const uint8_t *wr = r->w + n * r->w_stride;
            const float *xr = x + m * K;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, total = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                float w;
                if (r->type == T_F16) w = fp16_to_f32(load_u16(wr + 2 * i));
                else if (r->type == T_BF16) w = bf16_to_f32(load_u16(wr + 2 * i));
                else memcpy(&w, wr + 4 * i, sizeof w);
                acc[i & 7] += xr[i] * w;
            }
            for (int l = 0; l < 8; l++) total += acc[l];
            out[m * ldo + n] = total;
        }
}

static void dense_t_rows(const float *x, int64_t M, int64_t K, const gguf_run_t *r, float *out, int64_t ldo) {
    for (int64_t m = 0; m < M; m++) {
        float *o = out + m * ldo;
        for (int64_t n = 0; n < r->N; n++) o[n] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float xk = x[m * K + k], *wk = (const float *)(r->w + k * r->w_stride);
            for (int64_t n = 0; n < r->N; n++) o[n] += xk * wk[n];
        }
    }
}

/* out[M, layer->N] (contiguous) = x[M, K] @ W^T (+ bias); 0 or gguf_mul_mat's error codes,
 * -5 for a layer description out of range. */
EXPORT int gguf_layer_product(void *ctx, const float *x, int64_t M, float *out, int num_threads) {
    const gguf_layer_t *layer = ctx;
    if (layer->threads > 0) num_threads = (int)layer->threads;
    if (layer->n_runs < 1 || layer->n_runs > MAX_RUNS) return -5;
    int64_t col = 0;
    for (int64_t i = 0; i < layer->n_runs; i++) {
        const gguf_run_t *r = &layer->runs[i];
        int status = 0;
        if (r->type == GGUF_DENSE || r->type == T_F32 || r->type == T_F16 || r->type == T_BF16)
            dense_rows(x, M, layer->K, r, out + col, layer->N);
        else if (r->type == GGUF_DENSE_T)
            dense_t_rows(x, M, layer->K, r, out + col, layer->N);
        else
            status = mul_mat_into(x, M, layer->K, r->w, r->w_stride, r->N, (int)r->type, out + col, layer->N,
                                  num_threads, (int)layer->isa);
        if (status) return status;
        col += r->N;
    }
    if (col != layer->N) return -5;
    if (layer->bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < layer->N; n++) out[m * layer->N + n] += layer->bias[n];
    return 0;
}
