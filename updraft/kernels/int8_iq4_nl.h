/* IQ4_NL (ggml type 20): 32 values, d (fp16) and 16 bytes of nibbles, each indexing a
   table of 16 int8 values (ggml's kvalues_iq4nl, denser near zero); value = d *
   table[code]. Group-block, 144 B: d[8] | 4 words of nibbles (int8_block32.h) */
#include "int8_block32.h"

static const int8_t IQ4_NL_VALUES[16] __attribute__((aligned(16))) = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static void move_iq4_nl(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, 2 * r, 2, to_group);
    move_nibbles(block, 2, group, 16, r, to_group);
}

static void unpack_iq4_nl(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    uint8_t nibbles[32];
    unpack_nibbles(group + 16, r, nibbles);
    for (int i = 0; i < 32; i++) codes[i] = IQ4_NL_VALUES[nibbles[i]];
    scale[0] = scale[1] = half_value(group + 2 * r);
    min[0] = min[1] = 0.0f;
}

#if INT8_SIMD
/* The nibbles are looked up (vpshufb) as signed values. With VNNI they are looked up
   128 higher, as unsigned bytes, and 128 times x's sum is taken off (a fifth off a
   one-row product, against the sign trick). vpmaddubsw's int16 pair sums would
   saturate on those (2 * 241 * 127), so without VNNI the product of two signed bytes
   takes the weight's magnitude as the unsigned side and its sign moved onto x (pair
   sums of at most 2 * 127 * 127). */
#define IQ4_NL_OFFSET (INT8_VNNI ? 128 : 0)

static inline __attribute__((always_inline)) void group_iq4_nl(const uint8_t *group,
                                                               int64_t blocks,
                                                               const rounded_x *x, int rows,
                                                               __m256 *acc) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_add_epi8(
        _mm_load_si128((const __m128i *)IQ4_NL_VALUES), _mm_set1_epi8((char)IQ4_NL_OFFSET)));
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 144 * b;
        fetch_ahead(gb, 144);
        __m256i values[8];
        nibble_words(gb + 16, values);
        for (int w = 0; w < 8; w++) values[w] = _mm256_shuffle_epi8(table, values[w]);
#if !INT8_VNNI
        __m256i magnitude[8];
        for (int w = 0; w < 8; w++) magnitude[w] = _mm256_sign_epi8(values[w], values[w]);
#endif
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) {
            const int64_t xb = m * (x->k / 32) + b;
            const int8_t *v = x->codes + 32 * xb;
#if INT8_VNNI
            const __m256i sum = _mm256_sub_epi32(dot_block32(values, v),
                                                 _mm256_set1_epi32(IQ4_NL_OFFSET * x->sums32[xb]));
#else
            __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
            for (int w = 0; w < 8; w += 2) {
                even = dot_u8s8(even, magnitude[w], _mm256_sign_epi8(broadcast4(v + 4 * w), values[w]));
                odd = dot_u8s8(odd, magnitude[w + 1],
                               _mm256_sign_epi8(broadcast4(v + 4 * w + 4), values[w + 1]));
            }
            const __m256i sum = _mm256_add_epi32(even, odd);
#endif
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->scales[xb]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[m]);
        }
    }
}
#endif
