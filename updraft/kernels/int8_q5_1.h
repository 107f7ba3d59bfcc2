/* Q5_1 (ggml type 7): 32 values, d and m (fp16), qh and 16 bytes of nibbles as Q5_0's;
   value = d * code + m. Group-block, 192 B: d[8] | m[8] | each row's qh, reordered as
   Q5_0's (int8_q5_0.h) | 4 words of nibbles */
#include "int8_q5_0.h"

static void move_q5_1(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, 2 * r, 2, to_group);
    move_bytes(block, 2, group, 16 + 2 * r, 2, to_group);
    move_fifth_bits(block, 4, group, 32 + 4 * r, to_group);
    move_nibbles(block, 8, group, 64, r, to_group);
}

static void unpack_q5_1(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    uint8_t five[32];
    unpack_five_bits(group + 32, group + 64, r, five);
    for (int i = 0; i < 32; i++) codes[i] = (int8_t)five[i];
    scale[0] = scale[1] = half_value(group + 2 * r);
    min[0] = min[1] = half_value(group + 16 + 2 * r);
}

#if INT8_SIMD
/* as Q4_1's (int8_q4_1.h), with five-bit codes */
static inline __attribute__((always_inline)) void group_q5_1(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 192 * b;
        fetch_ahead(gb, 192);
        __m256i codes[8];
        five_bit_words(gb + 32, gb + 64, codes);
        const __m256 d = halves(gb), min = halves(gb + 16);
        add_scaled_with_min(codes, d, min, x, b, rows, acc);
    }
}
#endif
