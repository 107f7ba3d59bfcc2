/* Q3_K (ggml type 11): 256 values in 16 sub-blocks of 16, 3-bit codes (two low bits in
   qs, the third in hmask), 6-bit scales, d (fp16); value = d * (scale - 32) * code, the
   code minus 4 where its hmask bit is clear. Group-block, 912 B: d[8] | scale - 32
   [16 sub-blocks][8] (int8, a byte each) | 8 words of hmask | 16 words of qs. In each
   half of 128 values, value 32 j + l (l < 32) is bits 2j, 2j + 1 of the half's qs byte
   l, and bit 4 half + j of hmask byte l. */

/* the 12 bytes of sixteen 6-bit scales <-> a byte each: scale s is the nibble s / 8 of
   byte s % 8 with, above it, bits 2 (s / 4), 2 (s / 4) + 1 of byte 8 + s % 4 */
static void q3_k_decode(const uint8_t *q, int8_t scale[16]) {
    for (int s = 0; s < 16; s++) {
        const int low = (q[s % 8] >> (4 * (s / 8))) & 15, high = (q[8 + s % 4] >> (2 * (s / 4))) & 3;
        scale[s] = (int8_t)((low | (high << 4)) - 32);
    }
}

static void q3_k_encode(const int8_t scale[16], uint8_t *q) {
    memset(q, 0, 12);
    for (int s = 0; s < 16; s++) {
        const int six = scale[s] + 32;
        q[s % 8] |= (uint8_t)((six & 15) << (4 * (s / 8)));
        q[8 + s % 4] |= (uint8_t)((six >> 4) << (2 * (s / 4)));
    }
}

/* the file's block: hmask[32], qs[64], scales[12], d */
static void move_q3_k(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 108, group, 2 * r, 2, to_group);
    int8_t scale[16];
    if (to_group) {
        q3_k_decode(block + 96, scale);
        for (int s = 0; s < 16; s++) group[16 + 8 * s + r] = (uint8_t)scale[s];
    } else {
        for (int s = 0; s < 16; s++) scale[s] = (int8_t)group[16 + 8 * s + r];
        q3_k_encode(scale, block + 96);
    }
    for (int t = 0; t < 8; t++) move_bytes(block, 4 * t, group, 144 + 32 * t + 4 * r, 4, to_group);
    for (int t = 0; t < 16; t++) move_bytes(block, 32 + 4 * t, group, 400 + 32 * t + 4 * r, 4, to_group);
}

static void unpack_q3_k(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    const float d = half_value(group + 2 * r);
    for (int s = 0; s < 16; s++) {
        scale[s] = d * (float)(int8_t)group[16 + 8 * s + r];
        min[s] = 0.0f;
    }
    for (int i = 0; i < 256; i++) {
        const int half = i / 128, j = (i / 32) % 4, l = i % 32, byte = 32 * half + l;
        const int low = (group[400 + 32 * (byte / 4) + 4 * r + byte % 4] >> (2 * j)) & 3;
        const int high = (group[144 + 32 * (l / 4) + 4 * r + l % 4] >> (4 * half + j)) & 1;
        codes[i] = (int8_t)(low - (high ? 0 : 4));
    }
}

#if INT8_SIMD
/* The three bits as an unsigned code u = code + 4 (0..7): a sub-block's sum of u * x
   less 4 times x's sum is the codes' exact integer sum, times the scale; per x block of
   32, two sub-blocks, widened and scaled by x's. */
static inline __attribute__((always_inline)) void group_q3_k(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    const __m256i two_bits = _mm256_set1_epi8(3), third = _mm256_set1_epi8(4);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 912 * b;
        fetch_ahead(gb, 912);
        __m256i hmask[8];
        for (int t = 0; t < 8; t++) hmask[t] = load32(gb + 144 + 32 * t);
        __m256 sum[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = _mm256_setzero_ps();
        #pragma GCC unroll 2 /* (the shifts depend on half too) */
        for (int half = 0; half < 2; half++) {
            /* unrolled: a shift by a constant, not by a register */
            #pragma GCC unroll 8
            for (int j = 0; j < 4; j++) { /* x block 4 half + j: sub-blocks s, s + 1 */
                const int s = 8 * half + 2 * j, bit = 4 * half + j;
                __m256i codes[8];
                for (int t = 0; t < 8; t++) {
                    const __m256i qs = load32(gb + 400 + 32 * (8 * half + t));
                    const __m256i high = bit >= 2 ? _mm256_srli_epi16(hmask[t], bit - 2)
                                                  : _mm256_slli_epi16(hmask[t], 2 - bit);
                    codes[t] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), two_bits),
                                               _mm256_and_si256(high, third));
                }
                __m256i scale[2]; /* int32 for vpmulld, else int16 pairs for vpmaddwd */
                for (int p = 0; p < 2; p++)
                    scale[p] = INT8_VNNI ? _mm256_cvtepi8_epi32(
                                               _mm_loadl_epi64((const __m128i *)(gb + 16 + 8 * (s + p))))
                                         : scale_pairs(gb + 16 + 8 * (s + p), 1);
                for (int m = 0; m < rows; m++) {
                    const int64_t xb = m * (x->k / 32) + 8 * b + 4 * half + j;
                    const int8_t *v = x->codes + 32 * xb;
#if INT8_VNNI
                    const int32_t *sums = x->sums16 + 2 * xb;
                    __m256i dot[2] = {_mm256_set1_epi32(-4 * sums[0]), _mm256_set1_epi32(-4 * sums[1])};
                    for (int t = 0; t < 8; t++)
                        dot[t / 4] = dot_u8s8(dot[t / 4], codes[t], broadcast4(v + 4 * t));
                    const __m256i exact = _mm256_add_epi32(_mm256_mullo_epi32(dot[0], scale[0]),
                                                           _mm256_mullo_epi32(dot[1], scale[1]));
#else
                    /* a sub-block's pair sums, at most 4 * 2 * 7 * 127, less four times
                       x's matching pairs (Q6_K's offsets, 32 times them, shifted) */
                    __m256i exact = _mm256_setzero_si256();
                    for (int p = 0; p < 2; p++) {
                        const __m256i four =
                            _mm256_srai_epi16(_mm256_set1_epi32(x->offsets16[2 * xb + p]), 3);
                        const __m256i pairs = _mm256_sub_epi16(pair_sums(codes + 4 * p, v + 16 * p, 4), four);
                        exact = _mm256_add_epi32(exact, _mm256_madd_epi16(pairs, scale[p]));
                    }
#endif
                    const __m256 xd = _mm256_set1_ps(x->scales[xb]);
                    sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), xd, sum[m]);
                }
            }
        }
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) acc[m] = _mm256_fmadd_ps(sum[m], d, acc[m]);
    }
}
#endif
