/* Q4_0 (ggml type 2): 32 values, d (fp16) and 16 bytes of nibbles; value = d * (code - 8).
   Group-block, 144 B: d[8] | 4 words of nibbles (word t: bytes 4t..4t+3 of each row) */

static void move_q4_0(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, 2 * r, 2, to_group);
    for (int t = 0; t < 4; t++) move_bytes(block, 2 + 4 * t, group, 16 + 32 * t + 4 * r, 4, to_group);
}

#if INT8_SIMD
static inline __attribute__((always_inline)) void group_q4_0(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 144 * b;
        fetch_ahead(gb, 144);
        __m256i low[4], high[4];
        for (int t = 0; t < 4; t++) {
            const __m256i raw = load32(gb + 16 + 32 * t);
            low[t] = _mm256_and_si256(raw, nibble); /* values 4t .. 4t + 3 */
            high[t] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble); /* + 16 */
        }
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) {
            const int8_t *v = x->codes + m * x->k + 32 * b;
            /* eight pair sums of at most 2 * 15 * 127 each fit an int16 */
            __m256i pairs = _mm256_maddubs_epi16(low[0], broadcast4(v));
            for (int t = 1; t < 4; t++)
                pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(low[t], broadcast4(v + 4 * t)));
            for (int t = 0; t < 4; t++)
                pairs = _mm256_add_epi16(pairs,
                                         _mm256_maddubs_epi16(high[t], broadcast4(v + 16 + 4 * t)));
            /* codes 0..15 stand for -8..7 */
            const __m256i sum = _mm256_sub_epi32(
                pairs_to_int32(pairs), _mm256_set1_epi32(8 * x->sums32[m * (x->k / 32) + b]));
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->scales[m * (x->k / 32) + b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[m]);
        }
    }
}
#endif
