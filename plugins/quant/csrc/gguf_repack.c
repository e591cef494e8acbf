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
 *   Q4_K 2368 = 16 fp16 d | 16 fp16 dmin | 8 x 16 scales | 8 x 16 mins (6-bit, unpacked) |
 *               32 q chunks of the 128 nibble bytes
 *   Q5_K 2880 = Q4_K's | 8 q chunks of qh
 *   Q6_K 3360 = 16 fp16 d | 16 x 16 int8 scales | 16 groups of 3 q chunks, in the order the kernel
 *               reads them (so the hardware prefetcher sees one stream): group 4 (2 h + half) + c
 *               holds ql chunks 16 h + 4 half + c and 16 h + 8 + 4 half + c, then qh chunk
 *               8 h + 4 half + c (h, half < 2, c < 4)
 * (the same bytes as the rows, but the k45 types' unpacked scales: 148 bytes a row and block, not
 * 144, and 180, not 176; the 5-bit types' qh bits reordered: bit c of byte i of a row's word is
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
    case T_Q4_K: return 148;
    case T_Q5_K: return 180;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* Lane r of q chunk `c` at dst + 64 c: bytes from + 4 c .. + 3 of row r's block (xor `flip`). */
static void put_chunks(uint8_t *dst, const uint8_t *src, int r, int chunks, uint8_t flip) {
    for (int c = 0; c < chunks; c++)
        for (int i = 0; i < 4; i++) dst[64 * c + 4 * r + i] = src[4 * c + i] ^ flip;
}

/* A 5-bit block's qh (src) as the panel kernel reads it, into row r's word at dst + 4 r. */
static void put_high_bits(uint8_t *dst, const uint8_t *src, int r) {
    uint32_t qh;
    memcpy(&qh, src, sizeof qh);
    for (int i = 0; i < 4; i++) {
        uint8_t byte = 0;
        for (int c = 0; c < 4; c++)
            byte |= (uint8_t)(((qh >> (4 * c + i)) & 1) << c | ((qh >> (16 + 4 * c + i)) & 1) << (4 + c));
        dst[4 * r + i] = byte;
    }
}

/* Row r's block `src` into panel block `dst`. */
static void repack_block(int type, uint8_t *dst, const uint8_t *src, int r) {
    switch (type) {
    case T_Q4_0: memcpy(dst + 2 * r, src, 2); put_chunks(dst + 32, src + 2, r, 4, 0); break;
    case T_Q4_1:
        memcpy(dst + 2 * r, src, 2);
        memcpy(dst + 32 + 2 * r, src + 2, 2);
        put_chunks(dst + 64, src + 4, r, 4, 0);
        break;
    case T_Q5_0: memcpy(dst + 2 * r, src, 2); put_high_bits(dst + 32, src + 2, r); put_chunks(dst + 96, src + 6, r, 4, 0); break;
    case T_Q5_1:
        memcpy(dst + 2 * r, src, 2);
        memcpy(dst + 32 + 2 * r, src + 2, 2);
        put_high_bits(dst + 64, src + 4, r);
        put_chunks(dst + 128, src + 8, r, 4, 0);
        break;
    case T_Q8_0: memcpy(dst + 2 * r, src, 2); put_chunks(dst + 32, src + 2, r, 8, 0x80); break;
    case T_Q4_K:
    case T_Q5_K: {
        uint8_t sc[8], mn[8];
        k_scales(src + 4, sc, mn);
        memcpy(dst + 2 * r, src, 2);
        memcpy(dst + 32 + 2 * r, src + 2, 2);
        for (int s = 0; s < 8; s++) {
            dst[64 + 16 * s + r] = sc[s];
            dst[192 + 16 * s + r] = mn[s];
        }
        if (type == T_Q5_K) {
            put_chunks(dst + 320, src + 48, r, 32, 0);
            put_chunks(dst + 2368, src + 16, r, 8, 0);
        } else {
            put_chunks(dst + 320, src + 16, r, 32, 0);
        }
        break;
    }
    case T_Q6_K:
        memcpy(dst + 2 * r, src + 208, 2);
        for (int j = 0; j < 16; j++) dst[32 + 16 * j + r] = src[192 + j];
        for (int g = 0; g < 16; g++) {
            const int h = g / 8, half = g / 4 % 2, c = g % 4, q = 16 * h + 4 * half + c;
            put_chunks(dst + 288 + 192 * g, src + 4 * q, r, 1, 0);
            put_chunks(dst + 288 + 192 * g + 64, src + 4 * (q + 8), r, 1, 0);
            put_chunks(dst + 288 + 192 * g + 128, src + 128 + 4 * (8 * h + 4 * half + c), r, 1, 0);
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
        for (int64_t b = 0; b < nb; b++)
            repack_block(type, dst + (n / PANEL * nb + b) * pblock, w + n * w_stride + b * t->bytes, (int)(n % PANEL));
    return 0;
}
