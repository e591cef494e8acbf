/* LoRA around a linear layer's native product (lmplug.kit.native's PRODUCT_ABI), for the native
 * decode step: call the base product, then add, for each row t whose slot s = rows->slots[t] is
 * >= 0, out[t] += B_s (A_s x[t]). A: [S, K R, in] (the layer's K shards' A one after another);
 * B: [S, out, R] compact: output column o of shard k (o in [bounds[k], bounds[k + 1])) holds the
 * R values that multiply the shrink's columns [k R, k R + R), so the expand reads no zeros of the
 * kit's block-diagonal layout (lmplug.kit.lora). The row -> slot map is the engine's, written
 * before every forward (n = 0: no row has an adapter, the base product alone).
 *
 * Kernels: a portable dot product and AVX2 (+FMA) / AVX-512F (the shrink) ones compiled with target
 * attributes, chosen at run time (__builtin_cpu_supports), so the library is built without
 * -march and runs on any x86-64. They differ only in the order of the float additions.
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define EXPORT __attribute__((visibility("default")))

typedef int (*product_fn)(void *ctx, const float *x, int64_t m, float *out, int threads);

typedef struct { /* the engine's row -> slot map (lmplug.kit.lora.LoRAStep) */
    int64_t n;
    const int32_t *slots;
} lora_rows_t;

typedef struct {
    product_fn base;
    void *base_ctx;
    const float *a, *b;
    int64_t slots, rank, shards, in, out; /* rank: R, each shard's columns of A's rows / B */
    const int64_t *bounds;                /* shards + 1 output column bounds */
    const lora_rows_t *rows;
    int isa;
} lora_ctx_t;

enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum { E_ROWS = -201, E_SLOT = -202, E_ISA = -203, E_ALLOC = -204 };

static inline __attribute__((always_inline)) float dot_generic(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"), always_inline)) static inline float dot_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    if (i + 8 <= n) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        i += 8;
    }
    __m256 s = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float r = _mm_cvtss_f32(h);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

__attribute__((target("avx512f"), always_inline)) static inline float dot_avx512(const float *a, const float *b, int64_t n) {
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

/* y[o] += b[o * ldb .. + n] . m for o in [o0, o1), n a multiple of 8: eight outputs at a time,
 * their eight partial vectors summed across lanes together (three rounds of hadd). */
__attribute__((target("avx2,fma"), always_inline)) static inline void expand_avx2(const float *b, int64_t ldb,
                                                                                    const float *m, int64_t n,
                                                                                    float *y, int64_t o0, int64_t o1) {
    int64_t o = o0;
    if (n % 8 == 0) {
        for (; o + 8 <= o1; o += 8) {
            __m256 v[8];
            for (int i = 0; i < 8; i++) v[i] = _mm256_setzero_ps();
            for (int64_t j = 0; j < n; j += 8) {
                const __m256 mj = _mm256_loadu_ps(m + j);
                for (int i = 0; i < 8; i++) v[i] = _mm256_fmadd_ps(_mm256_loadu_ps(b + (o + i) * ldb + j), mj, v[i]);
            }
            const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
            const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
            const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
            _mm256_storeu_ps(y + o, _mm256_add_ps(_mm256_loadu_ps(y + o), sum));
        }
    }
    for (; o < o1; o++) y[o] += dot_avx2(b + o * ldb, m, n);
}
#endif

static inline __attribute__((always_inline)) void expand_generic(const float *b, int64_t ldb, const float *m,
                                                                 int64_t n, float *y, int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; o++) y[o] += dot_generic(b + o * ldb, m, n);
}

EXPORT int lora_cpu_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_GENERIC;
}

/* out[t] += B_s (A_s x[t]) for each adapted row, one copy per kernel set (its dot products inlined:
 * the expand's are R long, one per output column, so AVX2 takes eight columns at once; the
 * AVX-512 set's expand is AVX2's, R being too short for 16 lanes). mid: K R floats of scratch. */
#define ADD_LORA(NAME, DOT, EXPAND, TARGET)                                                                        \
    TARGET static int NAME(const lora_ctx_t *c, const float *x, int64_t m, float *out, float *mid) {        \
        const int64_t kr = c->shards * c->rank;                                                              \
        for (int64_t t = 0; t < m; t++) {                                                                    \
            const int64_t s = c->rows->slots[t];                                                             \
            if (s < 0) continue;                                                                             \
            if (s >= c->slots) return E_SLOT;                                                                \
            const float *a = c->a + s * kr * c->in, *b = c->b + s * c->out * c->rank, *xt = x + t * c->in;  \
            for (int64_t r = 0; r < kr; r++) mid[r] = DOT(a + r * c->in, xt, c->in);                        \
            float *y = out + t * c->out;                                                                     \
            for (int64_t k = 0; k < c->shards; k++) {                                                        \
                EXPAND(b, c->rank, mid + k * c->rank, c->rank, y, c->bounds[k], c->bounds[k + 1]);          \
            }                                                                                                \
        }                                                                                                    \
        return 0;                                                                                            \
    }

ADD_LORA(add_lora_generic, dot_generic, expand_generic, )
#if defined(__x86_64__)
ADD_LORA(add_lora_avx2, dot_avx2, expand_avx2, __attribute__((target("avx2,fma"))))
ADD_LORA(add_lora_avx512, dot_avx512, expand_avx2, __attribute__((target("avx512f,avx2,fma"))))
#endif

static int add_lora(const lora_ctx_t *c, const float *x, int64_t m, float *out, float *mid) {
#if defined(__x86_64__)
    if (c->isa == ISA_AVX512) return add_lora_avx512(c, x, m, out, mid);
    if (c->isa == ISA_AVX2) return add_lora_avx2(c, x, m, out, mid);
#endif
    return add_lora_generic(c, x, m, out, mid);
}

/* PRODUCT_ABI: the base product, then the adapters' updates. Errors: E_ROWS (the map's rows are
 * not the product's), E_SLOT (a slot past the layer's), E_ISA, E_ALLOC. */
EXPORT int lora_product(void *ctx, const float *x, int64_t m, float *out, int threads) {
    const lora_ctx_t *c = (const lora_ctx_t *)ctx;
    const int status = c->base(c->base_ctx, x, m, out, threads);
    if (status || c->rows->n == 0) return status;
    if (c->rows->n != m) return E_ROWS;
    if (c->isa > lora_cpu_isa()) return E_ISA;
    const int64_t kr = c->shards * c->rank;
    float stack[4096];
    float *mid = kr <= 4096 ? stack : (float *)malloc((size_t)kr * sizeof(float));
    if (!mid) return E_ALLOC;
    const int rc = add_lora(c, x, m, out, mid);
    if (mid != stack) free(mid);
    return rc;
}

/* The same update alone (tests: compared with the torch reference without a base product). */
EXPORT int lora_add(void *ctx, const float *x, int64_t m, float *out) {
    const lora_ctx_t *c = (const lora_ctx_t *)ctx;
    if (c->rows->n != m) return E_ROWS;
    if (c->isa > lora_cpu_isa()) return E_ISA;
    const int64_t kr = c->shards * c->rank;
    float *mid = (float *)malloc((size_t)(kr ? kr : 1) * sizeof(float));
    if (!mid) return E_ALLOC;
    const int rc = add_lora(c, x, m, out, mid);
    free(mid);
    return rc;
}
