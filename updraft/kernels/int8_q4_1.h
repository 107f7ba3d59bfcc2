/* Q4_1 (ggml type 3): 32 values, d and m (fp16) and 16 bytes of nibbles; value = d *
   code + m. Group-block, 160 B: d[8] | m[8] | 4 words of nibbles (int8_block32.h) */
#include "int8_block32.h"

static void move_q4_1(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, 2 * r, 2, to_group);
    move_bytes(block, 2, group, 16 + 2 * r, 2, to_group);
    move_nibbles(block, 4, group, 32, r, to_group);
}

static void unpack_q4_1(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    uint8_t nibbles[32];
    unpack_nibbles(group + 32, r, nibbles);
    for (int i = 0; i < 32; i++) codes[i] = (int8_t)nibbles[i];
    scale[0] = scale[1] = half_value(group + 2 * r);
    min[0] = min[1] = half_value(group + 16 + 2 * r);
}

#if INT8_SIMD
/* sum of x * (d q + m) over a block = x's scale * (d * sum(codes * q) + m * sum(codes)) */
static inline __attribute__((always_inline)) void group_q4_1(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 160 * b;
        fetch_ahead(gb, 160);
        __m256i codes[8];
        nibble_words(gb + 32, codes);
        const __m256 d = halves(gb), min = halves(gb + 16);
        add_scaled_with_min(codes, d, min, x, b, rows, acc);
    }
}
#endif
