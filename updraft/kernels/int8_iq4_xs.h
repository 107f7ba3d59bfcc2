/* IQ4_XS (ggml type 23): 256 values in 8 sub-blocks of 32, d (fp16), a 6-bit scale per
   sub-block (low nibble in scales_l, two high bits in the uint16 scales_h), 4-bit indices
   into a table of 16 int8 values; value = d * (scale - 32) * table[index]. Group-block,
   1104 B: d[8] | scale - 32 [8 sub-blocks][8] (int8, a byte each) | 32 words of indices.
   Value 32 j + 16 e + l (l < 16) is nibble e of index byte 16 j + l. */

/* the table is IQ4_NL_VALUES (int8_iq4_nl.h, included before this header) */

/* the file's block: d, scales_h, scales_l[4], qs[128]. Sub-block j's scale: nibble j % 2
   of scales_l[j / 2], and above it bits 2j, 2j + 1 of scales_h. */
static void move_iq4_xs(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, 2 * r, 2, to_group);
    if (to_group) {
        const int high = block[2] | (block[3] << 8);
        for (int j = 0; j < 8; j++) {
            const int six = ((block[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
            group[16 + 8 * j + r] = (uint8_t)(int8_t)(six - 32);
        }
    } else {
        int high = 0;
        memset(block + 4, 0, 4);
        for (int j = 0; j < 8; j++) {
            const int six = (int8_t)group[16 + 8 * j + r] + 32;
            block[4 + j / 2] |= (uint8_t)((six & 15) << (4 * (j % 2)));
            high |= (six >> 4) << (2 * j);
        }
        block[2] = (uint8_t)high;
        block[3] = (uint8_t)(high >> 8);
    }
    for (int t = 0; t < 32; t++) move_bytes(block, 8 + 4 * t, group, 80 + 32 * t + 4 * r, 4, to_group);
}

static void unpack_iq4_xs(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    const float d = half_value(group + 2 * r);
    for (int s = 0; s < 16; s++) {
        scale[s] = d * (float)(int8_t)group[16 + 8 * (s / 2) + r];
        min[s] = 0.0f;
    }
    for (int i = 0; i < 256; i++) {
        const int j = i / 32, e = (i / 16) % 2, byte = 16 * j + i % 16;
        codes[i] = IQ4_NL_VALUES[(group[80 + 32 * (byte / 4) + 4 * r + byte % 4] >> (4 * e)) & 15];
    }
}

#if INT8_SIMD
/* Where vpdpbusd multiplies (its sums never saturate), the indices look up the values
   plus 128, unsigned, and x's sum times 128 is taken off; else the values are looked up
   signed, a weight's sign moved onto x and its magnitude multiplied as unsigned. Per
   sub-block of 32, one x block: the exact integer sum times the scale, widened and
   scaled by x's. */
static inline __attribute__((always_inline)) void group_iq4_xs(const uint8_t *group,
                                                               int64_t blocks,
                                                               const rounded_x *x, int rows,
                                                               __m256 *acc) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i table = _mm256_add_epi8(
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_NL_VALUES)),
        _mm256_set1_epi8(INT8_VNNI ? (char)128 : 0));
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 1104 * b;
        fetch_ahead(gb, 1104);
        __m256 sum[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) {
            __m256i weights[8]; /* x's values 4t .. 4t + 3 of the block */
            for (int t = 0; t < 4; t++) {
                const __m256i raw = load32(gb + 80 + 32 * (4 * j + t));
                weights[t] = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, nibble));
                const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
                weights[t + 4] = _mm256_shuffle_epi8(table, high);
            }
#if INT8_VNNI
            const __m256i scale = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(gb + 16 + 8 * j)));
            for (int m = 0; m < rows; m++) {
                const int64_t xb = m * (x->k / 32) + 8 * b + j;
                const int8_t *v = x->codes + 32 * xb;
                __m256i dot[2] = {_mm256_set1_epi32(-128 * x->sums32[xb]), _mm256_setzero_si256()};
                for (int t = 0; t < 8; t++)
                    dot[t % 2] = dot_u8s8(dot[t % 2], weights[t], broadcast4(v + 4 * t));
                /* at most 32 * 127 * 127 * 32, under 2^24: exact as a float */
                const __m256i exact = _mm256_mullo_epi32(_mm256_add_epi32(dot[0], dot[1]), scale);
                sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(x->scales[xb]), sum[m]);
            }
#else
            __m256i magnitudes[8];
            for (int t = 0; t < 8; t++) magnitudes[t] = _mm256_sign_epi8(weights[t], weights[t]);
            const __m256i scale = scale_pairs(gb + 16 + 8 * j, 1);
            for (int m = 0; m < rows; m++) {
                const int64_t xb = m * (x->k / 32) + 8 * b + j;
                const int8_t *v = x->codes + 32 * xb;
                __m256i exact = _mm256_setzero_si256();
                for (int t = 0; t < 8; t++) { /* pair sums of at most 2 * 127 * 127 */
                    const __m256i signed_x = _mm256_sign_epi8(broadcast4(v + 4 * t), weights[t]);
                    exact = _mm256_add_epi32(
                        exact, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes[t], signed_x), scale));
                }
                sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(x->scales[xb]), sum[m]);
            }
#endif
        }
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) acc[m] = _mm256_fmadd_ps(sum[m], d, acc[m]);
    }
}
#endif
