/* Q8_0 (ggml type 8): 32 values, d (fp16) and 32 int8 codes; value = d * code.
   Group-block, 272 B: d[8] | 8 words of codes */

static void move_q8_0(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, 2 * r, 2, to_group);
    for (int t = 0; t < 8; t++) move_bytes(block, 2 + 4 * t, group, 16 + 32 * t + 4 * r, 4, to_group);
}

static void unpack_q8_0(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    for (int l = 0; l < 32; l++) codes[l] = (int8_t)word_byte(group, 16, r, l);
    scale[0] = scale[1] = half_value(group + 2 * r);
    min[0] = min[1] = 0.0f;
}

#if INT8_SIMD
/* Both sides signed, where the byte products take one unsigned. With VNNI the weight's
   codes are flipped to code + 128 (unsigned, one xor a word for every row of x) and 128
   times x's sum taken off after; without, vpmaddubsw's pair sums of (code + 128) * x
   would saturate an int16, so the codes' signs move onto x instead, per row. */
static inline __attribute__((always_inline)) void group_q8_0(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 272 * b;
        fetch_ahead(gb, 272);
        __m256i sum[MAX_X_ROWS];
#if INT8_VNNI
        __m256i flipped[8];
        for (int t = 0; t < 8; t++)
            flipped[t] = _mm256_xor_si256(load32(gb + 16 + 32 * t), _mm256_set1_epi8((char)0x80));
        for (int m = 0; m < rows; m++)
            sum[m] = _mm256_sub_epi32(dot_words(flipped, x->codes + m * x->k + 32 * b, 8),
                                      _mm256_set1_epi32(128 * x->sums32[m * (x->k / 32) + b]));
#else
        for (int m = 0; m < rows; m++) sum[m] = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) {
            const __m256i w = load32(gb + 16 + 32 * t);
            const __m256i magnitude = _mm256_sign_epi8(w, w); /* |w|, unsigned */
            for (int m = 0; m < rows; m++) {
                /* a pair sum of at most 2 * 128 * 127 */
                const __m256i v = _mm256_sign_epi8(broadcast4(x->codes + m * x->k + 32 * b + 4 * t), w);
                sum[m] = dot_u8s8(sum[m], magnitude, v);
            }
        }
#endif
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) {
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->scales[m * (x->k / 32) + b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), scale, acc[m]);
        }
    }
}
#endif
