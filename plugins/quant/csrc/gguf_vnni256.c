/* The AVX-VNNI set: gguf_avx512.c's panel kernels at 256 bits, for CPUs with the VEX-encoded
 * vpdpbusd / vpdpwssd but no AVX-512 (Intel's client cores from Alder Lake on); and the AVX2 set's
 * panel kernels. #included three times by gguf_cpu.c inside its x86-64 section, with the names
 * (VN), the target (V256) and the dot products set for each:
 *   _vex:   avx2 + fma + f16c + avxvnni, the instructions those CPUs run;
 *   _evex:  the same source for AVX-512 VL + VNNI, whose EVEX vpdpbusd on ymm does the same
 *           arithmetic. It is what a CPU without AVX-VNNI (this project's AVX-512 test machines)
 *           runs when the set is asked for (LMPLUG_GGUF_ISA=avxvnni), so the kernels' logic is
 *           executed under test there; gguf_cpu_vnni_encoding() says which twin runs.
 *   _avx2p: plain AVX2, vpdpbusd written as vpmaddubsw's int16 pair sums, added in int16 and
 *           widened by vpmaddwd (gguf_cpu.c says why that is exact); the 8-bit values (Q8_0, the
 *           IQ4 lookups) signed, by sdot (V256_DPBUSD 0).
 * A run of DOT_ADD(acc, weights, activations) over at most DOT_RUN(bits) chunks of 4 values a
 * lane, then DOT_SUM(acc), is an int32 dot product: with vpdpbusd DOT_SUM does nothing and a run
 * may cover the whole loop.
 * The panels are the AVX-512 set's (gguf_repack.c: lane r of a 64-byte chunk is row r of 16):
 * each panel block is read as two halves of 8 rows, half h at bytes 32 h .. 32 h + 31 of each
 * chunk (its fp16 scales at 16 h of each 32-byte group, its byte scales at 8 h of each 16), both
 * halves one after the other while the block's lines are in L1, so the weights stream once in
 * memory order. Per lane the integer and float operations are gguf_avx512.c's, but its ternlog
 * selects (AVX-512 VL, which AVX-VNNI CPUs lack) are ands and ors of the parts: the portable
 * kernels' bits. 16 ymm registers instead of 32 zmm: groups of at most 4 activation rows (below). */

static inline INLINE V256 __m256i VN(bc4)(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

static inline INLINE V256 __m256i VN(ld)(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

static inline INLINE V256 __m256 VN(f16x8)(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline INLINE V256 __m256i VN(u8x8)(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

static inline INLINE V256 __m256i VN(i8x8)(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* The IQ4 types' values, looked up by nibble (vpshufb in each 128-bit lane): + 128 for vpdpbusd,
 * signed for the AVX2 twin's sdot. */
static inline INLINE V256 __m256i VN(iq4_table)(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(V256_DPBUSD ? KVALUES_IQ4NL_U
                                                                                 : (const uint8_t *)KVALUES_IQ4NL)));
}

/* The AVX2 twin's dot product of signed 8-bit weights w (Q8_0's, the IQ4 values) with x: |w| times
 * x with w's sign (vpsignb), each int16 pair sum (at most 2 x 128 x 127) widened at once. */
static inline INLINE V256 __m256i VN(sdot)(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)),
                                                   _mm256_set1_epi16(1)));
}

/* Each half's mc rows of outputs (columns 8 h .. 8 h + 7 of the panel's 16), those past nr not stored. */
static inline INLINE V256 void VN(store_rows)(__m256 acc[2][4], int mc, int64_t nr, float *out, int64_t ldo) {
    for (int h = 0; h < 2; h++) {
        const int64_t left = nr - 8 * h;
        if (left <= 0) return;
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(left >= 8 ? 8 : (int)left),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int r = 0; r < mc; r++) _mm256_maskstore_ps(out + r * ldo + 8 * h, keep, acc[h][r]);
    }
}

/* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL: half h of one panel block (gguf_avx512.c's small_panel
 * and iq4_nl_panel: IQ4_NL's nibbles are looked up + 128, its offset subtracted as Q8_0's). */
static inline INLINE V256 void VN(small_half)(const uint8_t *blk, int64_t b, const int h, const acts_t *a, int64_t m0,
                                              const int mc, __m256 *acc, const int type) {
    const int with_min = type == T_Q4_1 || type == T_Q5_1, five = type == T_Q5_0 || type == T_Q5_1;
    const int high = with_min ? 64 : 32, head = high + (five ? 64 : 0);
    const int offset = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : (type == T_Q8_0 || type == T_IQ4_NL) && V256_DPBUSD ? 128 : 0;
    const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    __m256i q[8];
    if (type == T_IQ4_NL) {
        const __m256i table = VN(iq4_table)();
        for (int c = 0; c < 4; c++) {
            const __m256i v = VN(ld)(blk + 32 + 64 * c + 32 * h);
            q[c] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
            q[c + 4] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        }
    } else if (type == T_Q8_0) { /* AVX2: the signed weights (the stored values - 128) */
        for (int c = 0; c < 8; c++)
            q[c] = V256_DPBUSD ? VN(ld)(blk + head + 64 * c + 32 * h)
                             : _mm256_xor_si256(VN(ld)(blk + head + 64 * c + 32 * h), _mm256_set1_epi8((char)0x80));
    } else {
        for (int c = 0; c < 4; c++) {
            const __m256i v = VN(ld)(blk + head + 64 * c + 32 * h);
            q[c] = _mm256_and_si256(v, low);
            q[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        if (five) {
            const __m256i hb = VN(ld)(blk + high + 32 * h);
            for (int c = 0; c < 4; c++) {
                q[c] = _mm256_or_si256(q[c], _mm256_and_si256(_mm256_slli_epi16(hb, 4 - c), bit4));
                q[c + 4] = _mm256_or_si256(q[c + 4], _mm256_and_si256(_mm256_srli_epi16(hb, c), bit4));
            }
        }
    }
    const __m256 dw = VN(f16x8)(blk + 16 * h);
    const __m256 mw = with_min ? VN(f16x8)(blk + 32 + 16 * h) : dw;
    for (int r = 0; r < mc; r++) {
        const int64_t m = m0 + r;
        const int8_t *x = ROW(a, m) + b * 32;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        if (!V256_DPBUSD && (type == T_Q8_0 || type == T_IQ4_NL)) { /* signed 8-bit values */
            for (int c = 0; c < 4; c++) {
                s0 = VN(sdot)(s0, q[c], VN(bc4)(x + 4 * c));
                s1 = VN(sdot)(s1, q[c + 4], VN(bc4)(x + 16 + 4 * c));
            }
        } else {
            for (int c = 0; c < 4; c++) {
                s0 = DOT_ADD(s0, q[c], VN(bc4)(x + 4 * c));
                s1 = DOT_ADD(s1, q[c + 4], VN(bc4)(x + 16 + 4 * c));
            }
            s0 = DOT_SUM(s0), s1 = DOT_SUM(s1);
        }
        __m256i isum = _mm256_add_epi32(s0, s1);
        if (offset) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(offset * a->s[m * a->ns + b]));
        const __m256 dx = _mm256_set1_ps(a->d[m * a->ld + b]);
        __m256 t = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum));
        if (with_min) t = _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_set1_ps(a->ds[m * a->ld + b])));
        acc[r] = _mm256_add_ps(acc[r], t);
    }
}

/* Q4_K, and Q5_K (five): half h of one panel block (gguf_avx512.c's k45_panel). */
static inline INLINE V256 void VN(k45_half)(const uint8_t *blk, int64_t b, const int h, const acts_t *a, int64_t m0,
                                            const int mc, __m256 *acc, const int five) {
    const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    const int run = DOT_RUN(five ? 5 : 4);
    __m256i isum[4], lo[4], hi[4], lo32[4], hi32[4];
    for (int r = 0; r < mc; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) { /* sub-blocks 2 j (low nibbles) and 2 j + 1 (high) */
        for (int r = 0; r < mc; r++) lo[r] = hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const __m256i v = VN(ld)(blk + 320 + 64 * (8 * j + c) + 32 * h);
            __m256i vl = _mm256_and_si256(v, low), vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if (five) { /* bit s of the qh chunk to bit 4, joined to the nibble */
                const __m256i q5 = VN(ld)(blk + 2368 + 64 * c + 32 * h);
                const __m256i b0 = j <= 2 ? _mm256_slli_epi16(q5, 4 - 2 * j) : _mm256_srli_epi16(q5, 2 * j - 4);
                const __m256i b1 = j <= 1 ? _mm256_slli_epi16(q5, 3 - 2 * j) : _mm256_srli_epi16(q5, 2 * j - 3);
                vl = _mm256_or_si256(vl, _mm256_and_si256(b0, bit4));
                vh = _mm256_or_si256(vh, _mm256_and_si256(b1, bit4));
            }
            for (int r = 0; r < mc; r++) {
                const int8_t *x = ROW(a, m0 + r) + b * 256 + 64 * j + 4 * c;
                lo[r] = DOT_ADD(lo[r], vl, VN(bc4)(x));
                hi[r] = DOT_ADD(hi[r], vh, VN(bc4)(x + 32));
            }
            if (c % run == run - 1 || c == 7)
                for (int r = 0; r < mc; r++) {
                    const __m256i l = DOT_SUM(lo[r]), u = DOT_SUM(hi[r]);
                    lo32[r] = c < run ? l : _mm256_add_epi32(lo32[r], l);
                    hi32[r] = c < run ? u : _mm256_add_epi32(hi32[r], u);
                    lo[r] = hi[r] = _mm256_setzero_si256();
                }
        }
        const __m256i sl = VN(u8x8)(blk + 64 + 32 * j + 8 * h), sh = VN(u8x8)(blk + 80 + 32 * j + 8 * h);
        for (int r = 0; r < mc; r++)
            isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_mullo_epi32(sl, lo32[r]),
                                                                 _mm256_mullo_epi32(sh, hi32[r])));
    }
    const __m256 d = VN(f16x8)(blk + 16 * h), dmin = VN(f16x8)(blk + 32 + 16 * h);
    __m256i msum[4]; /* sum over s of min_s * the activations' two 16-sums of sub-block s (vpdpwssd) */
    for (int r = 0; r < mc; r++) msum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        const __m256i mn = VN(u8x8)(blk + 192 + 16 * s + 8 * h);
        const __m256i mn2 = _mm256_or_si256(mn, _mm256_slli_epi32(mn, 16));
        for (int r = 0; r < mc; r++) {
            int32_t pair;
            memcpy(&pair, a->s + (m0 + r) * a->ns + b * 16 + 2 * s, sizeof pair);
            msum[r] = DPWSSD(msum[r], mn2, _mm256_set1_epi32(pair));
        }
    }
    for (int r = 0; r < mc; r++) {
        const __m256 dx = _mm256_set1_ps(a->d[(m0 + r) * a->ld + b]);
        const __m256 t1 = _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum[r]));
        const __m256 t2 = _mm256_mul_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(msum[r]));
        acc[r] = _mm256_add_ps(acc[r], _mm256_sub_ps(t1, t2));
    }
}

/* Q6_K and Q3_K: gguf_avx512.c's k16_panel_dots over half h (its scales at 8 h of each 16). */
static inline INLINE V256 void VN(k16_dots)(__m256i q[4][4], const uint8_t *scales, const int base, const int sb0,
                                            const int half, const int offset, const acts_t *a, int64_t m0, const int mc,
                                            int64_t b, const int h, __m256i *isum) {
    const int run = DOT_RUN(offset == 32 ? 6 : 3); /* Q6_K's values have 6 bits, Q3_K's 3 */
    for (int t = 0; t < 4; t++) {
        const int j = sb0 + 2 * t;
        const __m256i sc = VN(i8x8)(scales + 16 * j + 8 * h);
        for (int r = 0; r < mc; r++) {
            const int64_t m = m0 + r;
            const int8_t *x = ROW(a, m) + b * 256 + base + 32 * t + 16 * half;
            __m256i dot = _mm256_setzero_si256(), part = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                part = DOT_ADD(part, q[c][t], VN(bc4)(x + 4 * c));
                if (c % run == run - 1 || c == 3) {
                    dot = c < run ? DOT_SUM(part) : _mm256_add_epi32(dot, DOT_SUM(part));
                    part = _mm256_setzero_si256();
                }
            }
            dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(offset * a->s[m * a->ns + b * 16 + j]));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(sc, dot));
        }
    }
}

static inline INLINE V256 void VN(k16_finish)(const uint8_t *blk, const __m256i *isum, const acts_t *a, int64_t m0,
                                              const int mc, int64_t b, const int h, __m256 *acc) {
    const __m256 d = VN(f16x8)(blk + 16 * h);
    for (int r = 0; r < mc; r++) {
        const __m256 dx = _mm256_set1_ps(a->d[(m0 + r) * a->ld + b]);
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum[r])));
    }
}

/* Q6_K: half h of one panel block (gguf_avx512.c's q6_k_panel: its comment has the layout). Each
 * 6-bit value is its nibble or-ed with its pair moved to bits 4-5 (4-5 ops; a select of the
 * shared masked pairs, as the AVX-512 kernel's ternlog does, took more here without ternlog:
 * EVEX twin, one row, 1B shapes, bench_gguf_builds.py --isa avxvnni, 11.6-11.8 -> 13.0 GB/s). */
static inline INLINE V256 void VN(q6_k_half)(const uint8_t *blk, int64_t b, const int h, const acts_t *a, int64_t m0,
                                             const int mc, __m256 *acc) {
    const __m256i low = _mm256_set1_epi8(0x0F), m03 = _mm256_set1_epi8(0x03), m0c = _mm256_set1_epi8(0x0C);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    const uint8_t *groups = blk + 288;
    __m256i isum[4];
    for (int r = 0; r < mc; r++) isum[r] = _mm256_setzero_si256();
    for (int g6 = 0; g6 < 2; g6++)
        for (int half = 0; half < 2; half++) {
            __m256i q[4][4]; /* [c][t] */
            for (int c = 0; c < 4; c++) {
                const uint8_t *g = groups + 192 * (8 * g6 + 4 * half + c) + 32 * h;
                const __m256i l0 = VN(ld)(g), l1 = VN(ld)(g + 64), hb = VN(ld)(g + 128);
                q[c][0] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(hb, m03), 4));
                q[c][1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_slli_epi16(_mm256_and_si256(hb, m0c), 2));
                q[c][2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hb, m30));
                q[c][3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                          _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
            }
            VN(k16_dots)(q, blk + 32, 128 * g6, 8 * g6 + half, half, 32, a, m0, mc, b, h, isum);
        }
    VN(k16_finish)(blk, isum, a, m0, mc, b, h, acc);
}

/* Q3_K: half h of one panel block (gguf_avx512.c's q3_k_panel). */
static inline INLINE V256 void VN(q3_k_half)(const uint8_t *blk, int64_t b, const int h, const acts_t *a, int64_t m0,
                                             const int mc, __m256 *acc) {
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const uint8_t *hm = blk + 288 + 32 * h, *qs = blk + 800 + 32 * h;
    __m256i isum[4];
    for (int r = 0; r < mc; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int n = 0; n < 2; n++)
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
            __m256i q[4][4]; /* [c][j] */
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const int cc = 4 * half + c;
                const __m256i lo = VN(ld)(qs + 64 * (8 * n + cc)), hb = VN(ld)(hm + 64 * cc);
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const int bit = 4 * n + j;
                    const __m256i hh = bit >= 2 ? _mm256_srli_epi16(hb, bit - 2) : _mm256_slli_epi16(hb, 2 - bit);
                    q[c][j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 2 * j), three),
                                              _mm256_and_si256(hh, four));
                }
            }
            VN(k16_dots)(q, blk + 32, 128 * n, 8 * n + half, half, 4, a, m0, mc, b, h, isum);
        }
    VN(k16_finish)(blk, isum, a, m0, mc, b, h, acc);
}

static inline INLINE V256 void VN(iq4_xs_half)(const uint8_t *blk, int64_t b, const int h, const acts_t *a, int64_t m0,
                                               const int mc, __m256 *acc) {
    const __m256i low = _mm256_set1_epi8(0x0F), table = VN(iq4_table)();
    __m256i isum[4], dot[4];
    for (int r = 0; r < mc; r++) isum[r] = _mm256_setzero_si256();
    for (int s = 0; s < 8; s++) {
        for (int r = 0; r < mc; r++) dot[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i v = VN(ld)(blk + 160 + 64 * (4 * s + c) + 32 * h);
            const __m256i vl = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
            const __m256i vh = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            for (int r = 0; r < mc; r++) {
                const int8_t *x = ROW(a, m0 + r) + b * 256 + 32 * s + 4 * c;
                if (V256_DPBUSD) {
                    dot[r] = DOT_ADD(dot[r], vl, VN(bc4)(x)); /* vpdpbusd: a run of 8 */
                    dot[r] = DOT_ADD(dot[r], vh, VN(bc4)(x + 16));
                } else {
                    dot[r] = VN(sdot)(dot[r], vl, VN(bc4)(x));
                    dot[r] = VN(sdot)(dot[r], vh, VN(bc4)(x + 16));
                }
            }
        }
        const __m256i sc = VN(i8x8)(blk + 32 + 16 * s + 8 * h);
        for (int r = 0; r < mc; r++) {
            const int16_t *bs = a->s + (m0 + r) * a->ns + b * 16 + 2 * s;
            const __m256i off = _mm256_set1_epi32(V256_DPBUSD ? 128 * (bs[0] + bs[1]) : 0);
            isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(sc, _mm256_sub_epi32(dot[r], off)));
        }
    }
    const __m256 d = VN(f16x8)(blk + 16 * h);
    for (int r = 0; r < mc; r++) {
        const __m256 dx = _mm256_set1_ps(a->d[(m0 + r) * a->ld + b]);
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(isum[r])));
    }
}

/* One panel of `type` (a constant in each caller: the switches fold): its blocks in order, each
 * read as half 0 then half 1 (gguf_avx512.c's prefetch and head policies per type). */
static inline INLINE V256 void VN(panel)(const uint8_t *p, int64_t nr, const acts_t *a, int64_t m0, const int mc,
                                         float *out, int64_t ldo, const int type) {
    const int pb = 16 * (type == T_Q4_0 || type == T_IQ4_NL ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22
                         : type == T_Q5_1 ? 24 : type == T_Q8_0 ? 34 : type == T_Q3_K ? 114 : type == T_Q4_K ? 148
                         : type == T_Q5_K ? 180 : type == T_Q6_K ? 210 : 138);
    const unsigned pf = type == T_Q4_0 || type == T_Q3_K || type == T_Q5_K ? PF_L2_ROWS_TWO
                        : type == T_Q6_K ? PF_L2_ROWS_Q6K : PF_L2_ROWS;
    __m256 acc[2][4];
    for (int r = 0; r < mc; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = p + b * pb;
        if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) touch_head(blk);
        prefetch_l2(blk, pb, mc, pf);
        for (int h = 0; h < 2; h++) {
            if (type == T_Q4_K || type == T_Q5_K) VN(k45_half)(blk, b, h, a, m0, mc, acc[h], type == T_Q5_K);
            else if (type == T_Q6_K) VN(q6_k_half)(blk, b, h, a, m0, mc, acc[h]);
            else if (type == T_Q3_K) VN(q3_k_half)(blk, b, h, a, m0, mc, acc[h]);
            else if (type == T_IQ4_XS) VN(iq4_xs_half)(blk, b, h, a, m0, mc, acc[h]);
            else VN(small_half)(blk, b, h, a, m0, mc, acc[h], type);
        }
    }
    VN(store_rows)(acc, mc, nr, out, ldo);
}

/* rows_fn over one panel, a function per row count (gguf_avx512.c's PANEL_KERNEL says why) up to
 * 4; 5 to 8 rows run as 4 and the rest, the panel read a second time from L2. With 16 ymm
 * registers more rows' accumulators spill anyway, and the copies for 5 to 8 rows doubled the
 * library's build time (the set is compiled twice). */
#define V256_ONE(name, type, n)                                                                       \
    static __attribute__((noinline)) V256 void VN(name##_v256_##n)(const uint8_t *w, int64_t nr, const acts_t *a, \
                                                                   int64_t m0, float *out, int64_t ldo) { \
        VN(panel)(w, nr, a, m0, n, out, ldo, type);                                                   \
    }
#define V256_KERNEL(name, type)                                                                       \
    V256_ONE(name, type, 1) V256_ONE(name, type, 2) V256_ONE(name, type, 3) V256_ONE(name, type, 4)   \
    static V256 void VN(name##_v256)(const uint8_t *w, int64_t ws, int64_t nr, const acts_t *a, int64_t m0, int mc, \
                                     float *out, int64_t ldo) {                                       \
        for (; mc > 4; mc -= 4, m0 += 4, out += 4 * ldo) VN(name##_v256_4)(w, nr, a, m0, out, ldo);   \
        switch (mc) {                                                                                 \
        case 1: VN(name##_v256_1)(w, nr, a, m0, out, ldo); break;                                     \
        case 2: VN(name##_v256_2)(w, nr, a, m0, out, ldo); break;                                     \
        case 3: VN(name##_v256_3)(w, nr, a, m0, out, ldo); break;                                     \
        default: VN(name##_v256_4)(w, nr, a, m0, out, ldo);                                           \
        }                                                                                             \
        (void)ws;                                                                                     \
    }
V256_KERNEL(q4_0, T_Q4_0)
V256_KERNEL(q4_1, T_Q4_1)
V256_KERNEL(q5_0, T_Q5_0)
V256_KERNEL(q5_1, T_Q5_1)
V256_KERNEL(q3_k, T_Q3_K)
V256_KERNEL(q4_k, T_Q4_K)
V256_KERNEL(q5_k, T_Q5_K)
V256_KERNEL(q6_k, T_Q6_K)
V256_KERNEL(q8_0, T_Q8_0)
V256_KERNEL(iq4_nl, T_IQ4_NL)
V256_KERNEL(iq4_xs, T_IQ4_XS)
#undef V256_ONE
#undef V256_KERNEL
