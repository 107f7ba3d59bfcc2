/* Q6_K (ggml type 14): 256 values in 16 sub-blocks of 16, 6-bit codes (ql nibbles, qh
   pairs), int8 scales, d. Group-block, 1680 B: d[8] | scale[16 sub-blocks][8] (int8) |
   32 words of ql | 16 of qh */

/* the file's block: ql[128], qh[64], scales[16], d */
static void move_q6_k(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 208, group, 2 * r, 2, to_group);
    for (int s = 0; s < 16; s++) move_bytes(block, 192 + s, group, 16 + 8 * s + r, 1, to_group);
    for (int t = 0; t < 32; t++) move_bytes(block, 4 * t, group, 144 + 32 * t + 4 * r, 4, to_group);
    for (int t = 0; t < 16; t++) move_bytes(block, 128 + 4 * t, group, 1168 + 32 * t + 4 * r, 4, to_group);
}

/* In each half h of 128 values, value 32 q + l (quarter q, l < 32) takes a nibble of ql
   byte 64 h + l (q 0, 2) or + 32 (q 1, 3), low for q < 2, and bits 2q, 2q + 1 of qh byte
   32 h + l; sub-block i / 16 has scale byte i / 16. */
static void unpack_q6_k(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    for (int half = 0; half < 2; half++)
        for (int l = 0; l < 32; l++) {
            const uint8_t first = word_byte(group, 144, r, 64 * half + l);
            const uint8_t second = word_byte(group, 144, r, 64 * half + 32 + l);
            const uint8_t high = word_byte(group, 1168, r, 32 * half + l);
            int8_t *out = codes + 128 * half + l;
            out[0] = (int8_t)(((first & 15) | ((high & 3) << 4)) - 32);
            out[32] = (int8_t)(((second & 15) | (((high >> 2) & 3) << 4)) - 32);
            out[64] = (int8_t)(((first >> 4) | (((high >> 4) & 3) << 4)) - 32);
            out[96] = (int8_t)(((second >> 4) | ((high >> 6) << 4)) - 32);
        }
    const float d = half_value(group + 2 * r);
    for (int s = 0; s < 16; s++) { /* d times an int8: float32 holds it exactly */
        scale[s] = d * (float)(int8_t)group[16 + 8 * s + r];
        min[s] = 0.0f;
    }
}

#if INT8_SIMD
/* quarter q's six-bit codes from a word of ql (the first 32 bytes of a half for q 0 and
   2, the second for 1 and 3) and its word of qh: ql's low nibbles for q < 2, high
   nibbles else, with qh's bits 2q, 2q + 1 as bits 4 and 5 */
static inline __attribute__((always_inline)) __m256i q6_k_quarter(__m256i ql, __m256i qh, int q) {
    const __m256i low = q < 2 ? ql : _mm256_srli_epi16(ql, 4);
    const __m256i high = q == 0   ? _mm256_slli_epi16(qh, 4)
                         : q == 1 ? _mm256_slli_epi16(qh, 2)
                         : q == 2 ? qh
                                  : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x0F)),
                           _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
}

/* y = d * scale_s * (code - 32) over sub-blocks s of 16, two to an x block. In each
   half of 128 values, value 32 q + l (quarter q, l < 32) takes a nibble of ql byte l
   (q 0, 2) or l + 32 (q 1, 3), low for q < 2, and bits 2q, 2q + 1 of qh byte l.
   The products stay vpmaddubsw's int16 pair sums with VNNI too: there, vpdpbusd with the
   offset and scale in int32 (a vpmulld) was no faster at one row of x (building the six-
   bit codes bounds it) and within a few percent at eight. */
static inline __attribute__((always_inline)) void group_q6_k(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 1680 * b;
        fetch_ahead(gb, 1680);
        __m256 sum[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = _mm256_setzero_ps();
        for (int half = 0; half < 2; half++)
            for (int q = 0; q < 4; q++) { /* x block 4 half + q: sub-blocks s, s + 1 */
                const int s = 8 * half + 2 * q;
                __m256i exact[MAX_X_ROWS];
                for (int m = 0; m < rows; m++) exact[m] = _mm256_setzero_si256();
                for (int part = 0; part < 2; part++) { /* l = 16 part .. 16 part + 15 */
                    __m256i codes[4];
                    for (int u = 0; u < 4; u++) {
                        const int word = 4 * part + u; /* l = 4 word .. 4 word + 3 */
                        const __m256i ql =
                            load32(gb + 144 + 32 * (16 * half + word + 8 * (q % 2)));
                        const __m256i qh = load32(gb + 1168 + 32 * (8 * half + word));
                        codes[u] = q6_k_quarter(ql, qh, q);
                    }
                    const __m256i scale = scale_pairs(gb + 16 + 8 * (s + part), 1);
                    for (int m = 0; m < rows; m++) {
                        const int64_t at = m * x->k + 256 * b + 128 * half + 32 * q + 16 * part;
                        /* four pair sums of up to 2 * 63 * 127 each wrap an int16, but
                           with 32 * x's taken off (codes 0..63 stand for -32..31) what is
                           left, at most 4 * 2 * 32 * 127, fits: the wrapping cancels */
                        const __m256i pairs = _mm256_sub_epi16(pair_sums(codes, x->codes + at, 4),
                                                               _mm256_set1_epi32(x->offsets16[at / 16]));
                        exact[m] = _mm256_add_epi32(exact[m], _mm256_madd_epi16(pairs, scale));
                    }
                }
                for (int m = 0; m < rows; m++) {
                    const __m256 xd = _mm256_set1_ps(x->scales[m * (x->k / 32) + 8 * b + 4 * half + q]);
                    sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact[m]), xd, sum[m]);
                }
            }
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) acc[m] = _mm256_fmadd_ps(sum[m], d, acc[m]);
    }
}
#endif
