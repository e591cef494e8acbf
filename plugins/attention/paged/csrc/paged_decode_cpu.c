/* Paged decode attention on CPU, fused: the `paged` backend's native decode kernel.
 *
 * One query row per batch entry attends over its cached context, read straight from the
 * paged cache through its block table: no gather copy, no padding to the longest context.
 * One task per (sequence, KV head); the G = H / Hkv query heads of that KV head attend
 * together, so every K and V row is read once for all of them (GQA / MQA), and a thread
 * runs the tasks of one sequence side by side, so each slot's K/V heads are read as one
 * contiguous run (the next chunk's slots are prefetched: blocks lie anywhere).
 *
 * A row attends to a list of positions: [0, len) for a plain row; for a row with a tree mask
 * (mask_starts[b] >= 0: a speculative draft tree's node), the positions [0, mask_start), then
 * those p in [mask_start, len) whose bit p - mask_start of masks[b] is set, in increasing
 * order (len - mask_start <= 64). With a sliding window only the list's last `window` entries.
 * Per layer (Gemma 2, GPT-OSS): softcap > 0 soft-caps every score, softcap * tanh(s / softcap)
 * (tanh from exp_nonpos: no libm, the same bits on every path); sinks (NULL: none), float32 [H],
 * one logit per query head whose exp joins the softmax denominator with no value, folded into
 * the running max and sum once the last chunk is in.
 * The list is visited in chunks of CHUNK consecutive entries; scores are float32 and the
 * softmax is online (running max and sum per query head, the accumulator rescaled once per
 * chunk), V is accumulated in float32 and the output written once at the end. So a row's
 * result depends only on the K/V rows its list names, in order: a masked row gives bit for bit
 * what a plain row gives over a cache holding the same rows at consecutive positions. Slots
 * not in a row's list are never read (they may hold NaN or another sequence's data).
 *
 * Layouts (all contiguous): q, out [B, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
 * block_tables [B, bt_stride] int32; seq_lens [B] int32; mask_starts [B] int32 and masks [B]
 * uint64, or both NULL (no row masked). Storage types: float32, bfloat16
 * (uint16 bits; widened exactly, the output rounded to nearest even as torch does) and, where
 * the compiler has _Float16, float16.
 *
 * Threads: the B * Hkv tasks are split into num_threads contiguous chunks, each on a pthread
 * created here (1 thread: none created). No OpenMP: torch ships its own runtime, and two in
 * one process fight over the cores.
 *
 * Plain C with no torch or Python headers, so it builds in about a second with
 * `cc -O3 -march=native -shared -fPIC -pthread` (see paged_native.py). Where the compiler
 * targets AVX-512F (X16 below) and D % 16 == 0, the scores, the V sums, the softmax steps and
 * q's load are explicit AVX-512 intrinsics on rows loaded straight into registers (bfloat16
 * widened by shifts there, 32 values a load, see X16); otherwise the portable loops below,
 * written for gcc/clang's auto-vectorizer (checked with -fopt-info-vec): dot products
 * keep LANES partial sums, added pairwise for a whole chunk of positions at once (a float
 * reduction per dot product does not vectorize without -ffast-math's reassociation, which
 * this file must not have), V is accumulated four positions per pass, and exp is a
 * branch-free polynomial rather than libm's scalar expf. Either way every sum has a fixed
 * order, so a row's result is the same whatever the batch and the threads (on one build).
 * Returns 0, or -1 when scratch memory could not be allocated.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 32 /* positions scored before one online-softmax update */
#define LANES 16 /* partial sums per dot product (sum_lanes adds 16) */

enum dtype { F32, BF16, F16 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* c10::round_to_nearest_even */
    if (isnan(f)) return 0x7FC0;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16);
}

/* exp(x) for x <= 0 (every argument here is a score minus a running max): 2^n * p(r),
 * r = x - n ln2 in [-ln2/2, ln2/2], p a degree-6 Taylor polynomial (relative error < 2e-7);
 * below -87 (where 2^n leaves the normal range) the result is 0. */
static inline float exp_nonpos(float x) {
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float xc = x < -87.0f ? -87.0f : x;
    float n = (xc * 1.44269504f + shifter) - shifter;
    float r = xc - n * 0.693145752f; /* ln2 split in two for an exact product */
    r = r - n * 1.42860677e-6f;
    float p = 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, sizeof two_n);
    return x < -87.0f ? 0.0f : p * two_n;
}

/* the LANES partial sums of a.b (lane i: elements i, i + LANES, ...; the tail of an odd size
 * in lane 0); `sum_lanes` adds them up for a whole chunk at once */
static inline void dot_lanes(float *restrict lane, const float *restrict a, const float *restrict b,
                             int n) {
    for (int i = 0; i < LANES; i++) lane[i] = 0.0f;
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int i = 0; i < LANES; i++) lane[i] += a[d + i] * b[d + i];
    if (d < n) { /* (x + 0 is not x for x = -0: the compiler keeps the add unless skipped) */
        float tail = 0.0f;
        for (; d < n; d++) tail += a[d] * b[d];
        lane[0] += tail;
    }
}

/* the max and the sum of a chunk's CHUNK scores, pairwise at fixed sizes (each level one
 * vector op; an in-order reduction would not vectorize) */
_Static_assert(CHUNK == 32, "chunk_max and chunk_sum add 32 values");
#define CHUNK_REDUCE(name, op)                                                                   \
    static inline float name(const float *restrict x) {                                          \
        float a[16], b[8], c[4];                                                                 \
        for (int k = 0; k < 16; k++) a[k] = op(x[k], x[k + 16]);                                 \
        for (int k = 0; k < 8; k++) b[k] = op(a[k], a[k + 8]);                                   \
        for (int k = 0; k < 4; k++) c[k] = op(b[k], b[k + 4]);                                   \
        return op(op(c[0], c[2]), op(c[1], c[3]));                                               \
    }
#define MAX_OP(u, v) ((u) > (v) ? (u) : (v))
#define ADD_OP(u, v) ((u) + (v))
CHUNK_REDUCE(chunk_max, MAX_OP)
CHUNK_REDUCE(chunk_sum, ADD_OP)

/* out[i] = the sum of lanes[i * LANES ...] for i < n, pairwise in four levels: each level
 * vectorizes over the whole chunk (a horizontal sum per dot product does not, without
 * -ffast-math) */
static inline void sum_lanes(float *restrict out, float *restrict tmp, const float *restrict lanes,
                             int n) {
    float *l8 = tmp, *l4 = l8 + CHUNK * 8, *l2 = l4 + CHUNK * 4;
    for (int k = 0; k < n * 8; k++) l8[k] = lanes[2 * k] + lanes[2 * k + 1];
    for (int k = 0; k < n * 4; k++) l4[k] = l8[2 * k] + l8[2 * k + 1];
    for (int k = 0; k < n * 2; k++) l2[k] = l4[2 * k] + l4[2 * k + 1];
    for (int k = 0; k < n; k++) out[k] = l2[2 * k] + l2[2 * k + 1];
}

/* y += a[0] x0 + a[1] x1 + a[2] x2 + a[3] x3: four positions per pass over the accumulator */
static inline void axpy4(float *restrict y, const float *a, const float *restrict x0,
                         const float *restrict x1, const float *restrict x2,
                         const float *restrict x3, int n) {
    const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    for (int d = 0; d < n; d++) y[d] += (a0 * x0[d] + a1 * x1[d]) + (a2 * x2[d] + a3 * x3[d]);
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int n) {
    for (int d = 0; d < n; d++) y[d] += a * x[d];
}

/* a row of D stored values as float32: the row itself (float32) or a widened copy in buf */
static inline const float *row_f32(const void *src, float *restrict buf, int n, enum dtype t) {
    if (t == F32) return (const float *)src;
    if (t == BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int d = 0; d < n; d++) buf[d] = bf16_to_f32(s[d]);
    }
#ifdef __FLT16_MAX__
    if (t == F16) {
        const _Float16 *s = (const _Float16 *)src;
        for (int d = 0; d < n; d++) buf[d] = (float)s[d];
    }
#endif
    return buf;
}

static inline void store_row(void *dst, const float *restrict src, float mul, int n, enum dtype t) {
    if (t == F32) {
        float *o = (float *)dst;
        for (int d = 0; d < n; d++) o[d] = src[d] * mul;
    } else if (t == BF16) {
        uint16_t *o = (uint16_t *)dst;
        for (int d = 0; d < n; d++) o[d] = f32_to_bf16(src[d] * mul);
    }
#ifdef __FLT16_MAX__
    else if (t == F16) {
        _Float16 *o = (_Float16 *)dst;
        for (int d = 0; d < n; d++) o[d] = (_Float16)(src[d] * mul);
    }
#endif
}

/* the cache lines of `bytes` bytes at `p`, on their way to the caches */
static inline void prefetch(const char *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* AVX-512 paths for head sizes D % 16 == 0 (vectors of 16 float32; the loops below work on
 * whole vectors, in registers, instead of widened copies of the rows in memory). Each score is
 * still a fixed function of its q and K rows and each chunk's V sum of its rows in list order,
 * so results do not depend on the batch, the other rows or the threads.
 * bfloat16 with D % 32 == 0 ("pairs"): 32 stored values are one load, widened by one shift (the
 * even columns) and one mask (the odd ones), so q and the V accumulators are kept with each 32
 * columns as their 16 even then their 16 odd ones, put back in order at the end (attend). */
#define X16 1

/* 16 stored values at p as float32 (bf16 and f16 widen exactly) */
static inline __m512 load16(const char *p, enum dtype t) {
    if (t == F32) return _mm512_loadu_ps((const float *)p);
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (t == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* the nd <= 4 vectors of 16 columns from `row` on (64 columns at most), in the pairs layout when
 * `pairs` (nd even) */
static inline __attribute__((always_inline)) void load_cols(__m512 *out, const char *row, int nd,
                                                            enum dtype t, int pairs) {
    if (pairs) {
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
        for (int c = 0; c < nd; c += 2) {
            const __m512i x = _mm512_loadu_si512((const void *)(row + 32 * c));
            out[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
            out[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
        }
    } else {
        for (int c = 0; c < nd; c++) out[c] = load16(row + (size_t)c * (t == F32 ? 64 : 32), t);
    }
}

/* lane i of the result: the sum of the 16 lanes of v[SLOT(i)], pairwise in four levels (+8, +4,
 * +2, +1 lanes apart); SLOT is the order the levels' shuffles leave the vectors in (its own
 * inverse), so callers store position i's partial sums in v[SLOT(i)] */
static const int slot16[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
static inline __m512 sum16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int k = 0; k < 8; k++) /* 256-bit halves: v[k] in the low half, v[k + 8] the high */
        t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[k], v[k + 8], 0x44), _mm512_shuffle_f32x4(v[k], v[k + 8], 0xEE));
    for (int k = 0; k < 4; k++) /* 128-bit quarters */
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[k], t[k + 4], 0x88), _mm512_shuffle_f32x4(t[k], t[k + 4], 0xDD));
    for (int k = 0; k < 2; k++) /* pairs within quarters */
        w[k] = _mm512_add_ps(_mm512_shuffle_ps(u[k], u[k + 2], 0x44), _mm512_shuffle_ps(u[k], u[k + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
}

/* scores[r * CHUNK + i] = q[r] . K row i for NR query rows and the n <= CHUNK rows at k + offs[i]:
 * each K row loaded once for the NR rows, 16 partial sums per dot product (d mod 16) summed by sum16.
 * The rows at k + nxt[i], i < next (the next chunk's) are prefetched one per row computed. */
static inline __attribute__((always_inline)) void scores16(float *scores, const float *q, const char *k,
                                                           const size_t *offs, int n, const size_t *nxt,
                                                           int next, enum dtype t, const int D, const int NR,
                                                           int pairs) {
    const size_t elem = t == F32 ? 4 : 2;
    for (int i0 = 0; i0 < n; i0 += 16) {
        __m512 part[4][16];
        for (int i = 0; i < 16; i++) {
            __m512 a[4];
            for (int r = 0; r < NR; r++) a[r] = _mm512_setzero_ps();
            if (i0 + i < next) prefetch(k + nxt[i0 + i], (size_t)D * elem);
            if (i0 + i < n) {
                const char *row = k + offs[i0 + i];
                for (int d0 = 0; d0 < D; d0 += 64) {
                    const int nd = D - d0 < 64 ? (D - d0) / 16 : 4;
                    __m512 kv[4];
                    load_cols(kv, row + (size_t)d0 * elem, nd, t, pairs);
                    for (int c = 0; c < nd; c++)
                        for (int r = 0; r < NR; r++)
                            a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)r * D + d0 + 16 * c), kv[c], a[r]);
                }
            }
            for (int r = 0; r < NR; r++) part[r][slot16[i]] = a[r];
        }
        for (int r = 0; r < NR; r++) _mm512_storeu_ps(scores + r * CHUNK + i0, sum16(part[r]));
    }
}

/* acc[r] += sum over i < n of p[r * CHUNK + i] * V row i, NR query rows: 64 columns at a time,
 * their NR x 4 accumulators in registers over the chunk's rows (independent chains: no wait on
 * an FMA's latency), each V vector loaded once for the NR rows */
static inline __attribute__((always_inline)) void values16(float *acc, const float *p, const char *v,
                                                           const size_t *offs, int n, const size_t *nxt,
                                                           int next, enum dtype t, const int D, const int NR,
                                                           int pairs) {
    const size_t elem = t == F32 ? 4 : 2;
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int nd = D - d0 < 64 ? (D - d0) / 16 : 4;
        __m512 a[4][4];
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < nd; c++) a[r][c] = _mm512_loadu_ps(acc + (size_t)r * D + d0 + 16 * c);
        for (int i = 0; i < n; i++) {
            if (d0 == 0 && i < next) prefetch(v + nxt[i], (size_t)D * elem); /* the next chunk's rows */
            __m512 vv[4];
            load_cols(vv, v + offs[i] + (size_t)d0 * elem, nd, t, pairs);
            for (int c = 0; c < nd; c++)
                for (int r = 0; r < NR; r++) a[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * CHUNK + i]), vv[c], a[r][c]);
        }
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < nd; c++) _mm512_storeu_ps(acc + (size_t)r * D + d0 + 16 * c, a[r][c]);
    }
}

/* exp_nonpos on 16 values (the same steps, fused multiply-adds) */
static inline __m512 exp16(__m512 x) {
    const __m512 shifter = _mm512_set1_ps(12582912.0f);
    const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504f), shifter), shifter);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_maskz_mul_ps(normal, p, _mm512_castsi512_ps(e));
}

/* softmax_update on vectors: the max over lanes is exact in any order, the sum is a fixed tree */
static inline float softmax_update16(float *sc, int n, float *max, float *sum) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512 s0 = _mm512_mask_loadu_ps(ninf, n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1), sc);
    const __m512 s1 = _mm512_mask_loadu_ps(ninf, n >= 32 ? 0xFFFF : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1),
                                           sc + 16);
    const float chunk = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)), m = chunk > *max ? chunk : *max;
    const __m512 e0 = exp16(_mm512_sub_ps(s0, _mm512_set1_ps(m)));
    const __m512 e1 = exp16(_mm512_sub_ps(s1, _mm512_set1_ps(m)));
    _mm512_storeu_ps(sc, e0);
    _mm512_storeu_ps(sc + 16, e1);
    const float correction = exp_nonpos(*max - m);
    *sum = *sum * correction + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
    *max = m;
    return correction;
}
#else
#define X16 0
#endif

/* one chunk's online softmax step for one query row: its n scores in sc become weights (the rest
 * of the CHUNK weight 0), the running max and sum move on; returns the factor the accumulator
 * must be scaled by */
static inline float softmax_update(float *sc, int n, float *max, float *sum) {
#if X16
    return softmax_update16(sc, n, max, sum);
#endif
    for (int i = n; i < CHUNK; i++) sc[i] = -INFINITY; /* a short last chunk: weight 0 */
    const float chunk = chunk_max(sc), m = chunk > *max ? chunk : *max;
    for (int i = 0; i < CHUNK; i++) sc[i] = exp_nonpos(sc[i] - m);
    const float correction = exp_nonpos(*max - m);
    *sum = *sum * correction + chunk_sum(sc);
    *max = m;
    return correction;
}

/* softcap * tanh(s / softcap) for the n scores at sc: tanh(|x|) = (1 - e) / (1 + e), e = exp(-2|x|) */
static inline void cap_scores(float *sc, int n, float softcap) {
    for (int i = 0; i < n; i++) {
        const float x = sc[i] / softcap, e = exp_nonpos(-2.0f * fabsf(x));
        sc[i] = softcap * copysignf((1.0f - e) / (1.0f + e), x);
    }
}

/* the factor a row's accumulator is multiplied by for its output: 1 / sum, with the sink's
 * exp(sink) joining the sum (rescaled to whichever of the running max and the sink is larger) */
static inline float output_factor(float max, float sum, const float *sink) {
    if (sink) {
        if (*sink <= max) return 1.0f / (sum + exp_nonpos(*sink - max));
        const float c = exp_nonpos(max - *sink); /* max = -inf (no position): c = 0, output 0 */
        return c / (sum * c + 1.0f);
    }
    return sum > 0 ? 1.0f / sum : 0.0f;
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens, *mask_starts; /* mask_starts, masks: NULL or [B] */
    const uint64_t *masks;
    void *out;
    int64_t bt_stride;
    int B, H, Hkv, D, block_size, window;
    float scale, softcap; /* softcap 0: none */
    const float *sinks;   /* [H] or NULL */
    /* chains (NULL: each row alone): rows group_first[g] .. group_first[g + 1] - 1 attend as one
     * task per KV head (chain_groups); groups of them, [groups + 1] entries */
    const int32_t *group_first;
    int groups, max_group; /* the number of groups (B without chains), the longest one's rows */
    int first, last; /* this worker's tasks: [first, last) of groups * Hkv */
    int status;
} job_t;

typedef struct { /* one worker's float32 scratch, R = max_group * H query rows at most */
    float *q, *acc, *scores, *rows, *max, *sum; /* rows: a chunk of K or V rows widened */
    float *lanes, *tmp;                         /* dot products' partial sums, sum_lanes' levels */
} scratch_t;

/* a row's list of attended positions: entries e < prefix are position e, the rest tail[e - prefix] */
typedef struct {
    int prefix, count; /* count: the list's length */
    int32_t tail[64];
} positions_t;

/* row b's list: [0, len), or with a mask [0, mask_start) and the set bits' positions */
static inline void row_positions(positions_t *l, const job_t *j, int b, int len) {
    l->prefix = l->count = len;
    if (!j->mask_starts || j->mask_starts[b] < 0) return;
    int start = j->mask_starts[b];
    if (start > len) start = len; /* invalid (the caller checks): never read past len */
    uint64_t bits = j->masks[b];
    if (len - start < 64) bits &= ((uint64_t)1 << (len - start)) - 1; /* bits of [start, len) only */
    l->prefix = l->count = start;
    for (; bits; bits &= bits - 1) l->tail[l->count++ - start] = start + __builtin_ctzll(bits);
}

/* byte offsets in the caches of the slots of list entries [e0, e0 + n) of one row */
static inline void slot_offsets(size_t *offs, const int32_t *table, const positions_t *l, int e0,
                                int n, int bs, size_t slot_bytes) {
    for (int i = 0; i < n; i++) {
        const int e = e0 + i, p = e < l->prefix ? e : l->tail[e - l->prefix];
        offs[i] = ((size_t)table[p / bs] * bs + p % bs) * slot_bytes;
    }
}

/* of the chunk's n entries from e0, how many row b + i attends to (a chain's row i < the last:
 * its own length; the group's list is the last row's, unmasked, from entry 0) */
static inline int row_count(const job_t *j, int b, int i, int e0, int n) {
    const int own = j->seq_lens[b + i] - e0;
    return own < 0 ? 0 : own < n ? own : n;
}

/* rows b .. b + nb - 1 (one row, or a chain: row b + i attends to the first seq_lens[b] + i
 * positions of one block table, chain_groups), KV heads [h0, h1): the query rows
 * r = h * G * nb + i * G + g (h < h1 - h0, i < nb, g < G) are head (h0 + h) * G + g of row b + i,
 * reading KV head h0 + h. Heads of one sequence go together so that each slot's K (and V) is
 * read as one contiguous run of (h1 - h0) * D values, and a chain's rows go together so that
 * it is read once for all of them. A chain is scored over the last row's positions; a shorter
 * row's scores past its length are set to -inf before its softmax step, so its weights there
 * are exactly 0 (a chunk wholly past it: correction 1, sum + 0), and its V sum adds them as 0 * v
 * one at a time (the FMA path; the portable path stops at the row's own count, as its axpy4 groups
 * positions by four): each row gets the bits it gets alone. */
static inline __attribute__((always_inline)) void attend(const job_t *j, int b, int nb, int h0, int h1,
                                                         scratch_t *s, enum dtype t, const int D) {
    const int G = j->H / j->Hkv, bs = j->block_size, GN = G * nb, R = (h1 - h0) * GN;
    const size_t elem = t == F32 ? 4 : 2;
    positions_t list; /* the entries [start, len) of the row's list are visited (len: its length) */
    row_positions(&list, j, b + nb - 1, j->seq_lens[b + nb - 1]);
    const int len = list.count;
    const int start = j->window > 0 && len > j->window ? len - j->window : 0;
    const int32_t *table = j->block_tables + (int64_t)b * j->bt_stride;
    const size_t row_bytes = (size_t)D * elem, slot_bytes = (size_t)j->Hkv * row_bytes;
    const size_t head_bytes = (size_t)h0 * row_bytes;
    const char *kc = (const char *)j->k_cache + head_bytes, *vc = (const char *)j->v_cache + head_bytes;
#define QROW(base, r) /* query row r's q (or output) row in [B, H, D] storage at base */               \
    ((base) + ((size_t)(b + (r) % GN / G) * j->H + (size_t)(h0 + (r) / GN) * G + (r) % G) * row_bytes)

    const int pairs = X16 && t == BF16 && D % 32 == 0; /* q and acc in the pairs layout (X16) */
    (void)pairs;
    for (int r = 0; r < R; r++) { /* the scale goes into q once */
#if X16
        if (D % 16 == 0) {
            for (int d0 = 0; d0 < D; d0 += 64) {
                const int nd = D - d0 < 64 ? (D - d0) / 16 : 4;
                __m512 qv[4];
                load_cols(qv, QROW((const char *)j->q, r) + (size_t)d0 * elem, nd, t, pairs);
                for (int c = 0; c < nd; c++)
                    _mm512_storeu_ps(s->q + (size_t)r * D + d0 + 16 * c, _mm512_mul_ps(qv[c], _mm512_set1_ps(j->scale)));
            }
        } else
#endif
        {
            const float *qr = row_f32(QROW((const char *)j->q, r), s->rows, D, t);
            for (int d = 0; d < D; d++) s->q[(size_t)r * D + d] = qr[d] * j->scale;
        }
        s->max[r] = -INFINITY;
        s->sum[r] = 0.0f;
        memset(s->acc + (size_t)r * D, 0, (size_t)D * sizeof(float));
    }
    size_t offs[2][CHUNK]; /* this chunk's slots and the next one's */
    if (start < len)
        slot_offsets(offs[0], table, &list, start, len - start < CHUNK ? len - start : CHUNK, bs, slot_bytes);
    for (int e0 = start, c = 0; e0 < len; e0 += CHUNK, c ^= 1) {
        const int n = len - e0 < CHUNK ? len - e0 : CHUNK;
        const size_t *cur = offs[c], *nxt = offs[c ^ 1];
        /* blocks sit anywhere in the pool: the next chunk's rows are prefetched while this
         * one is computed, a row at a time, so the requests spread over the chunk */
        const int next = len - e0 - CHUNK <= 0 ? 0 : len - e0 - CHUNK < CHUNK ? len - e0 - CHUNK : CHUNK;
        slot_offsets(offs[c ^ 1], table, &list, e0 + CHUNK, next, bs, slot_bytes);
        const float *rows[CHUNK];
        for (int h = 0; h < h1 - h0; h++) { /* scores; the list's positions only */
#if X16
            if (D % 16 == 0) { /* the query rows of head h four at a time */
                for (int r = h * GN; r < (h + 1) * GN; r += 4) {
                    float *sc = s->scores + r * CHUNK;
                    const float *qr = s->q + (size_t)r * D;
                    const char *k = kc + h * row_bytes;
                    const int pf = r == h * GN ? next : 0; /* prefetches: with the first rows */
                    switch ((h + 1) * GN - r) {
                    case 1: scores16(sc, qr, k, cur, n, nxt, pf, t, D, 1, pairs); break;
                    case 2: scores16(sc, qr, k, cur, n, nxt, pf, t, D, 2, pairs); break;
                    case 3: scores16(sc, qr, k, cur, n, nxt, pf, t, D, 3, pairs); break;
                    default: scores16(sc, qr, k, cur, n, nxt, pf, t, D, 4, pairs);
                    }
                }
                continue;
            }
#endif
            for (int i = 0; i < next; i++) prefetch(kc + nxt[i] + h * row_bytes, row_bytes);
            for (int i = 0; i < n; i++)
                rows[i] = row_f32(kc + cur[i] + h * row_bytes, s->rows + (size_t)i * D, D, t);
            for (int r = h * GN; r < (h + 1) * GN; r++) {
                for (int i = 0; i < n; i++) dot_lanes(s->lanes + i * LANES, s->q + (size_t)r * D, rows[i], D);
                sum_lanes(s->scores + r * CHUNK, s->tmp, s->lanes, n);
            }
        }
        for (int r = 0; r < R; r++) { /* online softmax update, over whole chunks */
            if (j->softcap > 0) cap_scores(s->scores + r * CHUNK, n, j->softcap);
            for (int i = row_count(j, b, r % GN / G, e0, n); i < n; i++) s->scores[r * CHUNK + i] = -INFINITY;
            const float correction = softmax_update(s->scores + r * CHUNK, n, &s->max[r], &s->sum[r]);
            if (correction != 1.0f) {
                float *acc = s->acc + (size_t)r * D;
                for (int d = 0; d < D; d++) acc[d] *= correction;
            }
        }
        for (int h = 0; h < h1 - h0; h++) { /* weighted V */
#if X16
            if (D % 16 == 0) {
                for (int r = h * GN; r < (h + 1) * GN; r += 4) {
                    float *acc = s->acc + (size_t)r * D;
                    const float *p = s->scores + r * CHUNK;
                    const char *v = vc + h * row_bytes;
                    const int pf = r == h * GN ? next : 0;
                    switch ((h + 1) * GN - r) {
                    case 1: values16(acc, p, v, cur, n, nxt, pf, t, D, 1, pairs); break;
                    case 2: values16(acc, p, v, cur, n, nxt, pf, t, D, 2, pairs); break;
                    case 3: values16(acc, p, v, cur, n, nxt, pf, t, D, 3, pairs); break;
                    default: values16(acc, p, v, cur, n, nxt, pf, t, D, 4, pairs);
                    }
                }
                continue;
            }
#endif
            for (int i = 0; i < next; i++) prefetch(vc + nxt[i] + h * row_bytes, row_bytes);
            for (int i = 0; i < n; i++)
                rows[i] = row_f32(vc + cur[i] + h * row_bytes, s->rows + (size_t)i * D, D, t);
            for (int r = h * GN; r < (h + 1) * GN; r++) {
                float *acc = s->acc + (size_t)r * D;
                const float *p = s->scores + r * CHUNK;
                const int nr = row_count(j, b, r % GN / G, e0, n); /* this row's own positions */
                int i = 0;
                for (; i + 4 <= nr; i += 4) axpy4(acc, p + i, rows[i], rows[i + 1], rows[i + 2], rows[i + 3], D);
                for (; i < nr; i++) axpy(acc, p[i], rows[i], D);
            }
        }
    }
    for (int r = 0; r < R; r++) { /* no position (len 0): zeros rather than 0/0 */
        const float *acc = s->acc + (size_t)r * D;
#if X16
        if (pairs) { /* the columns back in order: 16 even and 16 odd ones interleaved */
            const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
            const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
            for (int d = 0; d < D; d += 32) {
                const __m512 even = _mm512_loadu_ps(acc + d), odd = _mm512_loadu_ps(acc + d + 16);
                _mm512_storeu_ps(s->rows + d, _mm512_permutex2var_ps(even, lo, odd));
                _mm512_storeu_ps(s->rows + d + 16, _mm512_permutex2var_ps(even, hi, odd));
            }
            acc = s->rows;
        }
#endif
        const float *sink = j->sinks ? j->sinks + (size_t)(h0 + r / GN) * G + r % G : NULL;
        store_row(QROW((char *)j->out, r), acc, output_factor(s->max[r], s->sum[r], sink), D, t);
    }
#undef QROW
}

static inline __attribute__((always_inline)) void run(job_t *j, enum dtype t) {
    const int R = j->max_group * j->H, D = j->D, Hkv = j->Hkv;
    const size_t floats = (size_t)R * D * 2 + (size_t)R * CHUNK + (size_t)CHUNK * D + (size_t)R * 2 +
                          (size_t)CHUNK * LANES * 2;
    float *mem = malloc(floats * sizeof(float));
    if (!mem) {
        j->status = -1;
        return;
    }
    scratch_t s;
    s.q = mem;
    s.acc = s.q + (size_t)R * D;
    s.scores = s.acc + (size_t)R * D;
    s.rows = s.scores + (size_t)R * CHUNK;
    s.max = s.rows + (size_t)CHUNK * D;
    s.sum = s.max + R;
    s.lanes = s.sum + R;
    s.tmp = s.lanes + CHUNK * LANES;
    for (int task = j->first; task < j->last;) { /* the tasks of one sequence (or chain) together */
        const int g = task / Hkv, h0 = task % Hkv;
        const int h1 = j->last - g * Hkv < Hkv ? j->last - g * Hkv : Hkv;
        const int b = j->group_first ? j->group_first[g] : g, nb = j->group_first ? j->group_first[g + 1] - b : 1;
        switch (D) { /* common head sizes as constants: the loops over D unroll, no tails */
        case 64: attend(j, b, nb, h0, h1, &s, t, 64); break;
        case 128: attend(j, b, nb, h0, h1, &s, t, 128); break;
        default: attend(j, b, nb, h0, h1, &s, t, D);
        }
        task = g * Hkv + h1;
    }
    free(mem);
    j->status = 0;
}

static void *run_f32(void *j) { run((job_t *)j, F32); return NULL; }
static void *run_bf16(void *j) { run((job_t *)j, BF16); return NULL; }
#ifdef __FLT16_MAX__
static void *run_f16(void *j) { run((job_t *)j, F16); return NULL; }
#endif

#define MAX_THREADS 256

static int launch(void *(*worker)(void *), const void *q, const void *k_cache, const void *v_cache,
                  const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                  const int32_t *mask_starts, const uint64_t *masks, void *out,
                  int B, int H, int Hkv, int D, int block_size, float scale, int window,
                  float softcap, const float *sinks, const int32_t *group_first, int groups,
                  int num_threads) {
    if (!group_first) groups = B;
    int max_group = 1;
    for (int g = 0; group_first && g < groups; g++)
        if (group_first[g + 1] - group_first[g] > max_group) max_group = group_first[g + 1] - group_first[g];
    const int tasks = groups * Hkv;
    int workers = num_threads < tasks ? num_threads : tasks;
    if (workers > MAX_THREADS) workers = MAX_THREADS;
    if (workers < 1) workers = 1;
    job_t jobs[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int w = 0; w < workers; w++) {
        jobs[w] = (job_t){q, k_cache, v_cache, block_tables, seq_lens, mask_starts, masks, out, bt_stride, B, H, Hkv, D,
                          block_size, window, scale, softcap, sinks, group_first, groups, max_group,
                          (int)((int64_t)tasks * w / workers),
                          (int)((int64_t)tasks * (w + 1) / workers), 0};
    }
    for (int w = 1; w < workers; w++) /* a thread that cannot start runs inline below */
        started[w] = pthread_create(&threads[w], NULL, worker, &jobs[w]) == 0;
    worker(&jobs[0]);
    int status = jobs[0].status;
    for (int w = 1; w < workers; w++) {
        if (started[w])
            pthread_join(threads[w], NULL);
        else
            worker(&jobs[w]);
        if (jobs[w].status) status = jobs[w].status;
    }
    return status;
}

#define EXPORT __attribute__((visibility("default")))
#define DECODE_ARGS                                                                              \
    const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,        \
        int64_t bt_stride, const int32_t *seq_lens, const int32_t *mask_starts,                  \
        const uint64_t *masks, void *out, int B, int H, int Hkv, int D, int block_size,          \
        float scale, int window, float softcap, const float *sinks, int num_threads
#define DECODE_CALL(worker)                                                                      \
    launch(worker, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, mask_starts, masks, out, \
           B, H, Hkv, D, block_size, scale, window, softcap, sinks, NULL, 0, num_threads)

EXPORT int paged_decode_f32(DECODE_ARGS) { return DECODE_CALL(run_f32); }
EXPORT int paged_decode_bf16(DECODE_ARGS) { return DECODE_CALL(run_bf16); }
#ifdef __FLT16_MAX__
EXPORT int paged_decode_f16(DECODE_ARGS) { return DECODE_CALL(run_f16); }
#endif

/* ---------------------------------------------------------------- one step, for the native decode step
 *
 * The attention function of lmplug's native-step ABI (lmplug.kit.native): for the step's
 * `rows` decode rows, row t's q, k, v lie back to back at qkv + t * qkv_stride; k and v go to
 * slot slots[t] of layer `layer`'s float32 caches, q to a contiguous scratch, and the decode
 * kernel above attends (the same function, so the same bits as paged_decode_f32). The kernel
 * trusts the tables, so the first call of a step checks them (`checked`): -4 for a length
 * below 1 or needing more blocks than a table row holds, -5 for a block id outside the cache;
 * -2 for a slot outside the cache (each call, before anything is written); -3 for a layer
 * outside the step's. A verify step's short queries come as one row per query token (the
 * rows of paged_rows.py: token j of a sequence with c cached tokens attends to its first
 * c + j + 1 positions, tree rows masked by `mask_starts` / `masks`; both NULL: no tree). */
typedef struct {
    float *const *k_caches; /* [num_layers], each [num_blocks, block_size, Hkv, D] float32 */
    float *const *v_caches;
    int64_t num_layers;
    const int32_t *block_tables; /* [rows, bt_stride] */
    int64_t bt_stride;
    const int32_t *seq_lens; /* [rows] */
    const int64_t *slots;    /* [rows] */
    int64_t rows, H, Hkv, D, block_size, num_slots, window;
    float scale;
    float *q;        /* scratch [rows, H, D] */
    int64_t checked; /* the tables were checked (by the step's first call) */
    const int32_t *mask_starts; /* [rows] or NULL: as paged_decode_f32's */
    const uint64_t *masks;      /* [rows] or NULL */
    /* per cache layer (Gemma 2/3: windows, scales, soft-caps that differ by layer), or NULL:
     * every layer attends with scale and window, no soft-cap */
    const float *layer_scales, *layer_softcaps; /* [num_layers]; softcap 0: none */
    const int64_t *layer_windows;                /* [num_layers]; 0: none */
} step_attention_t;

static int check_tables(const step_attention_t *s) {
    const int64_t num_blocks = s->num_slots / s->block_size;
    for (int64_t t = 0; t < s->rows; t++) {
        const int64_t len = s->seq_lens[t], used = (len + s->block_size - 1) / s->block_size;
        if (len < 1 || used > s->bt_stride) return -4;
        for (int64_t b = 0; b < used; b++) {
            const int32_t id = s->block_tables[t * s->bt_stride + b];
            if (id < 0 || id >= num_blocks) return -5;
        }
    }
    return 0;
}

#define STEP_THREADS_MIN_ROWS 4 /* fewer rows: one thread (a thread started per layer costs more) */
#define CHAIN_MAX 16 /* rows of one chain attended together (a verify's k + 1) */

/* A verify's chain: consecutive rows t - 1, t of one sequence (the same blocks for every position
 * row t reads, seq_lens one apart), neither masked (tree rows attend alone), and no window that
 * would start their lists at different positions. Each group's first row into first[]
 * (first[groups] = rows); returns the number of groups. */
static int chain_groups(const step_attention_t *s, int64_t window, int32_t *first) {
    int groups = 0;
    first[0] = 0;
    for (int64_t t = 1; t < s->rows; t++) {
        const int32_t len = s->seq_lens[t];
        const int masked = s->masks && (s->mask_starts[t] >= 0 || s->mask_starts[t - 1] >= 0);
        const int64_t used = (len + s->block_size - 1) / s->block_size;
        const int joins = !masked && len == s->seq_lens[t - 1] + 1 && t - first[groups] < CHAIN_MAX &&
                          (window <= 0 || len <= window) &&
                          !memcmp(s->block_tables + t * s->bt_stride, s->block_tables + (t - 1) * s->bt_stride,
                                  (size_t)used * sizeof(int32_t));
        if (!joins) first[++groups] = (int32_t)t;
    }
    first[++groups] = (int32_t)s->rows;
    return groups;
}

EXPORT int decode_step_attention(void *ctx, int64_t layer, const float *qkv, int64_t qkv_stride, float *out,
                                 int threads) {
    step_attention_t *s = ctx;
    if (layer < 0 || layer >= s->num_layers) return -3;
    if (!s->checked) {
        const int status = check_tables(s);
        if (status) return status;
        s->checked = 1;
    }
    const int64_t qd = s->H * s->D, kd = s->Hkv * s->D;
    for (int64_t t = 0; t < s->rows; t++)
        if (s->slots[t] < 0 || s->slots[t] >= s->num_slots) return -2;
    float *kc = s->k_caches[layer], *vc = s->v_caches[layer];
    for (int64_t t = 0; t < s->rows; t++) {
        const float *row = qkv + t * qkv_stride;
        memcpy(s->q + t * qd, row, (size_t)qd * sizeof(float));
        memcpy(kc + s->slots[t] * kd, row + qd, (size_t)kd * sizeof(float));
        memcpy(vc + s->slots[t] * kd, row + qd + kd, (size_t)kd * sizeof(float));
    }
    const float scale = s->layer_scales ? s->layer_scales[layer] : s->scale;
    const float softcap = s->layer_softcaps ? s->layer_softcaps[layer] : 0.0f;
    const int64_t window = s->layer_windows ? s->layer_windows[layer] : s->window;
    int32_t local[64], *first = s->rows < 64 ? local : malloc((size_t)(s->rows + 1) * sizeof(int32_t));
    if (!first) return -1;
    const int groups = chain_groups(s, window, first);
    const int status = launch(run_f32, s->q, kc, vc, s->block_tables, s->bt_stride, s->seq_lens, s->mask_starts,
                              s->masks, out, (int)s->rows, (int)s->H, (int)s->Hkv, (int)s->D, (int)s->block_size,
                              scale, (int)window, softcap, NULL, first, groups,
                              s->rows < STEP_THREADS_MIN_ROWS ? 1 : threads);
    if (first != local) free(first);
    return status;
}
