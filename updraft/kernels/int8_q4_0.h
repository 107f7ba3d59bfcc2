/* Q4_0 (ggml type 2): 32 values, d (fp16) and 16 bytes of nibbles; value = d * (code - 8).
   Group-block, 144 B: d[8] | 4 words of nibbles (word t: bytes 4t..4t+3 of each row) */

static void move_q4_0(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, 2 * r, 2, to_group);
    for (int t = 0; t < 4; t++) move_bytes(block, 2 + 4 * t, group, 16 + 32 * t + 4 * r, 4, to_group);
}

/* byte l of the nibbles holds value l (low) and l + 16 (high) */
static void unpack_q4_0(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    for (int l = 0; l < 16; l++) {
        const uint8_t byte = word_byte(group, 16, r, l);
        codes[l] = (int8_t)((byte & 15) - 8);
        codes[l + 16] = (int8_t)((byte >> 4) - 8);
    }
    scale[0] = scale[1] = half_value(group + 2 * r);
    min[0] = min[1] = 0.0f;
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
        __m256i codes[8]; /* word t: values 4t .. 4t + 3 */
        for (int t = 0; t < 4; t++) {
            const __m256i raw = load32(gb + 16 + 32 * t);
            codes[t] = _mm256_and_si256(raw, nibble);
            codes[t + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
        }
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) {
            /* without VNNI, eight pair sums of at most 2 * 15 * 127 fit an int16; codes
               0..15 stand for -8..7 */
            const __m256i sum = _mm256_sub_epi32(dot_words(codes, x->codes + m * x->k + 32 * b, 8),
                                                 _mm256_set1_epi32(8 * x->sums32[m * (x->k / 32) + b]));
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->scales[m * (x->k / 32) + b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[m]);
        }
    }
}
#endif
