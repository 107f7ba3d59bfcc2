/* Q5_K (ggml type 13): 256 values in 8 sub-blocks of 32, d, dmin (fp16), 6-bit scales
   and mins packed as Q4_K's, 5-bit codes (nibbles in qs, the fifth bit in qh); value =
   d * scale_j * code - dmin * min_j. Group-block, 1440 B: d[8] | dmin[8] | scale[8
   sub-blocks][8] | min[8][8] | 8 words of qh | 32 words of qs. Value 32 j + l (l < 32)
   is nibble j % 2 of qs byte 32 (j / 2) + l, and bit j of qh byte l. Uses Q4_K's scale
   packing (int8_q4_k.h, included before this). */

/* the file's block: d, dmin, scales[12], qh[32], qs[128] */
static void move_q5_k(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_k_head(block, group, r, to_group);
    for (int t = 0; t < 8; t++) move_bytes(block, 16 + 4 * t, group, 160 + 32 * t + 4 * r, 4, to_group);
    for (int t = 0; t < 32; t++) move_bytes(block, 48 + 4 * t, group, 416 + 32 * t + 4 * r, 4, to_group);
}

static void unpack_q5_k(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    const float d = half_value(group + 2 * r), dmin = half_value(group + 16 + 2 * r);
    for (int s = 0; s < 16; s++) { /* per sixteen: each sub-block's twice */
        scale[s] = d * (float)group[32 + 8 * (s / 2) + r];
        min[s] = -dmin * (float)group[96 + 8 * (s / 2) + r];
    }
    for (int i = 0; i < 256; i++) {
        const int j = i / 32, l = i % 32, byte = 32 * (j / 2) + l;
        const int low = (group[416 + 32 * (byte / 4) + 4 * r + byte % 4] >> (4 * (j % 2))) & 15;
        const int high = (group[160 + 32 * (l / 4) + 4 * r + l % 4] >> j) & 1;
        codes[i] = (int8_t)(low | (high << 4));
    }
}

#if INT8_SIMD
/* sub-block j's fifth bits (bit j of qh's bytes) as bit 4 of each byte, what its low
   nibbles are or-ed with (a shift by a constant where j is one) */
static inline __attribute__((always_inline)) __m256i q5_k_fifth(__m256i qh, int j) {
    const __m256i moved = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

/* Per sub-block of 32, one x block: its exact integer sum times its scale, widened and
   scaled by x's; the minimums multiply the rounded x's sum over the sub-block. */
static inline __attribute__((always_inline)) void group_q5_k(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 1440 * b;
        fetch_ahead(gb, 1440);
        __m256i qh[8];
        for (int t = 0; t < 8; t++) qh[t] = load32(gb + 160 + 32 * t);
        __m256 sum[MAX_X_ROWS], mins[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = mins[m] = _mm256_setzero_ps();
        /* unrolled: a shift by a constant, not by a register */
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i codes[8];
            for (int t = 0; t < 8; t++) {
                const __m256i raw = load32(gb + 416 + 32 * (8 * (j / 2) + t));
                const __m256i low = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, nibble);
                codes[t] = _mm256_or_si256(low, q5_k_fifth(qh[t], j));
            }
            /* int32 scales for vpmulld, else int16 pairs of them for vpmaddwd */
            const __m128i eight = _mm_loadl_epi64((const __m128i *)(gb + 32 + 8 * j));
            const __m256i scale = INT8_VNNI ? _mm256_cvtepu8_epi32(eight) : scale_pairs(gb + 32 + 8 * j, 0);
            const __m256 min = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(gb + 96 + 8 * j))));
            for (int m = 0; m < rows; m++) {
                const int64_t xb = m * (x->k / 32) + 8 * b + j;
                const int8_t *v = x->codes + 32 * xb;
#if INT8_VNNI
                __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int t = 0; t < 8; t++)
                    dot[t % 2] = dot_u8s8(dot[t % 2], codes[t], broadcast4(v + 4 * t));
                const __m256i exact = _mm256_mullo_epi32(_mm256_add_epi32(dot[0], dot[1]), scale);
#else /* each half's pair sums, at most 4 * 2 * 31 * 127 */
                const __m256i exact =
                    _mm256_add_epi32(_mm256_madd_epi16(pair_sums(codes, v, 4), scale),
                                     _mm256_madd_epi16(pair_sums(codes + 4, v + 16, 4), scale));
#endif
                /* at most 32 * 31 * 127 * 63, under 2^24: exact as a float */
                const float xd = x->scales[xb];
                sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(xd), sum[m]);
                mins[m] = _mm256_fmadd_ps(min, _mm256_set1_ps(xd * (float)x->sums32[xb]), mins[m]);
            }
        }
        const __m256 d = halves(gb), dmin = halves(gb + 16);
        for (int m = 0; m < rows; m++)
            acc[m] = _mm256_fnmadd_ps(mins[m], dmin, _mm256_fmadd_ps(sum[m], d, acc[m]));
    }
}
#endif
