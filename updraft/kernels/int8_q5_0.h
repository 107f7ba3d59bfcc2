/* Q5_0 (ggml type 6): 32 values, d (fp16), qh (4 bytes: bit i the fifth bit of value i)
   and 16 bytes of nibbles (the low four); value = d * (code - 16). Group-block, 176 B:
   d[8] | each row's qh, its bits reordered (below) | 4 words of nibbles */
#ifndef UPDRAFT_INT8_Q5_0_H
#define UPDRAFT_INT8_Q5_0_H
#include "int8_block32.h"

/* A row's fifth bits in the group: bit w of byte j is value 4w + j's, the value in byte
   j of nibble register w (nibble_words). A shift by 4 - w moves every row's bits for
   register w to bit 4 of their bytes at once, none crossing into another byte. */
static void move_fifth_bits(uint8_t *block, int block_at, uint8_t *group, int group_at,
                            int to_group) {
    uint8_t *file = block + block_at, *grouped = group + group_at, out[4] = {0};
    for (int i = 0; i < 32; i++) {
        if (to_group)
            out[i % 4] |= (uint8_t)(((file[i / 8] >> (i % 8)) & 1) << (i / 4));
        else
            out[i / 8] |= (uint8_t)(((grouped[i % 4] >> (i / 4)) & 1) << (i % 8));
    }
    memcpy(to_group ? grouped : file, out, 4);
}

/* row r's 32 five-bit codes, from the fifth bits at ``bits`` and the nibble words */
static inline void unpack_five_bits(const uint8_t *bits, const uint8_t *words, int r,
                                    uint8_t codes[32]) {
    unpack_nibbles(words, r, codes);
    for (int i = 0; i < 32; i++) codes[i] |= (uint8_t)(((bits[4 * r + i % 4] >> (i / 4)) & 1) << 4);
}

static void move_q5_0(uint8_t *block, uint8_t *group, int r, int to_group) {
    move_bytes(block, 0, group, 2 * r, 2, to_group);
    move_fifth_bits(block, 2, group, 16 + 4 * r, to_group);
    move_nibbles(block, 6, group, 48, r, to_group);
}

static void unpack_q5_0(const uint8_t *group, int r, int8_t *codes, float *scale, float *min) {
    uint8_t five[32];
    unpack_five_bits(group + 16, group + 48, r, five);
    for (int i = 0; i < 32; i++) codes[i] = (int8_t)(five[i] - 16);
    scale[0] = scale[1] = half_value(group + 2 * r);
    min[0] = min[1] = 0.0f;
}

#if INT8_SIMD
/* eight registers of five-bit codes (0..31), as nibble_words lays them out */
static inline __attribute__((always_inline)) void five_bit_words(const uint8_t *bits,
                                                                 const uint8_t *words,
                                                                 __m256i codes[8]) {
    const __m256i fifth = _mm256_set1_epi8(0x10), high = load32(bits);
    nibble_words(words, codes);
    for (int w = 0; w < 8; w++) {
        const __m256i moved = w < 4   ? _mm256_slli_epi16(high, 4 - w)
                              : w > 4 ? _mm256_srli_epi16(high, w - 4)
                                      : high;
        codes[w] = _mm256_or_si256(codes[w], _mm256_and_si256(moved, fifth));
    }
}

static inline __attribute__((always_inline)) void group_q5_0(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 176 * b;
        fetch_ahead(gb, 176);
        __m256i codes[8];
        five_bit_words(gb + 16, gb + 48, codes);
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) {
            const int64_t xb = m * (x->k / 32) + b;
            /* codes 0..31 stand for -16..15 */
            const __m256i sum = _mm256_sub_epi32(dot_block32(codes, x->codes + 32 * xb),
                                                 _mm256_set1_epi32(16 * x->sums32[xb]));
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->scales[xb]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[m]);
        }
    }
}
#endif
#endif
