/* Rows of a GGUF weight dequantized to float32: a packed token embedding's lookup (the quant
 * plugin's `embedding`). This file is #included by gguf_cpu.c (one translation unit, one library).
 *
 * A decode step looks up one row of the token table; the PyTorch reference (gguf_ref.py) does it
 * in some thirty small tensor operations (a 1B Q4_K_M file's Q6_K table: about 0.24 ms of the step's
 * host time, benchmarks/profile_decode.py before and after). Each block's values come from the
 * unpacking the portable kernels use (gguf_cpu.c), then ggml's dequantize_row_* float work
 * (ggml-quants.c) with the operations of gguf_ref.py in the same order (a scale's product first,
 * then value times it, then the min: y = (d * sc) * q - (dmin * m)), so the floats are
 * bit-identical to it; the build has no fused multiply-adds (-ffp-contract=off). Portable C: a
 * lookup reads a few kilobytes. */

/* One block of `type` at blk -> y[block size]; 0, or -1 for a type this file does not read. */
static int dequant_block(const uint8_t *blk, int type, float *y) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: {
        uint8_t q[32];
        unpack32(blk, type, q);
        const float d = fp16_to_f32(load_u16(blk));
        if (type == T_Q4_1 || type == T_Q5_1) {
            const float m = fp16_to_f32(load_u16(blk + 2));
            for (int i = 0; i < 32; i++) y[i] = d * (float)q[i] + m;
        } else {
            const int offset = type == T_Q4_0 ? 8 : 16;
            for (int i = 0; i < 32; i++) y[i] = d * (float)(q[i] - offset);
        }
        return 0;
    }
    case T_Q8_0: {
        const float d = fp16_to_f32(load_u16(blk));
        for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)blk[2 + i] * d;
        return 0;
    }
    case T_Q4_K: case T_Q5_K: { /* y = (d * sc) * q - (dmin * m), a scale and a min per 32 */
        uint8_t q[256], sc[8], mn[8];
        k45_unpack(blk, type == T_Q5_K, q);
        k_scales(blk + 4, sc, mn);
        const float d = fp16_to_f32(load_u16(blk)), dmin = fp16_to_f32(load_u16(blk + 2));
        for (int j = 0; j < 8; j++) {
            const float dl = d * (float)sc[j], ml = dmin * (float)mn[j];
            for (int l = 0; l < 32; l++) y[32 * j + l] = dl * (float)q[32 * j + l] - ml;
        }
        return 0;
    }
    case T_Q6_K: case T_Q3_K: { /* y = (d * sc) * (q - offset), an int8 scale per 16 */
        const int six = type == T_Q6_K, offset = six ? 32 : 4;
        uint8_t q[256];
        int8_t sc[16];
        if (six) {
            q6_k_unpack(blk, q);
            memcpy(sc, blk + 192, sizeof sc);
        } else {
            q3_k_unpack(blk, q);
            q3_scales(blk + 96, sc);
        }
        const float d = fp16_to_f32(load_u16(blk + (six ? 208 : 108)));
        for (int j = 0; j < 16; j++) {
            const float dl = d * (float)sc[j];
            for (int l = 0; l < 16; l++) y[16 * j + l] = dl * (float)(q[16 * j + l] - offset);
        }
        return 0;
    }
    case T_IQ4_NL: {
        int8_t q[32];
        iq4_unpack32(blk + 2, q);
        const float d = fp16_to_f32(load_u16(blk));
        for (int i = 0; i < 32; i++) y[i] = d * (float)q[i];
        return 0;
    }
    case T_IQ4_XS: {
        const float d = fp16_to_f32(load_u16(blk));
        for (int s = 0; s < 8; s++) {
            int8_t q[32];
            iq4_unpack32(blk + 8 + 16 * s, q);
            const float dl = d * (float)iq4_xs_scale(blk, s);
            for (int i = 0; i < 32; i++) y[32 * s + i] = dl * (float)q[i];
        }
        return 0;
    }
    default:
        return -1;
    }
}

/* Rows [n] of `type` (each K values, at w + i * w_stride, as they lie in the file) -> out [n, K]
 * float32. 0; -2 for a type not listed in TYPES, -3 for K not a multiple of its block (as
 * gguf_mul_mat). */
EXPORT int gguf_dequantize_rows(const uint8_t *w, int64_t w_stride, int64_t n, int type, int64_t K, float *out) {
    const type_t *t = find_type(type);
    if (!t) return -2;
    if (K <= 0 || K % t->elems) return -3;
    for (int64_t i = 0; i < n; i++)
        for (int64_t b = 0; b < K / t->elems; b++)
            if (dequant_block(w + i * w_stride + b * t->bytes, type, out + i * K + b * t->elems) != 0) return -2;
    return 0;
}
