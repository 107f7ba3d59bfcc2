/* Q4_0 (ggml type 2): 32 values, d (fp16) and 16 bytes of nibbles; value = d * (code - 8).
   Group-block, 144 B: d[8] | 4 words of nibbles (int8_block32.h) */
#include "int8_block32.h"

static void move_q4_0(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, 2 * r, 2, to_group);
    move_nibbles(block, 2, group, 16, r, to_group);
}

static void unpack_q4_0(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    uint8_t nibbles[32];
    unpack_nibbles(group + 16, r, nibbles);
    for (int i = 0; i < 32; i++) codes[i] = (int8_t)(nibbles[i] - 8);
    scale[0] = scale[1] = half_value(group + 2 * r);
    min[0] = min[1] = 0.0f;
}

#if INT8_SIMD
static inline __attribute__((always_inline)) void group_q4_0(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 144 * b;
        fetch_ahead(gb, 144);
        __m256i codes[8]; /* register w: values 4w .. 4w + 3 */
        nibble_words(gb + 16, codes);
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
