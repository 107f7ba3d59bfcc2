/* updraft's own int8 codes (types 1002, groups of 32 values, and 1003, of 128): the int8
   format quantized at load (``--quantization int8``, one scale per row, repeated in
   each block). Per row and block a float32 scale and codes -128..127: value = scale *
   code, exactly.

   File block (``kernels/int8_groups.py``): scale (4 B), then the codes. Group-block,
   32 + 256 S bytes for S = 1 or 4 thirty-twos: scale[8] (float32) | per thirty-two 8
   words of codes plus 128, as bytes 0..255 (word t: codes 4t..4t+3 of each row), the
   unsigned operand vpdpbusd multiplies by x's signed codes as they are. */

static inline void move_u8(uint8_t *block, uint8_t *group, int r, int to_group, int thirty_twos) {
    move_bytes(block, 0, group, 4 * r, 4, to_group);
    for (int t = 0; t < 8 * thirty_twos; t++) {
        uint8_t *code = to_group ? group + 32 + 32 * t + 4 * r : block + 4 + 4 * t;
        move_bytes(block, 4 + 4 * t, group, 32 + 32 * t + 4 * r, 4, to_group);
        for (int j = 0; j < 4; j++) code[j] ^= 0x80; /* code + 128 <-> code */
    }
}

static void move_u8_32(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_u8(block, group, r, to_group, 1);
}

static void move_u8_128(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_u8(block, group, r, to_group, 4);
}

static inline void unpack_u8(const uint8_t *group, int r, int8_t *codes, float *scale, float *min,
                             int thirty_twos) {
    float d;
    memcpy(&d, group + 4 * r, 4);
    for (int t = 0; t < 8 * thirty_twos; t++)
        for (int j = 0; j < 4; j++)
            codes[4 * t + j] = (int8_t)(group[32 + 32 * t + 4 * r + j] ^ 0x80);
    for (int i = 0; i < 2 * thirty_twos; i++) scale[i] = d, min[i] = 0.0f;
}

static void unpack_u8_32(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    unpack_u8(group, r, codes, scale, min, 1);
}

static void unpack_u8_128(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    unpack_u8(group, r, codes, scale, min, 4);
}

#if INT8_SIMD
/* 32 codes (8 words, plus 128) times x's 32 codes ``v``, exactly, per row. With VNNI
   the stored bytes multiply x as they are, and 128 times x's sum comes off after;
   without, vpmaddubsw's pair sums of up to 2 * 255 * 127 would overflow an int16, so
   the codes are made signed again and w's sign moved onto x (at most 2 * 128 * 127). */
static inline __attribute__((always_inline)) __m256i u8_dot(const __m256i w[8], const int8_t *v,
                                                            int32_t sum) {
#if INT8_VNNI
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256(); /* two short chains */
    for (int t = 0; t < 8; t += 2) {
        a = dot_u8s8(a, w[t], broadcast4(v + 4 * t));
        b = dot_u8s8(b, w[t + 1], broadcast4(v + 4 * t + 4));
    }
    return _mm256_sub_epi32(_mm256_add_epi32(a, b), _mm256_set1_epi32(128 * sum));
#else
    (void)sum;
    __m256i exact = _mm256_setzero_si256();
    for (int t = 0; t < 8; t++) {
        const __m256i code = _mm256_xor_si256(w[t], _mm256_set1_epi8((char)0x80));
        exact = dot_u8s8(exact, _mm256_sign_epi8(code, code),
                         _mm256_sign_epi8(broadcast4(v + 4 * t), code));
    }
    return exact;
#endif
}

/* Each thirty-two's exact sum widened and scaled by x's scale, then the block's by the
   row's scale. */
static inline __attribute__((always_inline)) void group_u8(const uint8_t *group, int64_t blocks,
                                                           const rounded_x *x, int rows,
                                                           __m256 *acc, int thirty_twos) {
    const int64_t bytes = 32 + 256 * thirty_twos, xblocks = x->k / 32;
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + bytes * b;
        fetch_ahead(gb, bytes);
        __m256 sum[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = _mm256_setzero_ps();
        for (int s = 0; s < thirty_twos; s++) {
            __m256i w[8];
            for (int t = 0; t < 8; t++) w[t] = load32(gb + 32 + 256 * s + 32 * t);
            for (int m = 0; m < rows; m++) {
                const int64_t xb = m * xblocks + thirty_twos * b + s;
                const __m256i exact = u8_dot(w, x->codes + 32 * xb, x->sums32[xb]);
                sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(x->scales[xb]),
                                         sum[m]);
            }
        }
        const __m256 scale = _mm256_loadu_ps((const float *)gb);
        for (int m = 0; m < rows; m++) acc[m] = _mm256_fmadd_ps(sum[m], scale, acc[m]);
    }
}

static inline __attribute__((always_inline)) void group_u8_32(const uint8_t *group, int64_t blocks,
                                                              const rounded_x *x, int rows,
                                                              __m256 *acc) {
    group_u8(group, blocks, x, rows, acc, 1);
}

static inline __attribute__((always_inline)) void group_u8_128(const uint8_t *group,
                                                               int64_t blocks, const rounded_x *x,
                                                               int rows, __m256 *acc) {
    group_u8(group, blocks, x, rows, acc, 4);
}
#endif
