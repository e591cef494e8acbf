/* The AVX-512 (F, BW, VNNI) kernels over 16-row panels (gguf_repack.c), #included by
 * gguf_cpu.c inside its x86-64 section. Lane r of every vector is weight row r of the panel:
 * vpdpbusd multiplies 4 unsigned weight bytes by 4 signed activation bytes (broadcast to all
 * lanes) and adds them to the lane's int32 sum, so a block's integer dot product of each row
 * is exact in its lane; the float work per output is then the portable kernel's, operation
 * for operation (products in its order, one addition per block, no FMA), which makes the
 * results bit-identical to the portable kernels. Signed weights are stored + 8 (Q4_0's
 * nibbles as they are) or + 128 (Q8_0), and the offset times the block's activation sum
 * (acts_t.s) is subtracted from the integer sum. The panel is read once, in memory order,
 * for up to MR activation rows; outputs past the panel's real rows are masked off.
 * Prefetch: at one row the kernel streams the panels (memory-bound) and the hardware
 * prefetcher alone does best; at the row counts in PF_L2_ROWS (from 3; from 2 for Q4_0, Q3_K and
 * Q5_K; Q6_K: PF_L2_ROWS_Q6K, 2 and from 5) each panel block asks for the bytes PF_L2_AHEAD past
 * it into L2 (prefetcht1: into L1 it evicted the activation rows,
 * which every panel block reads again, and made it worse). There the kernel does several rows'
 * arithmetic per byte, reads slower than the hardware prefetcher runs ahead of, and without the
 * hint it waited on memory: 8 KiB ahead, one thread, 1B shapes, bench_gguf_builds.py old / new
 * (GB/s of weights): 4 rows Q4_0 12.9 -> 19.2, Q4_1 13.5 -> 21.4, Q8_0 16.3 -> 27.1, Q4_K
 * 13.3 -> 18.8; 5 rows Q4_K 10.4 -> 16.1, Q5_K 6.7 -> 14.9, Q8_0 19.2 -> 26.2, Q4_1 14.5 -> 17.2,
 * IQ4_XS 12.7 -> 16.2; 3 rows Q5_K 7.5 -> 18.1, Q4_1 19.1 -> 26.1; 8 rows Q6_K 7.4 -> 9.3,
 * Q8_0 11.6 -> 19.3. At one row the same hint lost 20-35% (Q4_K 26.1 -> 20.7, Q6_K 28.8 -> 18.6),
 * at two 0-9% (with the row counts' kernels inlined into one function; apart, 2 rows: Q5_K 14.0
 * -> 16.6, Q3_K 11.7 -> 16.0, Q6_K 17.2 -> 20.2, Q4_0 27.4 -> 29.6; Q4_K 24.6 -> 23.5, Q4_1 and
 * Q8_0 -3%: not there); Q6_K lost at 3 and 4 rows (20.8 -> 16.4, 18.9 -> 16.5; apart 18.0 -> 16.1,
 * 17.7 -> 16.5) and is even at 5. The
 * 5-bit types' values are stored unsigned (Q5_0's + 16, as in the file); the IQ4 types' are looked
 * up + 128 (their offset subtracted as Q8_0's). */

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

static inline INLINE AVX512 __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

static inline INLINE AVX512 __m512 f16x16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

#define PF_L2_AHEAD 8192  /* bytes past the panel block in use that are asked for into L2 */
#define PF_FROM(n) (0x1FFu & ~((1u << (n)) - 1u)) /* a set of row counts (bit mc): n .. 8 */
#define PF_L2_ROWS PF_FROM(3)                        /* the row counts at which the panels prefetch */
#define PF_L2_ROWS_TWO PF_FROM(2)                    /* Q4_0's, Q3_K's, Q5_K's (module comment) */
#define PF_L2_ROWS_Q6K ((1u << 2) | PF_FROM(5))      /* Q6_K's */

/* The panel block at p (bytes long)'s lines PF_L2_AHEAD ahead into L2 at the row counts in `rows`
 * (mc and rows are constants in each row count's kernel: no test at run time; no fault past the end).
 * This and touch_head have no target attribute (no SIMD in them): the AVX-VNNI set inlines them too. */
static inline INLINE void prefetch_l2(const uint8_t *p, int bytes, const int mc, const unsigned rows) {
    if ((rows >> mc) & 1u)
        for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + PF_L2_AHEAD + o, _MM_HINT_T1);
}

/* A K-quant panel block's head lines (its scales and mins, bytes 0-319) loaded first and in order:
 * the kernels read the quants first and the head after, a jump back five lines a block that the
 * hardware prefetcher follows badly; touched, the block is one ascending stream. */
static inline INLINE void touch_head(const uint8_t *blk) {
    const uint8_t t0 = blk[0], t1 = blk[64], t2 = blk[128], t3 = blk[192], t4 = blk[256];
    __asm__ volatile("" : : "r"(t0), "r"(t1), "r"(t2), "r"(t3), "r"(t4));
}

static inline INLINE AVX512 void store_rows(const __m512 *acc, int mc, int64_t nr, float *out, int64_t ldo) {
    const __mmask16 keep = nr >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nr) - 1);
    for (int r = 0; r < mc; r++) _mm512_mask_storeu_ps(out + r * ldo, keep, acc[r]);
}

/* Q4_0 (block 288 bytes, offset 8), Q4_1 (320, none: + m * ds), Q5_0 (352, 16), Q5_1 (384, none)
 * and Q8_0 (544, 128). The 5-bit types' high bits: byte i of a lane's word holds in bit c the
 * 5th bit of element 4 c + i and in bit 4 + c that of element 16 + 4 c + i (gguf_repack.c), so
 * chunk c's come to bit 4 by one shift (of 16-bit lanes: the mask keeps bits of the same byte). */
static inline INLINE AVX512 void small_panel(const uint8_t *p, int64_t nr, const acts_t *a, int64_t m0, const int mc,
                                             float *out, int64_t ldo, const int type) {
    const int pb = type == T_Q4_0 ? 288 : type == T_Q4_1 ? 320 : type == T_Q5_0 ? 352 : type == T_Q5_1 ? 384 : 544;
    const int with_min = type == T_Q4_1 || type == T_Q5_1, five = type == T_Q5_0 || type == T_Q5_1;
    const int high = with_min ? 64 : 32, head = high + (five ? 64 : 0); /* the 5th bits' words, the q chunks */
    const int offset = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q8_0 ? 128 : 0;
    const __m512i low = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[MR];
    for (int r = 0; r < mc; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = p + b * pb;
        prefetch_l2(blk, pb, mc, type == T_Q4_0 ? PF_L2_ROWS_TWO : PF_L2_ROWS);
        __m512i q[8]; /* 8 vectors of 4 elements a lane: elements 4 c .. (4/5-bit: and 16 + 4 c ..) */
        if (type == T_Q8_0) {
            for (int c = 0; c < 8; c++) q[c] = _mm512_loadu_si512(blk + head + 64 * c);
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(blk + head + 64 * c);
                q[c] = _mm512_and_si512(v, low);
                q[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            if (five) {
                const __m512i h = _mm512_loadu_si512(blk + high);
                for (int c = 0; c < 4; c++) {
                    q[c] = _mm512_or_si512(q[c], _mm512_and_si512(_mm512_slli_epi16(h, 4 - c), bit4));
                    q[c + 4] = _mm512_or_si512(q[c + 4], _mm512_and_si512(_mm512_srli_epi16(h, c), bit4));
                }
            }
        }
        const __m512 dw = f16x16(blk);
        const __m512 mw = with_min ? f16x16(blk + 32) : dw;
        for (int r = 0; r < mc; r++) {
            const int64_t m = m0 + r;
            const int8_t *x = ROW(a, m) + b * 32;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) { /* q[c] holds elements 4 c (Q8_0: too); q[c + 4] 16 + 4 c */
                s0 = _mm512_dpbusd_epi32(s0, q[c], bcast4(x + 4 * c));
                s1 = _mm512_dpbusd_epi32(s1, q[c + 4], bcast4(x + 16 + 4 * c));
            }
            __m512i isum = _mm512_add_epi32(s0, s1);
            if (offset) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(offset * a->s[m * a->ns + b]));
            const __m512 dx = _mm512_set1_ps(a->d[m * a->ld + b]);
            __m512 t = _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum));
            if (with_min) t = _mm512_add_ps(t, _mm512_mul_ps(mw, _mm512_set1_ps(a->ds[m * a->ld + b])));
            acc[r] = _mm512_add_ps(acc[r], t);
        }
    }
    store_rows(acc, mc, nr, out, ldo);
}

/* Q4_K, and Q5_K (five): its 5th bits from the qh chunks after the nibbles, bit s of a byte
 * for sub-block s, moved to bit 4 and joined to the nibble by one select (ternlog 0xCA by 0x0F).
 * The loops over j and c are unrolled by pragma (as q3_k_panel's): left to itself GCC kept the j
 * loop, shifted by a register count and ran the dot products as one chain; unrolled, one row,
 * 1B shapes (bench_gguf_builds.py), Q5_K 8.4 -> 18.8 GB/s and Q3_K 8.9 -> 20.3, Q4_K unchanged. */
static inline INLINE AVX512 void k45_panel(const uint8_t *p, int64_t nr, const acts_t *a, int64_t m0, const int mc,
                                           float *out, int64_t ldo, const int five) {
    const int pb = five ? 2880 : 2368;
    const __m512i low = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[MR];
    for (int r = 0; r < mc; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = p + b * pb;
        /* The head's lines (d, dmin, scales, mins: bytes 0-319) touched first. One thread, 1B shapes,
         * bench_gguf_builds.py old / new side by side: Q4_K 1 row 26.2 -> 26.8 GB/s, 2 rows 19.5 ->
         * 24.3, 3 rows 13.7 -> 18.6, 4 rows 10.3 -> 13.4; Q5_K 1 row 18.3 -> 23.3. From 3 rows (Q5_K: 2) the
         * blocks ahead are prefetched into L2 too (module comment). */
        touch_head(blk);
        prefetch_l2(blk, pb, mc, five ? PF_L2_ROWS_TWO : PF_L2_ROWS);
        __m512i isum[MR], lo[MR], hi[MR];
        for (int r = 0; r < mc; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) { /* sub-blocks 2 j (low nibbles) and 2 j + 1 (high) */
            for (int r = 0; r < mc; r++) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                const __m512i v = _mm512_loadu_si512(blk + 320 + 64 * (8 * j + c));
                __m512i vl = _mm512_and_si512(v, low), vh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                if (five) { /* bit s of h to bit 4 (zeros above it), then a select by 0x0F: nibble | that bit */
                    const __m512i h = _mm512_loadu_si512(blk + 2368 + 64 * c);
                    const __m512i b0 = j <= 2 ? _mm512_slli_epi16(h, 4 - 2 * j) : _mm512_srli_epi16(h, 2 * j - 4);
                    const __m512i b1 = j <= 1 ? _mm512_slli_epi16(h, 3 - 2 * j) : _mm512_srli_epi16(h, 2 * j - 3);
                    vl = _mm512_ternarylogic_epi32(low, v, _mm512_and_si512(b0, bit4), 0xCA);
                    vh = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(v, 4), _mm512_and_si512(b1, bit4), 0xCA);
                }
                for (int r = 0; r < mc; r++) {
                    const int8_t *x = ROW(a, m0 + r) + b * 256 + 64 * j + 4 * c;
                    lo[r] = _mm512_dpbusd_epi32(lo[r], vl, bcast4(x));
                    hi[r] = _mm512_dpbusd_epi32(hi[r], vh, bcast4(x + 32));
                }
            }
            const __m512i sl = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 64 + 32 * j)));
            const __m512i sh = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 80 + 32 * j)));
            for (int r = 0; r < mc; r++)
                isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(sl, lo[r]),
                                                                     _mm512_mullo_epi32(sh, hi[r])));
        }
        const __m512 d = f16x16(blk), dmin = f16x16(blk + 32);
        /* the mins term, sum over s of min_s * (the activations' two 16-sums of sub-block s): min_s in
         * both 16-bit halves of each lane, times the two sums as one 32-bit word, by vpdpwssd */
        __m512i msum[MR];
        for (int r = 0; r < mc; r++) msum[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const __m512i mn = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192 + 16 * s)));
            const __m512i mn2 = _mm512_or_si512(mn, _mm512_slli_epi32(mn, 16));
            for (int r = 0; r < mc; r++) {
                int32_t pair;
                memcpy(&pair, a->s + (m0 + r) * a->ns + b * 16 + 2 * s, sizeof pair);
                msum[r] = _mm512_dpwssd_epi32(msum[r], mn2, _mm512_set1_epi32(pair));
            }
        }
        for (int r = 0; r < mc; r++) {
            const __m512 dx = _mm512_set1_ps(a->d[(m0 + r) * a->ld + b]);
            const __m512 t1 = _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[r]));
            const __m512 t2 = _mm512_mul_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(msum[r]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_sub_ps(t1, t2));
        }
    }
    store_rows(acc, mc, nr, out, ldo);
}

/* Q6_K and Q3_K: the four sub-blocks sb0 + 2 t (t < 4) of one (h, half) step of a panel block,
 * q[c][t] the panel's values (stored + offset) of elements base + 32 t + 16 half + 4 c ..: each
 * row's exact sum of sc * (dot - offset * the activations' sum) into isum. */
static inline INLINE AVX512 void k16_panel_dots(__m512i q[4][4], const uint8_t *scales, const int base, const int sb0,
                                                const int half, const int offset, const acts_t *a, int64_t m0,
                                                const int mc, int64_t b, __m512i *isum) {
    for (int t = 0; t < 4; t++) {
        const int j = sb0 + 2 * t;
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(scales + 16 * j)));
        for (int r = 0; r < mc; r++) {
            const int64_t m = m0 + r;
            const int8_t *x = ROW(a, m) + b * 256 + base + 32 * t + 16 * half;
            __m512i dot = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) dot = _mm512_dpbusd_epi32(dot, q[c][t], bcast4(x + 4 * c));
            dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset * a->s[m * a->ns + b * 16 + j]));
            isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sc, dot));
        }
    }
}

/* acc += d * d_x * isum, d the panel block's 16 fp16 scales at blk (the portable kernel's order). */
static inline INLINE AVX512 void k16_panel_finish(const uint8_t *blk, const __m512i *isum, const acts_t *a, int64_t m0,
                                                  const int mc, int64_t b, __m512 *acc) {
    const __m512 d = f16x16(blk);
    for (int r = 0; r < mc; r++) {
        const __m512 dx = _mm512_set1_ps(a->d[(m0 + r) * a->ld + b]);
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[r])));
    }
}

/* Q6_K: element 128 h + 32 t + 4 c + i (c < 8) of a row comes from ql chunk 16 h + 8 (t & 1) + c
 * (nibble t >> 1) and qh chunk 8 h + c (bits 2 t); sub-block j = 8 h + 2 t + c / 4. The three
 * chunks of one (h, c) hold that position's values for all four t (side by side in the panel,
 * in the order read): they are loaded once and give 4 vectors, each 6-bit value one ternlog
 * (a bitwise select by 0x0F) of its nibble's byte and its pair's (qh & 0x33: two pairs a byte
 * with zeros above each), so 11 operations give the 4 vectors where masking each part and
 * or-ing them took 13-17: one thread, one row, 1B shapes, Q6_K 21.3 -> 27.4 and 22.9 -> 30.7 GB/s
 * in two runs of bench_gguf_builds.py (the kernel had been compute-bound at one row). */
static inline INLINE AVX512 void q6_k_panel(const uint8_t *p, int64_t nr, const acts_t *a, int64_t m0, const int mc,
                                            float *out, int64_t ldo) {
    const __m512i low = _mm512_set1_epi8(0x0F), pairs = _mm512_set1_epi8(0x33);
    __m512 acc[MR];
    for (int r = 0; r < mc; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = p + b * 3360, *groups = blk + 288;
        /* the head (d, scales: lines 0-4) touched first: one thread, 1B shapes, bench_gguf_builds.py
         * old / new: 1 and 3 rows the same (25.9 -> 26.0, 17.3 -> 17.6 GB/s), 5 rows 10.1 -> 13.1
         * (Q3_K, tried alike, lost at 5 rows: not there); at 2 rows and from 5 the L2 prefetch too */
        touch_head(blk);
        prefetch_l2(blk, 3360, mc, PF_L2_ROWS_Q6K);
        __m512i isum[MR];
        for (int r = 0; r < mc; r++) isum[r] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++)
            for (int half = 0; half < 2; half++) { /* chunks c = 4 half .. 4 half + 3: sub-blocks 8 h + 2 t + half */
                __m512i q[4][4]; /* [c][t] */
                for (int c = 0; c < 4; c++) {
                    const uint8_t *g = groups + 192 * (8 * h + 4 * half + c);
                    const __m512i l0 = _mm512_loadu_si512(g), l1 = _mm512_loadu_si512(g + 64);
                    const __m512i hb = _mm512_loadu_si512(g + 128);
                    /* x02: pairs t = 0, 2 at bits 0-1, 4-5 (bits 2-3, 6-7 zero); x13: t = 1, 3. Each value
                     * is low ? (nibble source) : (pairs), bit by bit (ternlog 0xCA: low ? b : c, low = 0x0F): bits
                     * 0-3 the nibble, 4-5 the pair, 6-7 the zeros; what the 16-bit shifts carry
                     * across a byte lands in bits 0-3 of the pairs' side or 4-7 of the nibbles' side,
                     * neither of which is taken */
                    const __m512i x02 = _mm512_and_si512(hb, pairs), x13 = _mm512_and_si512(_mm512_srli_epi16(hb, 2), pairs);
                    q[c][0] = _mm512_ternarylogic_epi32(low, l0, _mm512_slli_epi16(x02, 4), 0xCA);
                    q[c][1] = _mm512_ternarylogic_epi32(low, l1, _mm512_slli_epi16(x13, 4), 0xCA);
                    q[c][2] = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(l0, 4), x02, 0xCA);
                    q[c][3] = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(l1, 4), x13, 0xCA);
                }
                k16_panel_dots(q, blk + 32, 128 * h, 8 * h + half, half, 32, a, m0, mc, b, isum);
            }
        k16_panel_finish(blk, isum, a, m0, mc, b, acc);
    }
    store_rows(acc, mc, nr, out, ldo);
}

/* Q3_K: element 128 n + 32 j + 4 c + i (c < 8) of a row comes from qs chunk 8 n + c (bits 2 j)
 * and hmask chunk c (bit 4 n + j, moved to bit 2); sub-block 8 n + 2 j + c / 4. As Q6_K's, the
 * two chunks of one (n, c) give that position's values for all four j. */
static inline INLINE AVX512 void q3_k_panel(const uint8_t *p, int64_t nr, const acts_t *a, int64_t m0, const int mc,
                                            float *out, int64_t ldo) {
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    __m512 acc[MR];
    for (int r = 0; r < mc; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = p + b * 1824, *hm = blk + 288, *qs = blk + 800;
        prefetch_l2(blk, 1824, mc, PF_L2_ROWS_TWO);
        __m512i isum[MR];
        for (int r = 0; r < mc; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int n = 0; n < 2; n++)
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) { /* chunks c = 4 half .. 4 half + 3: sub-blocks 8 n + 2 j + half */
                __m512i q[4][4]; /* [c][j] */
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    const int cc = 4 * half + c;
                    const __m512i lo = _mm512_loadu_si512(qs + 64 * (8 * n + cc)), hb = _mm512_loadu_si512(hm + 64 * cc);
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) {
                        const int bit = 4 * n + j; /* to bit 2 (16-bit shifts: the masks keep bits of one byte) */
                        const __m512i h = bit >= 2 ? _mm512_srli_epi16(hb, bit - 2) : _mm512_slli_epi16(hb, 2 - bit);
                        q[c][j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 2 * j), three),
                                                  _mm512_and_si512(h, four));
                    }
                }
                k16_panel_dots(q, blk + 32, 128 * n, 8 * n + half, half, 4, a, m0, mc, b, isum);
            }
        k16_panel_finish(blk, isum, a, m0, mc, b, acc);
    }
    store_rows(acc, mc, nr, out, ldo);
}

/* IQ4_NL (panel block 288, Q4_0's layout) and IQ4_XS (2208): each nibble looked up (vpshufb in
 * every 128-bit lane) as its value + 128, unsigned for vpdpbusd, and 128 times the activations'
 * sum subtracted: each block's (IQ4_XS: sub-block's) exact integer dot product, then the portable
 * kernel's float work. */
static const uint8_t KVALUES_IQ4NL_U[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

static inline INLINE AVX512 __m512i iq4_table512(void) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL_U));
}

static inline INLINE AVX512 void iq4_nl_panel(const uint8_t *p, int64_t nr, const acts_t *a, int64_t m0, const int mc,
                                              float *out, int64_t ldo) {
    const __m512i low = _mm512_set1_epi8(0x0F), table = iq4_table512();
    __m512 acc[MR];
    for (int r = 0; r < mc; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = p + b * 288;
        prefetch_l2(blk, 288, mc, PF_L2_ROWS);
        __m512i q[8]; /* elements 4 c .. (q[c]) and 16 + 4 c .. (q[c + 4]) of every row */
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(blk + 32 + 64 * c);
            q[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
            q[c + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
        const __m512 dw = f16x16(blk);
        for (int r = 0; r < mc; r++) {
            const int64_t m = m0 + r;
            const int8_t *x = ROW(a, m) + b * 32;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                s0 = _mm512_dpbusd_epi32(s0, q[c], bcast4(x + 4 * c));
                s1 = _mm512_dpbusd_epi32(s1, q[c + 4], bcast4(x + 16 + 4 * c));
            }
            const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1),
                                                  _mm512_set1_epi32(128 * a->s[m * a->ns + b]));
            const __m512 dx = _mm512_set1_ps(a->d[m * a->ld + b]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum)));
        }
    }
    store_rows(acc, mc, nr, out, ldo);
}

/* IQ4_XS: sub-block s's values from q chunks 4 s .. 4 s + 3 (low nibbles: its elements 4 c ..,
 * high: 16 + 4 c ..), its scale at 32 + 16 s; isum = sum_s sc_s (dot_s - 128 * its activation sum). */
static inline INLINE AVX512 void iq4_xs_panel(const uint8_t *p, int64_t nr, const acts_t *a, int64_t m0, const int mc,
                                              float *out, int64_t ldo) {
    const __m512i low = _mm512_set1_epi8(0x0F), table = iq4_table512();
    __m512 acc[MR];
    for (int r = 0; r < mc; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = p + b * 2208;
        prefetch_l2(blk, 2208, mc, PF_L2_ROWS);
        __m512i isum[MR], dot[MR];
        for (int r = 0; r < mc; r++) isum[r] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            for (int r = 0; r < mc; r++) dot[r] = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(blk + 160 + 64 * (4 * s + c));
                const __m512i vl = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
                const __m512i vh = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                for (int r = 0; r < mc; r++) {
                    const int8_t *x = ROW(a, m0 + r) + b * 256 + 32 * s + 4 * c;
                    dot[r] = _mm512_dpbusd_epi32(dot[r], vl, bcast4(x));
                    dot[r] = _mm512_dpbusd_epi32(dot[r], vh, bcast4(x + 16));
                }
            }
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * s)));
            for (int r = 0; r < mc; r++) {
                const int16_t *bs = a->s + (m0 + r) * a->ns + b * 16 + 2 * s;
                const __m512i off = _mm512_set1_epi32(128 * (bs[0] + bs[1]));
                isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(sc, _mm512_sub_epi32(dot[r], off)));
            }
        }
        const __m512 d = f16x16(blk);
        for (int r = 0; r < mc; r++) {
            const __m512 dx = _mm512_set1_ps(a->d[(m0 + r) * a->ld + b]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[r])));
        }
    }
    store_rows(acc, mc, nr, out, ldo);
}

/* rows_fn over one panel (w: its start, nr <= 16 its real rows; ws unused), mc a constant for
 * each count 1 .. MR (run's groups never exceed MR) so the loops over rows unroll and the
 * accumulators stay in registers: a verify's k + 1 rows too. Each count is a function of its own
 * (noinline): inlined into one switch, GCC allocated registers over all eight copies at once, and a
 * change to one copy moved the others' speed (a Q5_K prefetch at 2 rows made the 1-row copy 17-20%
 * slower). Apart, one thread, 1B shapes, bench_gguf_builds.py old / new side by side: Q6_K 1 row
 * 25.0 -> 29.0, 23.7 -> 27.9 and 24.2 -> 26.6 GB/s in three runs, the other types and row counts
 * within 4% (Q4_0 / Q4_1 / Q4_K / Q5_K / Q8_0 at 1 row, Q4_K at 3, 5 and 8, Q4_1 at 5, Q6_K at 5 and 8). */
#define PANEL_ONE(name, call, n)                                                                      \
    static __attribute__((noinline)) AVX512 void name##_avx512_##n(const uint8_t *w, int64_t nr, const acts_t *a, \
                                                                 int64_t m0, float *out, int64_t ldo) { \
        call(w, nr, a, m0, n, out, ldo);                                                              \
    }
#define PANEL_KERNEL(name, call)                                                                      \
    PANEL_ONE(name, call, 1) PANEL_ONE(name, call, 2) PANEL_ONE(name, call, 3) PANEL_ONE(name, call, 4) \
    PANEL_ONE(name, call, 5) PANEL_ONE(name, call, 6) PANEL_ONE(name, call, 7) PANEL_ONE(name, call, MR) \
    static AVX512 void name##_avx512(const uint8_t *w, int64_t ws, int64_t nr, const acts_t *a, int64_t m0, \
                                     int mc, float *out, int64_t ldo) {                               \
        (void)ws;                                                                                     \
        switch (mc) {                                                                                 \
        case 1: name##_avx512_1(w, nr, a, m0, out, ldo); break;                                       \
        case 2: name##_avx512_2(w, nr, a, m0, out, ldo); break;                                       \
        case 3: name##_avx512_3(w, nr, a, m0, out, ldo); break;                                       \
        case 4: name##_avx512_4(w, nr, a, m0, out, ldo); break;                                       \
        case 5: name##_avx512_5(w, nr, a, m0, out, ldo); break;                                       \
        case 6: name##_avx512_6(w, nr, a, m0, out, ldo); break;                                       \
        case 7: name##_avx512_7(w, nr, a, m0, out, ldo); break;                                       \
        default: name##_avx512_MR(w, nr, a, m0, out, ldo);                                            \
        }                                                                                             \
    }
#define Q4_0_PANEL(w, nr, a, m0, mc, out, ldo) small_panel(w, nr, a, m0, mc, out, ldo, T_Q4_0)
#define Q4_1_PANEL(w, nr, a, m0, mc, out, ldo) small_panel(w, nr, a, m0, mc, out, ldo, T_Q4_1)
#define Q5_0_PANEL(w, nr, a, m0, mc, out, ldo) small_panel(w, nr, a, m0, mc, out, ldo, T_Q5_0)
#define Q5_1_PANEL(w, nr, a, m0, mc, out, ldo) small_panel(w, nr, a, m0, mc, out, ldo, T_Q5_1)
#define Q8_0_PANEL(w, nr, a, m0, mc, out, ldo) small_panel(w, nr, a, m0, mc, out, ldo, T_Q8_0)
PANEL_KERNEL(q4_0, Q4_0_PANEL)
PANEL_KERNEL(q4_1, Q4_1_PANEL)
PANEL_KERNEL(q5_0, Q5_0_PANEL)
PANEL_KERNEL(q5_1, Q5_1_PANEL)
PANEL_KERNEL(q8_0, Q8_0_PANEL)
#define Q4_K_PANEL(w, nr, a, m0, mc, out, ldo) k45_panel(w, nr, a, m0, mc, out, ldo, 0)
#define Q5_K_PANEL(w, nr, a, m0, mc, out, ldo) k45_panel(w, nr, a, m0, mc, out, ldo, 1)
PANEL_KERNEL(q4_k, Q4_K_PANEL)
PANEL_KERNEL(q5_k, Q5_K_PANEL)
PANEL_KERNEL(q6_k, q6_k_panel)
PANEL_KERNEL(q3_k, q3_k_panel)
PANEL_KERNEL(iq4_nl, iq4_nl_panel)
PANEL_KERNEL(iq4_xs, iq4_xs_panel)
