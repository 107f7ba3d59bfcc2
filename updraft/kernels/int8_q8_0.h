/* Q8_0 (ggml type 8): 32 values, d (fp16) and 32 int8 codes; value = d * code.
   Group-block, 272 B: d[8] | 8 words of codes */

static void move_q8_0(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, 2 * r, 2, to_group);
    for (int t = 0; t < 8; t++) move_bytes(block, 2 + 4 * t, group, 16 + 32 * t + 4 * r, 4, to_group);
}

#if INT8_SIMD
static inline __attribute__((always_inline)) void group_q8_0(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 272 * b;
        fetch_ahead(gb, 272);
        __m256i sum[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) {
            const __m256i w = load32(gb + 16 + 32 * t);
            const __m256i magnitude = _mm256_sign_epi8(w, w); /* |w|, unsigned */
            for (int m = 0; m < rows; m++) {
                /* w's sign moved onto x; a pair sum of at most 2 * 128 * 127 */
                const __m256i v = _mm256_sign_epi8(broadcast4(x->codes + m * x->k + 32 * b + 4 * t), w);
                sum[m] = _mm256_add_epi32(sum[m],
                                          pairs_to_int32(_mm256_maddubs_epi16(magnitude, v)));
            }
        }
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) {
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->scales[m * (x->k / 32) + b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), scale, acc[m]);
        }
    }
}
#endif
