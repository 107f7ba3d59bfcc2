/* updraft's own 4-bit codes (types 1000, groups of 32 values, and 1001, of 128): the
   int4 format quantized at load (``--quantization int4``) and the W4 linears of AWQ,
   GPTQ and compressed-tensors checkpoints. Per row and block a float32 scale, an
   integer zero 0..16 (GPTQ's original format stores zeros less one) and codes 0..15:
   value = scale * (code - zero), exactly.

   File block (a row's block, as ``kernels/int8_groups.py`` lays it out): scale (4 B),
   zero (1 B), then 16 bytes per 32 values, Q4_0's way (byte j: value j in the low
   nibble, value j + 16 in the high). Group-block, 40 + 128 S bytes for S = 1 or 4
   thirty-twos: scale[8] (float32) | zero[8] | per thirty-two 4 words of nibbles
   (word t: bytes 4t..4t+3 of each row). */

#include "int8_block32.h"

static inline void move_u4(uint8_t *block, uint8_t *group, int r, int to_group, int thirty_twos) {
    move_bytes(block, 0, group, 4 * r, 4, to_group);
    move_bytes(block, 4, group, 32 + r, 1, to_group);
    for (int t = 0; t < 4 * thirty_twos; t++)
        move_bytes(block, 5 + 4 * t, group, 40 + 32 * t + 4 * r, 4, to_group);
}

static void move_u4_32(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_u4(block, group, r, to_group, 1);
}

static void move_u4_128(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_u4(block, group, r, to_group, 4);
}

/* codes less the zero (-16..15), one scale for every sixteen, no minimum: the values
   exactly */
static inline void unpack_u4(const uint8_t *group, int r, int8_t *codes, float *scale, float *min,
                             int thirty_twos) {
    float d;
    memcpy(&d, group + 4 * r, 4);
    const int zero = group[32 + r];
    for (int s = 0; s < thirty_twos; s++)
        for (int t = 0; t < 4; t++)
            for (int j = 0; j < 4; j++) {
                const uint8_t byte = group[40 + 128 * s + 32 * t + 4 * r + j];
                codes[32 * s + 4 * t + j] = (int8_t)((byte & 15) - zero);
                codes[32 * s + 16 + 4 * t + j] = (int8_t)((byte >> 4) - zero);
            }
    for (int i = 0; i < 2 * thirty_twos; i++) scale[i] = d, min[i] = 0.0f;
}

static void unpack_u4_32(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    unpack_u4(group, r, codes, scale, min, 1);
}

static void unpack_u4_128(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    unpack_u4(group, r, codes, scale, min, 4);
}

#if INT8_SIMD
/* y = scale * (sum code * x - zero * sum x) per thirty-two, an integer up to there,
   widened and scaled by x's scale, then the block's by its own */
static inline __attribute__((always_inline)) void group_u4(const uint8_t *group, int64_t blocks,
                                                           const rounded_x *x, int rows,
                                                           __m256 *acc, int thirty_twos) {
    const int64_t bytes = 40 + 128 * thirty_twos, xblocks = x->k / 32;
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + bytes * b;
        fetch_ahead(gb, bytes);
        const __m256 scale = _mm256_loadu_ps((const float *)gb);
        const __m256i zero = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(gb + 32)));
        __m256 sum[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = _mm256_setzero_ps();
        for (int s = 0; s < thirty_twos; s++) {
            __m256i codes[8];
            nibble_words(gb + 40 + 128 * s, codes);
            for (int m = 0; m < rows; m++) {
                const int64_t xb = m * xblocks + thirty_twos * b + s;
                /* without VNNI, eight pair sums of at most 2 * 15 * 127 fit an int16 */
                const __m256i exact = _mm256_sub_epi32(
                    dot_words(codes, x->codes + 32 * xb, 8),
                    _mm256_mullo_epi32(zero, _mm256_set1_epi32(x->sums32[xb])));
                sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(x->scales[xb]),
                                         sum[m]);
            }
        }
        for (int m = 0; m < rows; m++) acc[m] = _mm256_fmadd_ps(sum[m], scale, acc[m]);
    }
}

static inline __attribute__((always_inline)) void group_u4_32(const uint8_t *group, int64_t blocks,
                                                              const rounded_x *x, int rows,
                                                              __m256 *acc) {
    group_u4(group, blocks, x, rows, acc, 1);
}

static inline __attribute__((always_inline)) void group_u4_128(const uint8_t *group,
                                                               int64_t blocks, const rounded_x *x,
                                                               int rows, __m256 *acc) {
    group_u4(group, blocks, x, rows, acc, 4);
}
#endif
