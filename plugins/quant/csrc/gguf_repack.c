/* Weights repacked into panels of 16 rows for the AVX-512 VNNI kernels (gguf_avx512.c); this
 * file is #included by gguf_cpu.c (one translation unit, one library).
 *
 * A panel holds rows 16 p .. 16 p + 15 (rows past N zero: their outputs are never stored),
 * block after block; within a block, every value the kernel needs per output row sits in one
 * 32-bit lane of a 64-byte vector (lane r = row r), so one vpdpbusd does 4 multiply-adds for
 * each of 16 rows and each row's sum stays in its lane. That keeps the portable kernel's float
 * operations per output (one accumulation per block, in block order): the results are
 * bit-identical to it. One panel block (bytes; "q chunk" = bytes 4 c .. 4 c + 3 of each row's
 * quants, rows side by side, 64 bytes):
 *   Q4_0  288 = 16 fp16 d | 4 q chunks of the 16 nibble bytes
 *   Q4_1  320 = 16 fp16 d | 16 fp16 m | 4 q chunks
 *   Q5_0  352 = 16 fp16 d | 16 32-bit words of 5th bits | 4 q chunks
 *   Q5_1  384 = 16 fp16 d | 16 fp16 m | 16 words of 5th bits | 4 q chunks
 *   Q8_0  544 = 16 fp16 d | 8 q chunks of the values + 128 (unsigned, for vpdpbusd)
 *   Q3_K 1824 = 16 fp16 d | 16 x 16 int8 scales (minus 32, unpacked) | 8 q chunks of hmask |
 *               16 q chunks of qs
 *   Q4_K 2368 = 16 fp16 d | 16 fp16 dmin | 8 x 16 scales | 8 x 16 mins (6-bit, unpacked) |
 *               32 q chunks of the 128 nibble bytes
 *   Q5_K 2880 = Q4_K's | 8 q chunks of qh
 *   Q6_K 3360 = 16 fp16 d | 16 x 16 int8 scales | 16 groups of 3 q chunks, in the order the kernel
 *               reads them (so the hardware prefetcher sees one stream): group 4 (2 h + half) + c
 *               holds ql chunks 16 h + 4 half + c and 16 h + 8 + 4 half + c, then qh chunk
 *               8 h + 4 half + c (h, half < 2, c < 4)
 *   IQ4_NL 288 = Q4_0's
 *   IQ4_XS 2208 = 16 fp16 d | 8 x 16 int8 scales (6-bit, minus 32, unpacked) | 32 q chunks of the
 *               128 nibble bytes (138 bytes a row and block, not 136)
 * (the same bytes as the rows, but the unpacked scales of Q3_K and the k45 types: 114 bytes a row
 * and block, not 110, 148, not 144, and 180, not 176; the 5-bit types' qh bits reordered: bit c of byte i of a row's word is
 * bit 4 c + i of qh, bit 4 + c is bit 16 + 4 c + i, for c, i < 4).
 */

#define PANEL 16

/* Bytes of one row and block in the panels (0: no packed kernel for the type). */
static int packed_block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q3_K: return 114;
    case T_Q4_K: return 148;
    case T_Q5_K: return 180;
    case T_Q6_K: return 210;
    case T_IQ4_NL: return 18;
    case T_IQ4_XS: return 138;
    default: return 0;
    }
}

/* Each helper below moves a field of row r's block between the panel block (p) and the row's
 * block (q): into the panel, or back to the row (`back`: the exact inverse, gguf_unrepack). */

static void move(uint8_t *p, uint8_t *q, int n, int back) { memcpy(back ? q : p, back ? p : q, (size_t)n); }

/* Lane r of q chunk c at p + 64 c <-> bytes 4 c .. 4 c + 3 of the row's field at q (xor `flip`). */
static void chunks(uint8_t *p, uint8_t *q, int r, int count, uint8_t flip, int back) {
    for (int c = 0; c < count; c++)
        for (int i = 0; i < 4; i++) {
            if (back) q[4 * c + i] = p[64 * c + 4 * r + i] ^ flip;
            else p[64 * c + 4 * r + i] = q[4 * c + i] ^ flip;
        }
}

/* A 5-bit block's qh (q) <-> row r's word at p + 4 r, as the panel kernel reads it. */
static void high_bits(uint8_t *p, uint8_t *q, int r, int back) {
    uint32_t qh = 0;
    if (!back) memcpy(&qh, q, sizeof qh);
    for (int i = 0; i < 4; i++) {
        uint8_t byte = back ? p[4 * r + i] : 0;
        for (int c = 0; c < 4; c++) {
            if (back)
                qh |= (uint32_t)((byte >> c) & 1) << (4 * c + i) | (uint32_t)((byte >> (4 + c)) & 1) << (16 + 4 * c + i);
            else
                byte |= (uint8_t)(((qh >> (4 * c + i)) & 1) << c | ((qh >> (16 + 4 * c + i)) & 1) << (4 + c));
        }
        if (!back) p[4 * r + i] = byte;
    }
    if (back) memcpy(q, &qh, sizeof qh);
}

/* Q4_K / Q5_K: the 12 bytes of 6-bit scales and mins (q) <-> one byte each at p + 16 s + r
 * (scales) and p + 128 + 16 s + r (mins); back packs them as k_scales unpacks them. */
static void k_scale_bytes(uint8_t *p, uint8_t *q, int r, int back) {
    uint8_t sc[8], mn[8];
    if (!back) k_scales(q, sc, mn);
    for (int s = 0; s < 8; s++) {
        if (back) {
            sc[s] = p[16 * s + r];
            mn[s] = p[128 + 16 * s + r];
        } else {
            p[16 * s + r] = sc[s];
            p[128 + 16 * s + r] = mn[s];
        }
    }
    if (back)
        for (int j = 0; j < 4; j++) {
            q[j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
            q[j + 4] = (uint8_t)(mn[j] | (mn[j + 4] >> 4) << 6);
            q[j + 8] = (uint8_t)((sc[j + 4] & 0x0F) | (mn[j + 4] & 0x0F) << 4);
        }
}

/* Q3_K: the 12 bytes of 6-bit scales (q) <-> the 16 scales minus 32 at p + 16 j + r; back packs
 * them as q3_scales unpacks them. */
static void q3_scale_bytes(uint8_t *p, uint8_t *q, int r, int back) {
    int8_t sc[16];
    if (!back) {
        q3_scales(q, sc);
        for (int j = 0; j < 16; j++) p[16 * j + r] = (uint8_t)sc[j];
        return;
    }
    memset(q, 0, 12);
    for (int j = 0; j < 16; j++) {
        const int v = (int8_t)p[16 * j + r] + 32;
        q[j % 8] |= (uint8_t)((v & 0x0F) << (j < 8 ? 0 : 4));
        q[8 + j % 4] |= (uint8_t)((v >> 4) << (2 * (j / 4)));
    }
}

/* IQ4_XS: the block's scales_h and scales_l (q: the block) <-> its 8 scales minus 32 at
 * p + 16 s + r; back packs them (every bit of the 6 bytes is a scale's). */
static void iq4_xs_scale_bytes(uint8_t *p, uint8_t *q, int r, int back) {
    if (!back) {
        for (int s = 0; s < 8; s++) p[16 * s + r] = (uint8_t)(int8_t)iq4_xs_scale(q, s);
        return;
    }
    uint16_t h = 0;
    memset(q + 4, 0, 4);
    for (int s = 0; s < 8; s++) {
        const int v = (int8_t)p[16 * s + r] + 32;
        q[4 + s / 2] |= (uint8_t)((v & 0x0F) << (4 * (s % 2)));
        h |= (uint16_t)(((v >> 4) & 3) << (2 * s));
    }
    memcpy(q + 2, &h, sizeof h);
}

/* Row r's block q <-> panel block p. */
static void move_block(int type, uint8_t *p, uint8_t *q, int r, int back) {
    switch (type) {
    case T_IQ4_NL: /* as Q4_0: d, then the nibbles */
    case T_Q4_0: move(p + 2 * r, q, 2, back); chunks(p + 32, q + 2, r, 4, 0, back); break;
    case T_IQ4_XS:
        move(p + 2 * r, q, 2, back);
        iq4_xs_scale_bytes(p + 32, q, r, back);
        chunks(p + 160, q + 8, r, 32, 0, back);
        break;
    case T_Q4_1:
        move(p + 2 * r, q, 2, back);
        move(p + 32 + 2 * r, q + 2, 2, back);
        chunks(p + 64, q + 4, r, 4, 0, back);
        break;
    case T_Q5_0: move(p + 2 * r, q, 2, back); high_bits(p + 32, q + 2, r, back); chunks(p + 96, q + 6, r, 4, 0, back); break;
    case T_Q5_1:
        move(p + 2 * r, q, 2, back);
        move(p + 32 + 2 * r, q + 2, 2, back);
        high_bits(p + 64, q + 4, r, back);
        chunks(p + 128, q + 8, r, 4, 0, back);
        break;
    case T_Q8_0: move(p + 2 * r, q, 2, back); chunks(p + 32, q + 2, r, 8, 0x80, back); break;
    case T_Q3_K:
        move(p + 2 * r, q + 108, 2, back);
        q3_scale_bytes(p + 32, q + 96, r, back);
        chunks(p + 288, q, r, 8, 0, back);
        chunks(p + 800, q + 32, r, 16, 0, back);
        break;
    case T_Q4_K:
    case T_Q5_K:
        move(p + 2 * r, q, 2, back);
        move(p + 32 + 2 * r, q + 2, 2, back);
        k_scale_bytes(p + 64, q + 4, r, back);
        if (type == T_Q5_K) {
            chunks(p + 320, q + 48, r, 32, 0, back);
            chunks(p + 2368, q + 16, r, 8, 0, back);
        } else {
            chunks(p + 320, q + 16, r, 32, 0, back);
        }
        break;
    case T_Q6_K:
        move(p + 2 * r, q + 208, 2, back);
        for (int j = 0; j < 16; j++) move(p + 32 + 16 * j + r, q + 192 + j, 1, back);
        for (int g = 0; g < 16; g++) {
            const int h = g / 8, half = g / 4 % 2, c = g % 4, ql = 16 * h + 4 * half + c;
            chunks(p + 288 + 192 * g, q + 4 * ql, r, 1, 0, back);
            chunks(p + 288 + 192 * g + 64, q + 4 * (ql + 8), r, 1, 0, back);
            chunks(p + 288 + 192 * g + 128, q + 128 + 4 * (8 * h + 4 * half + c), r, 1, 0, back);
        }
        break;
    }
}

/* Bytes the panels of N rows of K elements take; 0 for a type without a packed kernel or a K
 * that is not a multiple of its block. */
EXPORT int64_t gguf_packed_bytes(int type, int64_t N, int64_t K) {
    const type_t *t = find_type(type);
    const int pb = packed_block_bytes(type);
    if (!t || !pb || K <= 0 || K % t->elems || N <= 0) return 0;
    return (N + PANEL - 1) / PANEL * PANEL * (K / t->elems) * pb;
}

/* W's N rows (row n at w + n * w_stride) -> the panels at dst (gguf_packed_bytes of room).
 * 0, or -2 / -3 as gguf_mul_mat. */
EXPORT int gguf_repack(int type, const uint8_t *w, int64_t w_stride, int64_t N, int64_t K, uint8_t *dst) {
    const int64_t size = gguf_packed_bytes(type, N, K);
    if (!size) return find_type(type) && packed_block_bytes(type) ? -3 : -2;
    const type_t *t = find_type(type);
    const int64_t nb = K / t->elems, pblock = (int64_t)PANEL * packed_block_bytes(type);
    memset(dst, 0, (size_t)size);
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) /* back = 0: the row is only read */
            move_block(type, dst + (n / PANEL * nb + b) * pblock, (uint8_t *)w + n * w_stride + b * t->bytes,
                       (int)(n % PANEL), 0);
    return 0;
}

/* The inverse: the N rows of the panels at p back into rows at w + n * w_stride, the bytes
 * of the file's blocks. 0, or -2 / -3 as gguf_repack. */
EXPORT int gguf_unrepack(int type, const uint8_t *p, int64_t N, int64_t K, uint8_t *w, int64_t w_stride) {
    if (!gguf_packed_bytes(type, N, K)) return find_type(type) && packed_block_bytes(type) ? -3 : -2;
    const type_t *t = find_type(type);
    const int64_t nb = K / t->elems, pblock = (int64_t)PANEL * packed_block_bytes(type);
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) /* back = 1: the panel is only read */
            move_block(type, (uint8_t *)p + (n / PANEL * nb + b) * pblock, w + n * w_stride + b * t->bytes,
                       (int)(n % PANEL), 1);
    return 0;
}
