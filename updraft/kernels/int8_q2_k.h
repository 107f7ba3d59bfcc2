/* Q2_K (ggml type 10): 256 values in 16 sub-blocks of 16, 2-bit codes, a byte per
   sub-block holding a 4-bit scale (low) and a 4-bit min (high), d and dmin (fp16); value
   = d * scale * code - dmin * min. Group-block, 672 B: d[8] | dmin[8] | scale-and-min
   byte [16 sub-blocks][8] | 16 words of codes. In each half of 128 values, value 32 j +
   l (l < 32) is bits 2j, 2j + 1 of the half's code byte l. */

/* the file's block: scales[16], qs[64], d, dmin */
static void move_q2_k(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 80, group, 2 * r, 2, to_group);
    move_bytes(block, 82, group, 16 + 2 * r, 2, to_group);
    for (int s = 0; s < 16; s++) move_bytes(block, s, group, 32 + 8 * s + r, 1, to_group);
    for (int t = 0; t < 16; t++) move_bytes(block, 16 + 4 * t, group, 160 + 32 * t + 4 * r, 4, to_group);
}

static void unpack_q2_k(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    const float d = half_value(group + 2 * r), dmin = half_value(group + 16 + 2 * r);
    for (int s = 0; s < 16; s++) {
        const uint8_t packed = group[32 + 8 * s + r];
        scale[s] = d * (float)(packed & 15);
        min[s] = -dmin * (float)(packed >> 4);
    }
    for (int i = 0; i < 256; i++) {
        const int byte = 32 * (i / 128) + i % 32, j = (i / 32) % 4;
        codes[i] = (int8_t)((group[160 + 32 * (byte / 4) + 4 * r + byte % 4] >> (2 * j)) & 3);
    }
}

#if INT8_SIMD
/* Per x block of 32, two sub-blocks: each one's exact integer sum times its scale, the
   pair widened and scaled by x's; the minimums multiply x's sums over sixteen. */
static inline __attribute__((always_inline)) void group_q2_k(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    const __m256i two_bits = _mm256_set1_epi8(3);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 672 * b;
        fetch_ahead(gb, 672);
        __m256 sum[MAX_X_ROWS], mins[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = mins[m] = _mm256_setzero_ps();
        for (int half = 0; half < 2; half++) {
            __m256i raw[8];
            for (int t = 0; t < 8; t++) raw[t] = load32(gb + 160 + 32 * (8 * half + t));
            /* unrolled: a shift by a constant, not by a register */
            #pragma GCC unroll 8
            for (int j = 0; j < 4; j++) { /* x block 4 half + j: sub-blocks s, s + 1 */
                const int s = 8 * half + 2 * j;
                __m256i codes[8];
                for (int t = 0; t < 8; t++)
                    codes[t] = _mm256_and_si256(_mm256_srli_epi16(raw[t], 2 * j), two_bits);
                __m256i scale[2]; /* sub_scales' form, the low nibbles only */
                __m256 min[2];
                for (int p = 0; p < 2; p++) {
                    const uint8_t *packed = gb + 32 + 8 * (s + p);
                    scale[p] = _mm256_and_si256(sub_scales(packed), _mm256_set1_epi16(15));
                    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)packed));
                    min[p] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
                }
                for (int m = 0; m < rows; m++) {
                    const int64_t xb = m * (x->k / 32) + 8 * b + 4 * half + j;
                    const int8_t *v = x->codes + 32 * xb;
                    /* a sub-block's pair sums at most 4 * 2 * 3 * 127 */
                    const __m256i exact = _mm256_add_epi32(dot_words_scaled(codes, v, 4, scale[0]),
                                                           dot_words_scaled(codes + 4, v + 16, 4, scale[1]));
                    const float xd = x->scales[xb];
                    sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(xd), sum[m]);
                    const int32_t *sums = x->sums16 + 2 * xb;
                    mins[m] = _mm256_fmadd_ps(min[0], _mm256_set1_ps(xd * (float)sums[0]), mins[m]);
                    mins[m] = _mm256_fmadd_ps(min[1], _mm256_set1_ps(xd * (float)sums[1]), mins[m]);
                }
            }
        }
        const __m256 d = halves(gb), dmin = halves(gb + 16);
        for (int m = 0; m < rows; m++)
            acc[m] = _mm256_fnmadd_ps(mins[m], dmin, _mm256_fmadd_ps(sum[m], d, acc[m]));
    }
}
#endif
