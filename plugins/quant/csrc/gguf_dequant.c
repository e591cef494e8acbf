/* Rows of a GGUF weight dequantized to float32: a packed token embedding's lookup (the quant
 * plugin's `embedding`). This file is #included by gguf_cpu.c (one translation unit, one library).
 *
 * A decode step looks up one row of the token table; the PyTorch reference (gguf_ref.py) does it
 * in some thirty small tensor operations (a 1B Q4_K_M file's Q6_K table: about 0.24 ms of the step's
 * host time, benchmarks/profile_decode.py before and after). These loops are ggml's
 * dequantize_row_* (ggml-quants.c), one block at a time, with the float operations of gguf_ref.py
 * in the same order (a scale's product first, then value times it, then the min:
 * y = (d * sc) * q - (dmin * m)), so the floats are bit-identical to it; the build has no fused
 * multiply-adds (-ffp-contract=off). Portable C: a lookup reads a few kilobytes. */

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
    case T_Q4_K: case T_Q5_K: { /* sub-block j: nibbles of bytes 32 (j / 2) .., low for even j */
        const int five = type == T_Q5_K;
        const float d = fp16_to_f32(load_u16(blk)), dmin = fp16_to_f32(load_u16(blk + 2));
        const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
        uint8_t sc[8], mn[8];
        k_scales(blk + 4, sc, mn);
        for (int j = 0; j < 8; j++) {
            const float dl = d * (float)sc[j], ml = dmin * (float)mn[j];
            const uint8_t *chunk = qs + 32 * (j / 2);
            for (int l = 0; l < 32; l++) {
                int q = (j % 2 ? chunk[l] >> 4 : chunk[l] & 0x0F);
                if (five) q |= ((qh[l] >> j) & 1) << 4;
                y[32 * j + l] = dl * (float)q - ml;
            }
        }
        return 0;
    }
    case T_Q6_K: { /* ggml's loop: two halves of 128, each 4 groups of 32 from ql, qh */
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16_to_f32(load_u16(blk + 208));
        for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128)
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = (int8_t)((ql[l] & 0x0F) | ((qh[l] >> 0) & 3) << 4) - 32;
                const int q2 = (int8_t)((ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4) - 32;
                const int q3 = (int8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
                const int q4 = (int8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
                y[l] = (d * (float)sc[is]) * (float)q1;
                y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
                y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
                y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
            }
        return 0;
    }
    case T_Q3_K: { /* 16 groups of 16: 2 bits of qs at shift 2 (g / 2 % 4), minus 4 where hmask's bit is clear */
        const uint8_t *hm = blk, *qs = blk + 32;
        int8_t sc[16];
        q3_scales(blk + 96, sc);
        const float d = fp16_to_f32(load_u16(blk + 108));
        for (int g = 0; g < 16; g++) {
            const int half = g / 8, shift = 2 * ((g / 2) % 4), bit = g / 2, at = 16 * (g % 2);
            const float dl = d * (float)sc[g];
            for (int l = 0; l < 16; l++) {
                const int q = ((qs[32 * half + at + l] >> shift) & 3) - ((hm[at + l] >> bit) & 1 ? 0 : 4);
                y[16 * g + l] = dl * (float)q;
            }
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
