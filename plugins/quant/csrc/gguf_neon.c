/* The NEON kernels (aarch64), #included by gguf_cpu.c inside its aarch64 section: one set with
 * the base NEON instructions every aarch64 CPU has, one with the dotprod extension (SDOT,
 * vdotq_s32: 4 int8 products added to each int32 lane), compiled with a target attribute and
 * chosen at run time (gguf_cpu_isa), so the library is built without -march.
 *
 * Each block's integer dot products are exact in either set (the base set multiplies to int16
 * pairs: |w x| <= 128 * 127, two of them fit, then widens), and each output's float operations
 * are the portable kernel's, expression for expression and block by block: the results are
 * bit-identical to the portable kernels (tests/plugins/quant/test_gguf_neon.py runs both
 * under qemu-aarch64).
 *
 * The kernels are written once, below the NEON_SET guard, and this file includes itself twice
 * to compile them for each set: a function that uses vdotq_s32 must carry the dotprod target
 * itself, and so must every always-inline function it is inlined into. */

#ifndef NEON_SET
#define INLINE __attribute__((always_inline))

static inline float neon_half(const uint8_t *p) { /* exact, as fp16_to_f32 */
    __fp16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

/* 16 bytes of nibbles -> the low nibbles (elements 0-15) and the high ones (16-31), minus `off`. */
static inline INLINE void neon_nibbles(const uint8_t *p, int8_t off, int8x16_t q[2]) {
    const uint8x16_t v = vld1q_u8(p);
    q[0] = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))), vdupq_n_s8(off));
    q[1] = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), vdupq_n_s8(off));
}

/* A set's kernel over nr weight rows, with mc a constant for 1 row (decode) and MR rows (full
 * groups), as the AVX2 set's SPECIALIZE: the row loops unroll, the accumulators stay in registers. */
#define NEON_ROWS(name)                                                                                          \
    static NEON_TARGET void NEON_FN(name)(const uint8_t *w, int64_t ws, int64_t nr, const acts_t *a, int64_t m0, \
                                          int mc, float *out, int64_t ldo) {                                     \
        if (mc == 1)                                                                                             \
            for (int64_t i = 0; i < nr; i++) NEON_FN(name##_body)(w + i * ws, a, m0, 1, out + i, ldo);           \
        else if (mc == MR)                                                                                       \
            for (int64_t i = 0; i < nr; i++) NEON_FN(name##_body)(w + i * ws, a, m0, MR, out + i, ldo);          \
        else                                                                                                     \
            for (int64_t i = 0; i < nr; i++) NEON_FN(name##_body)(w + i * ws, a, m0, mc, out + i, ldo);          \
    }

#define NEON_SET 1
#define NEON_FN(name) name##_neon
#define NEON_TARGET
#include "gguf_neon.c"
#undef NEON_SET
#undef NEON_FN
#undef NEON_TARGET

#define NEON_SET 2
#define NEON_FN(name) name##_dotprod
#define NEON_TARGET __attribute__((target("arch=armv8.2-a+dotprod")))
#include "gguf_neon.c"
#undef NEON_SET
#undef NEON_FN
#undef NEON_TARGET

/* Set 1's (NEON) or 2's (dotprod) kernel of a type; NULL for a type without one here (its
 * portable kernel runs). */
static rows_fn neon_kernel(int type, int set) {
    switch (type) {
    case T_Q4_0: return set == 2 ? q4_0_dotprod : q4_0_neon;
    case T_Q4_1: return set == 2 ? q4_1_dotprod : q4_1_neon;
    case T_Q8_0: return set == 2 ? q8_0_dotprod : q8_0_neon;
    case T_Q4_K: return set == 2 ? q4_k_dotprod : q4_k_neon;
    case T_Q5_K: return set == 2 ? q5_k_dotprod : q5_k_neon;
    case T_Q6_K: return set == 2 ? q6_k_dotprod : q6_k_neon;
    default: return NULL;
    }
}

#else /* ---------------------------------------------------------------- one kernel set */

/* acc's lanes + the 16 products w[i] * x[i] (exact in int32, spread over the lanes). */
static inline INLINE NEON_TARGET int32x4_t NEON_FN(dot16)(int32x4_t acc, int8x16_t w, const int8_t *x) {
    const int8x16_t y = vld1q_s8(x);
#if NEON_SET == 2
    return vdotq_s32(acc, w, y);
#else
    return vpadalq_s16(acc, vmlal_high_s8(vmull_s8(vget_low_s8(w), vget_low_s8(y)), w, y));
#endif
}

/* Q4_0, Q4_1 and Q8_0 (blocks of 32): one weight row times mc activation rows. */
static inline INLINE NEON_TARGET void NEON_FN(small_body)(const uint8_t *w, const int type, const acts_t *a,
                                                          int64_t m0, const int mc, float *out, int64_t ldo) {
    const int bytes = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 34;
    float acc[MR] = {0};
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * bytes;
        const float dw = neon_half(blk), mw = type == T_Q4_1 ? neon_half(blk + 2) : 0.0f;
        int8x16_t q[2];
        if (type == T_Q8_0) {
            q[0] = vld1q_s8((const int8_t *)blk + 2);
            q[1] = vld1q_s8((const int8_t *)blk + 18);
        } else {
            neon_nibbles(blk + (type == T_Q4_1 ? 4 : 2), type == T_Q4_0 ? 8 : 0, q);
        }
        for (int r = 0; r < mc; r++) {
            const int64_t m = m0 + r;
            const int8_t *qx = ROW(a, m) + b * 32;
            const int32_t isum = vaddvq_s32(NEON_FN(dot16)(NEON_FN(dot16)(vdupq_n_s32(0), q[0], qx), q[1], qx + 16));
            if (type == T_Q4_1)
                acc[r] += dw * a->d[m * a->ld + b] * (float)isum + mw * a->ds[m * a->ld + b];
            else
                acc[r] += dw * a->d[m * a->ld + b] * (float)isum;
        }
    }
    for (int r = 0; r < mc; r++) out[r * ldo] = acc[r];
}

/* Q4_K, and Q5_K (five): 8 sub-blocks of 32 unsigned values, a 6-bit scale and min each. */
static inline INLINE NEON_TARGET void NEON_FN(k45_body)(const uint8_t *w, const int five, const acts_t *a,
                                                        int64_t m0, const int mc, float *out, int64_t ldo) {
    const int bytes = five ? 176 : 144;
    float acc[MR] = {0};
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * bytes, *qs = blk + (five ? 48 : 16);
        const float d = neon_half(blk), dmin = neon_half(blk + 2);
        uint8_t sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        const int32x4_t mn0 = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vld1_u8(mn)))));
        const int32x4_t mn1 = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(vmovl_u8(vld1_u8(mn)))));
        int8x16_t q[8][2]; /* sub-block s: elements 32 s .. + 16, + 16 .. + 32 */
        for (int j = 0; j < 4; j++)
            for (int h = 0; h < 2; h++) {
                const uint8x16_t v = vld1q_u8(qs + 32 * j + 16 * h);
                q[2 * j][h] = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F)));
                q[2 * j + 1][h] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
            }
        if (five)
            for (int h = 0; h < 2; h++) {
                const uint8x16_t qh = vld1q_u8(blk + 16 + 16 * h); /* bit s: bit 4 of sub-block s */
                for (int s = 0; s < 8; s++) {
                    const uint8x16_t bit = vandq_u8(vtstq_u8(qh, vdupq_n_u8((uint8_t)(1u << s))), vdupq_n_u8(16));
                    q[s][h] = vorrq_s8(q[s][h], vreinterpretq_s8_u8(bit));
                }
            }
        for (int r = 0; r < mc; r++) {
            const int64_t m = m0 + r;
            const int8_t *qx = ROW(a, m) + b * 256;
            const int16_t *bs = a->s + m * a->ns + b * 16;
            int32x4_t sums = vdupq_n_s32(0);
            for (int s = 0; s < 8; s++) {
                const int32x4_t dot = NEON_FN(dot16)(NEON_FN(dot16)(vdupq_n_s32(0), q[s][0], qx + 32 * s),
                                                     q[s][1], qx + 32 * s + 16);
                sums = vmlaq_n_s32(sums, dot, sc[s]);
            }
            const int32x4_t pairs0 = vpaddlq_s16(vld1q_s16(bs)), pairs1 = vpaddlq_s16(vld1q_s16(bs + 8));
            const int32_t isum = vaddvq_s32(sums), msum = vaddvq_s32(vmlaq_s32(vmulq_s32(pairs0, mn0), pairs1, mn1));
            const float dx = a->d[m * a->ld + b];
            acc[r] += d * dx * (float)isum - dmin * dx * (float)msum;
        }
    }
    for (int r = 0; r < mc; r++) out[r * ldo] = acc[r];
}

/* Q6_K: 16 sub-blocks of 16 values 0..63 (the value is q - 32), an int8 scale each. */
static inline INLINE NEON_TARGET void NEON_FN(q6_k_body)(const uint8_t *w, const acts_t *a, int64_t m0, const int mc,
                                                         float *out, int64_t ldo) {
    float acc[MR] = {0};
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = w + b * 210, *ql = blk, *qh = blk + 128;
        const float d = neon_half(blk + 208);
        const int8_t *sc = (const int8_t *)(blk + 192);
        const int8x16_t sc8 = vld1q_s8(sc);
        const int16x8_t sc0 = vmovl_s8(vget_low_s8(sc8)), sc1 = vmovl_high_s8(sc8);
        int8x16_t q[16]; /* sub-block j: elements 16 j .. + 16 */
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 2; c++) { /* the 16 positions l = 16 c .. + 16 of each 32-group */
                const uint8x16_t l0 = vld1q_u8(ql + 64 * h + 16 * c), l1 = vld1q_u8(ql + 64 * h + 32 + 16 * c);
                const uint8x16_t hb = vld1q_u8(qh + 32 * h + 16 * c);
                const uint8x16_t lo[4] = {vandq_u8(l0, vdupq_n_u8(0x0F)), vandq_u8(l1, vdupq_n_u8(0x0F)),
                                          vshrq_n_u8(l0, 4), vshrq_n_u8(l1, 4)};
                const uint8x16_t hi[4] = {vshlq_n_u8(vandq_u8(hb, vdupq_n_u8(0x03)), 4),
                                          vshlq_n_u8(vandq_u8(hb, vdupq_n_u8(0x0C)), 2),
                                          vandq_u8(hb, vdupq_n_u8(0x30)),
                                          vshrq_n_u8(vandq_u8(hb, vdupq_n_u8(0xC0)), 2)};
                for (int t = 0; t < 4; t++) q[8 * h + 2 * t + c] = vreinterpretq_s8_u8(vorrq_u8(lo[t], hi[t]));
            }
        for (int r = 0; r < mc; r++) {
            const int64_t m = m0 + r;
            const int8_t *qx = ROW(a, m) + b * 256;
            const int16_t *bs = a->s + m * a->ns + b * 16;
            int32x4_t sums = vdupq_n_s32(0);
            for (int j = 0; j < 16; j++) sums = vmlaq_n_s32(sums, NEON_FN(dot16)(vdupq_n_s32(0), q[j], qx + 16 * j), sc[j]);
            const int16x8_t bs0 = vld1q_s16(bs), bs1 = vld1q_s16(bs + 8); /* the -32: 32 * sum of sc[j] bs[j] */
            int32x4_t off = vmlal_high_s16(vmull_s16(vget_low_s16(sc0), vget_low_s16(bs0)), sc0, bs0);
            off = vmlal_high_s16(vmlal_s16(off, vget_low_s16(sc1), vget_low_s16(bs1)), sc1, bs1);
            const int32_t isum = vaddvq_s32(sums) - 32 * vaddvq_s32(off);
            acc[r] += d * a->d[m * a->ld + b] * (float)isum;
        }
    }
    for (int r = 0; r < mc; r++) out[r * ldo] = acc[r];
}

#define ONE_TYPE(name, call)                                                                          \
    static inline INLINE NEON_TARGET void NEON_FN(name##_body)(const uint8_t *w, const acts_t *a, int64_t m0,   \
                                                               const int mc, float *out, int64_t ldo) {  \
        call;                                                                                        \
    }                                                                                                \
    NEON_ROWS(name)
ONE_TYPE(q4_0, NEON_FN(small_body)(w, T_Q4_0, a, m0, mc, out, ldo))
ONE_TYPE(q4_1, NEON_FN(small_body)(w, T_Q4_1, a, m0, mc, out, ldo))
ONE_TYPE(q8_0, NEON_FN(small_body)(w, T_Q8_0, a, m0, mc, out, ldo))
ONE_TYPE(q4_k, NEON_FN(k45_body)(w, 0, a, m0, mc, out, ldo))
ONE_TYPE(q5_k, NEON_FN(k45_body)(w, 1, a, m0, mc, out, ldo))
#undef ONE_TYPE
NEON_ROWS(q6_k)

#endif /* NEON_SET */
