/* MXFP4 (ggml type 39): 32 values, a power-of-two scale byte e (E8M0) and 16 bytes of
   nibbles, each an E2M1 float; value = 2^(e - 127) * e2m1(code) = 2^(e - 128) *
   twice it, an integer -12..12. Group-block, 136 B: e[8] | 4 words of nibbles
   (int8_block32.h) */
#include "int8_block32.h"

/* E2M1's 16 codes doubled: 0, .5, 1, 1.5, 2, 3, 4, 6 times two, bit 3 the sign */
static const int8_t MXFP4_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* e -> 2^(e - 128), built from the bits (e = 0 and 1 give subnormal floats), exactly */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static void move_mxfp4(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, r, 1, to_group);
    move_nibbles(block, 1, group, 8, r, to_group);
}

static void unpack_mxfp4(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    uint8_t nibbles[32];
    unpack_nibbles(group + 8, r, nibbles);
    for (int i = 0; i < 32; i++) codes[i] = MXFP4_DOUBLED[nibbles[i]];
    scale[0] = scale[1] = e8m0_half(group[r]);
    min[0] = min[1] = 0.0f;
}

#if INT8_SIMD
/* e8m0_half of eight bytes */
static inline __m256 e8m0_halves(const uint8_t *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, is_small));
}

/* The doubled values are looked up 12 higher (0..24, unsigned, so no sign trick), and
   12 times x's sum taken off. */
static inline __attribute__((always_inline)) void group_mxfp4(const uint8_t *group,
                                                              int64_t blocks,
                                                              const rounded_x *x, int rows,
                                                              __m256 *acc) {
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_add_epi8(_mm_loadu_si128((const __m128i *)MXFP4_DOUBLED), _mm_set1_epi8(12)));
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 136 * b;
        fetch_ahead(gb, 136);
        __m256i codes[8];
        nibble_words(gb + 8, codes);
        for (int w = 0; w < 8; w++) codes[w] = _mm256_shuffle_epi8(table, codes[w]);
        const __m256 e = e8m0_halves(gb);
        for (int m = 0; m < rows; m++) {
            const int64_t xb = m * (x->k / 32) + b;
            const __m256i sum = _mm256_sub_epi32(dot_block32(codes, x->codes + 32 * xb),
                                                 _mm256_set1_epi32(12 * x->sums32[xb]));
            const __m256 scale = _mm256_mul_ps(e, _mm256_set1_ps(x->scales[xb]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[m]);
        }
    }
}
#endif
