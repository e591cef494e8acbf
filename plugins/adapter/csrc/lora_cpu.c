/* LoRA around a linear layer's native product (lmplug.kit.native's PRODUCT_ABI), for the native
 * decode step: call the base product, then add, for each row t whose slot s = rows->slots[t] is
 * >= 0, out[t] += B_s (A_s x[t]). A: [S, K R, in] (the layer's K shards' A one after another);
 * B: [S, out, R] compact: output column o of shard k (o in [bounds[k], bounds[k + 1])) holds the
 * R values that multiply the shrink's columns [k R, k R + R), so the expand reads no zeros of the
 * kit's block-diagonal layout (lmplug.kit.lora). The row -> slot map is the engine's, written
 * before every forward (n = 0: no row has an adapter, the base product alone). Each slot has a
 * dtype: float32 (A in a, B scaled), or the float16 / bfloat16 of its adapter file (A in a16, B
 * unscaled in the slot's first half, the scalings applied to the shrink's output): half the
 * bytes read per step, converted to float32 as they are loaded, accumulated in float32.
 *
 * Kernels: a portable dot product and AVX2 (+FMA, F16C) / AVX-512F (the shrink) ones compiled with
 * target attributes, chosen at run time (__builtin_cpu_supports), so the library is built without
 * -march and runs on any x86-64. They differ only in the order of the float additions.
 *
 * Threads: the update's units (a row's shard: its shrink, then its expand into the shard's own
 * columns) are split over the base product's thread pool (the GGUF kernels', handed over as
 * NativeCall.parallel_for), so no second pool of threads exists; which thread runs a unit does not
 * change its sums, so every thread count gives the same bits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define EXPORT __attribute__((visibility("default")))

typedef int (*product_fn)(void *ctx, const float *x, int64_t m, float *out, int threads);
typedef void (*range_fn)(const void *ctx, int64_t n0, int64_t n1);
/* runs range(ctx, n0, n1) over [0, n) on up to `threads` threads (lmplug.kit.native: NativeCall.parallel_for) */
typedef void (*parallel_for_fn)(range_fn range, const void *ctx, int64_t n, int threads);

typedef struct { /* the engine's row -> slot map (lmplug.kit.lora.LoRAStep) */
    int64_t n;
    const int32_t *slots;
} lora_rows_t;

typedef struct {
    product_fn base;
    void *base_ctx;
    const float *a;      /* [S, K R, in] float32: the float32 slots' A */
    const uint16_t *a16; /* [S, K R, in] 16-bit: the 16-bit slots' A */
    const float *b;      /* [S, out, R] float32, or a 16-bit slot's values in its first half */
    const int32_t *dtype; /* [S]: DT_F32 | DT_F16 | DT_BF16 */
    const float *scale;  /* [S, K]: a 16-bit slot's scalings (a float32 slot's are folded into B) */
    int64_t slots, rank, shards, in, out; /* rank: R, each shard's columns of A's rows / B */
    const int64_t *bounds;                /* shards + 1 output column bounds */
    const lora_rows_t *rows;
    int isa;
    parallel_for_fn parallel_for; /* the base product's thread pool, or NULL: the calling thread */
} lora_ctx_t;

enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
enum { E_ROWS = -201, E_SLOT = -202, E_ISA = -203, E_ALLOC = -204, E_DTYPE = -205 };

/* IEEE half -> float, exact (subnormals, infinities and NaNs included): the portable path's load. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else { /* subnormal: man 2^-24, normalised */
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define CV_F32(v) (v)
#define CV_F16(v) f16_to_f32(v)
#define CV_BF16(v) bf16_to_f32(v)

/* The dot products and expands below, once per storage type T of the slot's weights (a, b's
 * rows), each element converted to float32 as it is loaded (CV, LD8, LD16). */
#define DOT_GENERIC(NAME, T, CV)                                                                   \
    static inline __attribute__((always_inline)) float NAME(const T *a, const float *b, int64_t n) { \
        float acc[8] = {0};                                                                        \
        int64_t i = 0;                                                                             \
        for (; i + 8 <= n; i += 8)                                                                 \
            for (int j = 0; j < 8; j++) acc[j] += CV(a[i + j]) * b[i + j];                         \
        float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])); \
        for (; i < n; i++) s += CV(a[i]) * b[i];                                                   \
        return s;                                                                                  \
    }

#define EXPAND_GENERIC(NAME, T, DOT)                                                                         \
    static inline __attribute__((always_inline)) void NAME(const T *b, int64_t ldb, const float *m, int64_t n, \
                                                           float *y, int64_t o0, int64_t o1) {               \
        for (int64_t o = o0; o < o1; o++) y[o] += DOT(b + o * ldb, m, n);                                    \
    }

DOT_GENERIC(dot_generic, float, CV_F32)
DOT_GENERIC(dot_generic_f16, uint16_t, CV_F16)
DOT_GENERIC(dot_generic_bf16, uint16_t, CV_BF16)
EXPAND_GENERIC(expand_generic, float, dot_generic)
EXPAND_GENERIC(expand_generic_f16, uint16_t, dot_generic_f16)
EXPAND_GENERIC(expand_generic_bf16, uint16_t, dot_generic_bf16)

#if defined(__x86_64__)
#define AVX2 target("avx2,fma,f16c")
#define AVX512 target("avx512f,avx2,fma,f16c")
#define LD8_F32(p) _mm256_loadu_ps(p)
#define LD8_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LD8_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LD16_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LD16_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))

#define DOT_AVX2(NAME, T, LD8, CV)                                                                  \
    __attribute__((AVX2, always_inline)) static inline float NAME(const T *a, const float *b, int64_t n) { \
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();                                  \
        int64_t i = 0;                                                                              \
        for (; i + 16 <= n; i += 16) {                                                              \
            s0 = _mm256_fmadd_ps(LD8(a + i), _mm256_loadu_ps(b + i), s0);                           \
            s1 = _mm256_fmadd_ps(LD8(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);                   \
        }                                                                                           \
        if (i + 8 <= n) {                                                                           \
            s0 = _mm256_fmadd_ps(LD8(a + i), _mm256_loadu_ps(b + i), s0);                           \
            i += 8;                                                                                 \
        }                                                                                           \
        __m256 s = _mm256_add_ps(s0, s1);                                                           \
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));              \
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                                     \
        h = _mm_add_ss(h, _mm_movehdup_ps(h));                                                      \
        float r = _mm_cvtss_f32(h);                                                                 \
        for (; i < n; i++) r += CV(a[i]) * b[i];                                                    \
        return r;                                                                                   \
    }

DOT_AVX2(dot_avx2, float, LD8_F32, CV_F32)
DOT_AVX2(dot_avx2_f16, uint16_t, LD8_F16, CV_F16)
DOT_AVX2(dot_avx2_bf16, uint16_t, LD8_BF16, CV_BF16)

__attribute__((AVX512, always_inline)) static inline float dot_avx512(const float *a, const float *b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    s0 = _mm512_add_ps(s0, s1);
    if (i < n) { /* the tail, masked: at most 31 elements */
        const __mmask16 k0 = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k0, a + i), _mm512_maskz_loadu_ps(k0, b + i), s0);
        if (n - i > 16) {
            const __mmask16 k1 = (__mmask16)((1u << (n - i - 16)) - 1);
            s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k1, a + i + 16), _mm512_maskz_loadu_ps(k1, b + i + 16), s0);
        }
    }
    return _mm512_reduce_add_ps(s0);
}

/* 16-bit A: sixteen converted per load (masked 16-bit loads would need AVX-512BW: the tail is
 * one 16-wide step, then scalar). */
#define DOT_AVX512_16(NAME, LD16, CV)                                                                      \
    __attribute__((AVX512, always_inline)) static inline float NAME(const uint16_t *a, const float *b, int64_t n) { \
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();                                         \
        int64_t i = 0;                                                                                     \
        for (; i + 32 <= n; i += 32) {                                                                     \
            s0 = _mm512_fmadd_ps(LD16(a + i), _mm512_loadu_ps(b + i), s0);                                 \
            s1 = _mm512_fmadd_ps(LD16(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);                       \
        }                                                                                                  \
        s0 = _mm512_add_ps(s0, s1);                                                                        \
        if (i + 16 <= n) {                                                                                 \
            s0 = _mm512_fmadd_ps(LD16(a + i), _mm512_loadu_ps(b + i), s0);                                 \
            i += 16;                                                                                       \
        }                                                                                                  \
        float r = _mm512_reduce_add_ps(s0);                                                                \
        for (; i < n; i++) r += CV(a[i]) * b[i];                                                           \
        return r;                                                                                          \
    }

DOT_AVX512_16(dot_avx512_f16, LD16_F16, CV_F16)
DOT_AVX512_16(dot_avx512_bf16, LD16_BF16, CV_BF16)

/* y[o] += b[o * ldb .. + n] . m for o in [o0, o1), n a multiple of 8: eight outputs at a time,
 * their eight partial vectors summed across lanes together (three rounds of hadd). */
#define EXPAND_AVX2(NAME, T, LD8, DOT)                                                                      \
    __attribute__((AVX2, always_inline)) static inline void NAME(const T *b, int64_t ldb, const float *m,      \
                                                                 int64_t n, float *y, int64_t o0, int64_t o1) { \
        int64_t o = o0;                                                                                     \
        if (n % 8 == 0) {                                                                                   \
            for (; o + 8 <= o1; o += 8) {                                                                   \
                __m256 v[8];                                                                                \
                for (int i = 0; i < 8; i++) v[i] = _mm256_setzero_ps();                                     \
                for (int64_t j = 0; j < n; j += 8) {                                                        \
                    const __m256 mj = _mm256_loadu_ps(m + j);                                               \
                    for (int i = 0; i < 8; i++) v[i] = _mm256_fmadd_ps(LD8(b + (o + i) * ldb + j), mj, v[i]); \
                }                                                                                           \
                const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));   \
                const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));   \
                const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),                      \
                                                 _mm256_permute2f128_ps(u0, u1, 0x31));                     \
                _mm256_storeu_ps(y + o, _mm256_add_ps(_mm256_loadu_ps(y + o), sum));                        \
            }                                                                                               \
        }                                                                                                   \
        for (; o < o1; o++) y[o] += DOT(b + o * ldb, m, n);                                                 \
    }

EXPAND_AVX2(expand_avx2, float, LD8_F32, dot_avx2)
EXPAND_AVX2(expand_avx2_f16, uint16_t, LD8_F16, dot_avx2_f16)
EXPAND_AVX2(expand_avx2_bf16, uint16_t, LD8_BF16, dot_avx2_bf16)
#endif

EXPORT int lora_cpu_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512f")) return ISA_AVX512;
    if (avx2) return ISA_AVX2;
#endif
    return ISA_GENERIC;
}

/* One unit of the update: row t's shard k in one storage type. mid = A_s's rows [k R, k R + R) x[t]
 * (a 16-bit slot's then scaled by the shard's scaling), then y's columns of shard k += B_s mid. */
#define SHARD(DOT, EXPAND, A, B, SCALED)                                                              \
    do {                                                                                              \
        for (int64_t r = 0; r < c->rank; r++) mid[r] = DOT((A) + (k * c->rank + r) * c->in, xt, c->in); \
        if (SCALED)                                                                                   \
            for (int64_t r = 0; r < c->rank; r++) mid[r] *= c->scale[s * c->shards + k];             \
        EXPAND((B), c->rank, mid, c->rank, y, c->bounds[k], c->bounds[k + 1]);                        \
    } while (0)

/* One update as the threads share it: unit u = t * shards + k is row t's shard k. */
typedef struct {
    const lora_ctx_t *c;
    const float *x;
    float *out;
    int failed; /* a range could not allocate its scratch */
} job_t;

#define MID_STACK 1024 /* max_lora_rank's bound: mid on the stack */

/* out[t] += B_s (A_s x[t]) over units [u0, u1), one copy per kernel set (its dot products inlined:
 * the expand's are R long, one per output column, so AVX2 takes eight columns at once; the
 * AVX-512 set's expand is AVX2's, R being too short for 16 lanes), each slot read in its own
 * dtype. A unit's columns are its shard's own and its sums are the same whichever thread runs it,
 * so any split gives the one-thread bits. The slots were checked (check_rows). */
#define UNITS(NAME, TARGET, DOT, EXPAND, DOT16, EXPAND16, DOTBF, EXPANDBF)                            \
    TARGET static void NAME(const void *arg, int64_t u0, int64_t u1) {                                 \
        job_t *j = (job_t *)arg;                                                                       \
        const lora_ctx_t *c = j->c;                                                                    \
        float stack[MID_STACK];                                                                        \
        float *mid = c->rank <= MID_STACK ? stack : (float *)malloc((size_t)c->rank * sizeof(float)); \
        if (!mid) {                                                                                    \
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);                                         \
            return;                                                                                    \
        }                                                                                              \
        const int64_t kr = c->shards * c->rank;                                                        \
        for (int64_t u = u0; u < u1; u++) {                                                            \
            const int64_t t = u / c->shards, k = u % c->shards, s = c->rows->slots[t];                \
            if (s < 0) continue;                                                                       \
            const float *xt = j->x + t * c->in, *b = c->b + s * c->out * c->rank;                     \
            float *y = j->out + t * c->out;                                                            \
            const uint16_t *a16 = c->a16 + s * kr * c->in, *b16 = (const uint16_t *)b;               \
            switch (c->dtype[s]) {                                                                     \
            case DT_F32: SHARD(DOT, EXPAND, c->a + s * kr * c->in, b, 0); break;                      \
            case DT_F16: SHARD(DOT16, EXPAND16, a16, b16, 1); break;                                   \
            default: SHARD(DOTBF, EXPANDBF, a16, b16, 1); break;                                       \
            }                                                                                          \
        }                                                                                              \
        if (mid != stack) free(mid);                                                                   \
    }

UNITS(units_generic, , dot_generic, expand_generic, dot_generic_f16, expand_generic_f16, dot_generic_bf16,
      expand_generic_bf16)
#if defined(__x86_64__)
UNITS(units_avx2, __attribute__((AVX2)), dot_avx2, expand_avx2, dot_avx2_f16, expand_avx2_f16, dot_avx2_bf16,
      expand_avx2_bf16)
UNITS(units_avx512, __attribute__((AVX512)), dot_avx512, expand_avx2, dot_avx512_f16, expand_avx2_f16,
      dot_avx512_bf16, expand_avx2_bf16)
#endif

/* Every row's slot within the layer's and of a known dtype: 0, E_SLOT or E_DTYPE. */
static int check_rows(const lora_ctx_t *c, int64_t m) {
    for (int64_t t = 0; t < m; t++) {
        const int64_t s = c->rows->slots[t];
        if (s >= c->slots) return E_SLOT;
        if (s >= 0 && (c->dtype[s] < DT_F32 || c->dtype[s] > DT_BF16)) return E_DTYPE;
    }
    return 0;
}

/* The update of m rows, its units split over `threads` threads by the base product's pool
 * (c->parallel_for; NULL or 1 thread: the calling thread alone). */
static int add_lora(const lora_ctx_t *c, const float *x, int64_t m, float *out, int threads) {
    if (c->rows->n != m) return E_ROWS;
    if (c->isa > lora_cpu_isa()) return E_ISA;
    const int rc = check_rows(c, m);
    if (rc) return rc;
    range_fn units = units_generic;
#if defined(__x86_64__)
    if (c->isa == ISA_AVX512) units = units_avx512;
    if (c->isa == ISA_AVX2) units = units_avx2;
#endif
    job_t j = {c, x, out, 0};
    const int64_t n = m * c->shards;
    if (c->parallel_for && threads > 1 && n > 1)
        c->parallel_for(units, &j, n, threads);
    else
        units(&j, 0, n);
    return j.failed ? E_ALLOC : 0;
}

/* PRODUCT_ABI: the base product, then the adapters' updates on the same threads. Errors: E_ROWS
 * (the map's rows are not the product's), E_SLOT (a slot past the layer's), E_ISA, E_ALLOC,
 * E_DTYPE (a slot's dtype unknown). */
EXPORT int lora_product(void *ctx, const float *x, int64_t m, float *out, int threads) {
    const lora_ctx_t *c = (const lora_ctx_t *)ctx;
    const int status = c->base(c->base_ctx, x, m, out, threads);
    if (status || c->rows->n == 0) return status;
    return add_lora(c, x, m, out, threads);
}

/* The same update alone (tests and benchmarks: compared with the torch reference without a base
 * product), on `threads` threads where the context has a pool. */
EXPORT int lora_add(void *ctx, const float *x, int64_t m, float *out, int threads) {
    return add_lora((const lora_ctx_t *)ctx, x, m, out, threads);
}
