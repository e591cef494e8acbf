/* MXFP4 weights on the CPU: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), W kept packed.
 *
 * Layout (OCP MX v1.0, as HF checkpoints store it): row n of W is K / 32 blocks; block g has 16
 * bytes blocks[n, g, :] (byte j: element 2j in its low nibble, 2j + 1 in its high) and one E8M0
 * scale scales[n, g]. An FP4 E2M1 nibble is sign (bit 3) and magnitude (bits 2-0) from
 * {0, 0.5, 1, 1.5, 2, 3, 4, 6}; the element is that times 2^(scale - 127) (scale 255: NaN).
 *
 * Each weight row is decoded once per call into float32 (exact: a magnitude has at most two
 * significant bits, so times a power of two it rounds nowhere, subnormals included), then
 * dotted with every activation row. Kernels: portable C, AVX2 (+FMA) and AVX-512 F, the SIMD
 * ones compiled with a target attribute and chosen at run time (__builtin_cpu_supports; the
 * Python side also bounds them by /proc/cpuinfo's flags), so the library is built without
 * -march. The decode gives the same bits in all three. The portable dot product keeps 16 lane
 * sums (a product rounded, then added: no FMA, -ffp-contract=off) and adds them up as a tree;
 * the AVX-512 one does exactly that in one register, so it gives the portable bits. The AVX2 one
 * (8 lanes, 4 accumulators, FMA) differs only in the order and rounding of the additions.
 *
 * Threads: the output rows are split over the GGUF kernels' thread pool (csrc/gguf_cpu.c's
 * gguf_cpu_parallel_for, whose address the caller passes; NULL or 1 thread: the calling thread
 * alone), so no second pool of threads exists. Which thread computes a row does not change it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86 1
#include <immintrin.h>
#else
#define HAVE_X86 0
#endif

#define EXPORT __attribute__((visibility("default")))
#define ISA_GENERIC 0
#define ISA_AVX2 1
#define ISA_AVX512 2
#define LANES 16 /* the portable and AVX-512 dot products' lane sums */

typedef void (*range_fn)(const void *ctx, int64_t n0, int64_t n1);
typedef void (*parallel_for_fn)(range_fn range, const void *ctx, int64_t n, int threads);

static const float FP4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2^(s - 127) exactly; NaN for 255 */
static float e8m0(uint8_t s) {
    if (s == 255) return NAN;
    if (s == 0) return 0x1p-127f;  /* subnormal */
    union { uint32_t u; float f; } v = {(uint32_t)s << 23};
    return v.f;
}

static void decode_generic(const uint8_t *blocks, const uint8_t *scales, int64_t groups, float *out) {
    for (int64_t g = 0; g < groups; g++) {
        float s = e8m0(scales[g]);
        const uint8_t *b = blocks + g * 16;
        for (int j = 0; j < 16; j++) {
            out[g * 32 + 2 * j] = FP4[b[j] & 15] * s;
            out[g * 32 + 2 * j + 1] = FP4[b[j] >> 4] * s;
        }
    }
}

/* k a multiple of LANES (of 32, here) */
static float dot_generic(const float *a, const float *b, int64_t k) {
    float acc[LANES] = {0.0f};
    for (int64_t i = 0; i < k; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float p = a[i + l] * b[i + l];
            acc[l] = acc[l] + p;
        }
    for (int width = LANES / 2; width > 0; width /= 2)  /* the AVX-512 reduction's order */
        for (int l = 0; l < width; l++) acc[l] = acc[l] + acc[l + width];
    return acc[0];
}

#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma")))

/* 8 elements from 8 index bytes: magnitude by a lane permute of the 8 magnitudes, sign by bit 3 */
AVX2 static inline __m256 fp4x8(__m128i idx8, __m256 mags, __m256 scale) {
    __m256i idx = _mm256_cvtepu8_epi32(idx8);
    __m256 mag = _mm256_permutevar8x32_ps(mags, idx);  /* uses the low 3 bits */
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
    return _mm256_mul_ps(_mm256_xor_ps(mag, _mm256_castsi256_ps(sign)), scale);
}

AVX2 static void decode_avx2(const uint8_t *blocks, const uint8_t *scales, int64_t groups, float *out) {
    const __m256 mags = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t g = 0; g < groups; g++) {
        __m256 s = _mm256_set1_ps(e8m0(scales[g]));
        __m128i b = _mm_loadu_si128((const __m128i *)(blocks + g * 16));
        __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  /* elements 0-15, 16-31 */
        float *o = out + g * 32;
        _mm256_storeu_ps(o, fp4x8(first, mags, s));
        _mm256_storeu_ps(o + 8, fp4x8(_mm_srli_si128(first, 8), mags, s));
        _mm256_storeu_ps(o + 16, fp4x8(second, mags, s));
        _mm256_storeu_ps(o + 24, fp4x8(_mm_srli_si128(second, 8), mags, s));
    }
}

AVX2 static float dot_avx2(const float *a, const float *b, int64_t k) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= k; i += 32)
        for (int r = 0; r < 4; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * r), _mm256_loadu_ps(b + i + 8 * r), acc[r]);
    __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float out = _mm_cvtss_f32(h);
    for (; i < k; i++) out += a[i] * b[i];
    return out;
}
#define AVX512 __attribute__((target("avx512f")))

AVX512 static void decode_avx512(const uint8_t *blocks, const uint8_t *scales, int64_t groups, float *out) {
    const __m512 lut = _mm512_loadu_ps(FP4);  /* all 16 nibbles, signs included */
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t g = 0; g < groups; g++) {
        const __m512 s = _mm512_set1_ps(e8m0(scales[g]));
        const __m128i b = _mm_loadu_si128((const __m128i *)(blocks + g * 16));
        const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        const __m128i first = _mm_unpacklo_epi8(lo, hi), second = _mm_unpackhi_epi8(lo, hi);  /* 0-15, 16-31 */
        _mm512_storeu_ps(out + g * 32, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(first), lut), s));
        _mm512_storeu_ps(out + g * 32 + 16, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(second), lut), s));
    }
}

/* dot_generic's lanes and reduction, in one register (k a multiple of 16) */
AVX512 static float dot_avx512(const float *a, const float *b, int64_t k) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += LANES)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    const __m256 lo = _mm512_castps512_ps256(acc);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    const __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

/* the best kernel set this CPU runs */
EXPORT int mxfp4_cpu_isa(void) {
#if HAVE_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return ISA_GENERIC;
    return __builtin_cpu_supports("avx512f") ? ISA_AVX512 : ISA_AVX2;
#endif
    return ISA_GENERIC;
}

static void decode_row(const uint8_t *blocks, const uint8_t *scales, int64_t groups, float *out, int isa) {
#if HAVE_X86
    if (isa == ISA_AVX512) { decode_avx512(blocks, scales, groups, out); return; }
    if (isa == ISA_AVX2) { decode_avx2(blocks, scales, groups, out); return; }
#endif
    (void)isa;
    decode_generic(blocks, scales, groups, out);
}

static float dot(const float *a, const float *b, int64_t k, int isa) {
#if HAVE_X86
    if (isa == ISA_AVX512) return dot_avx512(a, b, k);
    if (isa == ISA_AVX2) return dot_avx2(a, b, k);
#endif
    (void)isa;
    return dot_generic(a, b, k);
}

/* rows x groups blocks -> rows x groups x 32 floats. 0, or -4: isa not available here. */
EXPORT int mxfp4_dequantize(const uint8_t *blocks, const uint8_t *scales, int64_t rows, int64_t groups,
                            float *out, int isa) {
    if (isa < 0 || isa > mxfp4_cpu_isa()) return -4;
    for (int64_t n = 0; n < rows; n++)
        decode_row(blocks + n * groups * 16, scales + n * groups, groups, out + n * groups * 32, isa);
    return 0;
}

typedef struct {
    const float *x, *bias;
    const uint8_t *blocks, *scales;
    float *out;
    int64_t m, k, n;
    int isa;
    int failed; /* set (atomically) by a range that could not allocate its row */
} linear_t;

/* output columns [n0, n1): each weight row decoded once, dotted with every activation row */
static void linear_rows(const void *ctx, int64_t n0, int64_t n1) {
    const linear_t *c = ctx;
    float *row = malloc(sizeof(float) * (size_t)c->k);
    if (!row) {
        __atomic_store_n(&((linear_t *)ctx)->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    const int64_t groups = c->k / 32;
    for (int64_t j = n0; j < n1; j++) {
        decode_row(c->blocks + j * groups * 16, c->scales + j * groups, groups, row, c->isa);
        const float b = c->bias ? c->bias[j] : 0.0f;
        for (int64_t i = 0; i < c->m; i++) c->out[i * c->n + j] = dot(c->x + i * c->k, row, c->k, c->isa) + b;
    }
    free(row);
}

/* out[M, N] = x[M, K] @ W^T (+ bias[N] unless NULL); x rows contiguous (stride K), K = 32 groups;
 * the N rows split over `threads` threads by `parallel_for` (NULL: this thread alone).
 * 0; -1: no scratch memory; -3: K not a multiple of 32; -4: isa not available here. */
EXPORT int mxfp4_linear(const float *x, int64_t m, int64_t k, const uint8_t *blocks, const uint8_t *scales,
                        int64_t n, const float *bias, float *out, int isa, int threads, parallel_for_fn parallel_for) {
    if (isa < 0 || isa > mxfp4_cpu_isa()) return -4;
    if (k % 32) return -3;
    linear_t c = {x, bias, blocks, scales, out, m, k, n, isa, 0};
    if (parallel_for && threads > 1)
        parallel_for(linear_rows, &c, n, threads);
    else
        linear_rows(&c, 0, n);
    return c.failed ? -1 : 0;
}
