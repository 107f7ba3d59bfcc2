/* Q4_K (ggml type 12): 256 values in 8 sub-blocks of 32, d, dmin (fp16), 6-bit scales
   and mins, nibbles. Group-block, 1184 B: d[8] | dmin[8] | scale[8 sub-blocks][8] |
   min[8][8] | 32 words of nibbles */

/* Q4_K's 12 bytes of 6-bit scales and mins <-> a byte each. Sub-blocks 0-3 take the low
   6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 the nibbles of bytes 8-11
   (scale low, min high) with the top 2 bits of bytes 0-3 (scales) and 4-7 (mins). */
static void q4_k_decode(const uint8_t *q, uint8_t scale[8], uint8_t min[8]) {
    for (int j = 0; j < 4; j++) {
        scale[j] = q[j] & 63;
        min[j] = q[j + 4] & 63;
        scale[j + 4] = (q[j + 8] & 15) | ((q[j] >> 6) << 4);
        min[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

static void q4_k_encode(const uint8_t scale[8], const uint8_t min[8], uint8_t *q) {
    for (int j = 0; j < 4; j++) {
        q[j] = (uint8_t)(scale[j] | ((scale[j + 4] >> 4) << 6));
        q[j + 4] = (uint8_t)(min[j] | ((min[j + 4] >> 4) << 6));
        q[j + 8] = (uint8_t)((scale[j + 4] & 15) | ((min[j + 4] & 15) << 4));
    }
}

/* The head Q4_K and Q5_K share: d, dmin and the packed scales and mins (file bytes
   0..15) <-> group bytes 0..159, the scales and mins a byte each */
static void move_k_head(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, 2 * r, 2, to_group);
    move_bytes(block, 2, group, 16 + 2 * r, 2, to_group);
    uint8_t scale[8], min[8];
    if (to_group) {
        q4_k_decode(block + 4, scale, min);
        for (int j = 0; j < 8; j++) {
            group[32 + 8 * j + r] = scale[j];
            group[96 + 8 * j + r] = min[j];
        }
    } else {
        for (int j = 0; j < 8; j++) {
            scale[j] = group[32 + 8 * j + r];
            min[j] = group[96 + 8 * j + r];
        }
        q4_k_encode(scale, min, block + 4);
    }
}

static void move_q4_k(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_k_head(block, group, r, to_group);
    for (int t = 0; t < 32; t++) move_bytes(block, 16 + 4 * t, group, 160 + 32 * t + 4 * r, 4, to_group);
}

/* value 64 c + 32 h + l (l < 32) is nibble h of byte 32 c + l, in sub-block 2 c + h */
static void unpack_q4_k(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            const uint8_t q = word_byte(group, 160, r, 32 * c + l);
            codes[64 * c + l] = (int8_t)(q & 15);
            codes[64 * c + 32 + l] = (int8_t)(q >> 4);
        }
    const float d = half_value(group + 2 * r), dmin = half_value(group + 16 + 2 * r);
    for (int s = 0; s < 16; s++) { /* d, dmin times 6 bits: float32 holds them exactly */
        scale[s] = d * (float)group[32 + 8 * (s / 2) + r];
        min[s] = -dmin * (float)group[96 + 8 * (s / 2) + r];
    }
}

#if INT8_SIMD
/* y = d * scale_j * code - dmin * min_j over sub-blocks j of 32, one x block each: a
   sub-block's integer sum times its scale is exact, then widened and scaled by x's. */
static inline __attribute__((always_inline)) void group_q4_k(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 1184 * b;
        fetch_ahead(gb, 1184);
        __m256 sum[MAX_X_ROWS], mins[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = mins[m] = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) { /* sub-block j: nibbles j % 2 of the words of 64s j / 2 */
            __m256i codes[8];
            for (int t = 0; t < 8; t++) {
                const __m256i raw = load32(gb + 160 + 32 * (8 * (j / 2) + t));
                codes[t] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, nibble);
            }
            const __m256i scale = sub_scales(gb + 32 + 8 * j);
            const __m256 min = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(gb + 96 + 8 * j))));
            for (int m = 0; m < rows; m++) {
                const int64_t xb = m * (x->k / 32) + 8 * b + j;
                /* without VNNI, pair sums of at most 8 * 2 * 15 * 127 */
                const __m256i exact = dot_words_scaled(codes, x->codes + 32 * xb, 8, scale);
                const __m256 xd = _mm256_set1_ps(x->scales[xb]);
                sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), xd, sum[m]);
                /* the minimums multiply the rounded x's sum over the sub-block */
                mins[m] = _mm256_fmadd_ps(min, _mm256_set1_ps(x->scales[xb] * (float)x->sums32[xb]), mins[m]);
            }
        }
        const __m256 d = halves(gb), dmin = halves(gb + 16);
        for (int m = 0; m < rows; m++)
            acc[m] = _mm256_fnmadd_ps(mins[m], dmin, _mm256_fmadd_ps(sum[m], d, acc[m]));
    }
}
#endif
