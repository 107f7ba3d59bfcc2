/* What the 32-value block types with 4-bit codes share (Q4_0, Q4_1, Q5_0, Q5_1,
   IQ4_NL, MXFP4, and updraft's int4): an fp16 field read without F16C, and their nibbles' place in a group-block,
   four words (word t: bytes 4t..4t+3 of each row's 16, row r's at 4r), so that value
   i < 16 is the low nibble of byte i and value 16 + i its high nibble. */
#ifndef UPDRAFT_INT8_BLOCK32_H
#define UPDRAFT_INT8_BLOCK32_H

#include "int8_simd.h"


/* the 16 nibble bytes at ``block_at`` of row r's block <-> the group-block's words at
   ``group_at`` */
static inline void move_nibbles(uint8_t *block, int block_at, uint8_t *group, int group_at,
                                int r, int to_group) {
    for (int t = 0; t < 4; t++)
        move_bytes(block, block_at + 4 * t, group, group_at + 32 * t + 4 * r, 4, to_group);
}

/* row r's 32 nibbles, in value order, from the words at ``words`` */
static inline void unpack_nibbles(const uint8_t *words, int r, uint8_t codes[32]) {
    for (int i = 0; i < 16; i++) {
        const uint8_t byte = words[32 * (i / 4) + 4 * r + i % 4];
        codes[i] = byte & 0x0F;
        codes[16 + i] = byte >> 4;
    }
}

#if INT8_SIMD
/* the words at ``words`` as eight registers of codes: register w holds values 4w..4w+3
   of each row (lane r row r's) */
static inline __attribute__((always_inline)) void nibble_words(const uint8_t *words,
                                                               __m256i codes[8]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++) {
        const __m256i raw = load32(words + 32 * t);
        codes[t] = _mm256_and_si256(raw, nibble);
        codes[4 + t] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    }
}


/* eight rows' unsigned codes of at most 31 (as nibble_words gives them) times a block
   of x's 32 signed ones at v: lane r, row r's integer sum. With VNNI, two chains of
   sums, so that one row of x does not wait on each product's latency; without, the
   pair sums of four words are added as int16 (at most 4 * 2 * 31 * 127) and widened
   once, as Q4_0's are. */
static inline __attribute__((always_inline)) __m256i dot_block32(const __m256i codes[8],
                                                               const int8_t *v) {
#if INT8_VNNI
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    for (int w = 0; w < 8; w += 2) {
        even = dot_u8s8(even, codes[w], broadcast4(v + 4 * w));
        odd = dot_u8s8(odd, codes[w + 1], broadcast4(v + 4 * w + 4));
    }
    return _mm256_add_epi32(even, odd);
#else
    __m256i halves16[2];
    for (int h = 0; h < 2; h++) {
        halves16[h] = _mm256_maddubs_epi16(codes[4 * h], broadcast4(v + 16 * h));
        for (int w = 4 * h + 1; w < 4 * h + 4; w++)
            halves16[h] = _mm256_add_epi16(halves16[h], _mm256_maddubs_epi16(codes[w], broadcast4(v + 4 * w)));
    }
    return _mm256_add_epi32(pairs_to_int32(halves16[0]), pairs_to_int32(halves16[1]));
#endif
}

/* acc[m] += x's scale * (d * codes . x + min * sum(x)) for block b of each row of x:
   a block with a scale d and a minimum (Q4_1, Q5_1), its codes as nibble_words lays
   them out */
static inline __attribute__((always_inline)) void add_scaled_with_min(const __m256i codes[8],
                                                                      __m256 d, __m256 min,
                                                                      const rounded_x *x,
                                                                      int64_t b, int rows,
                                                                      __m256 *acc) {
    for (int m = 0; m < rows; m++) {
        const int64_t xb = m * (x->k / 32) + b;
        const __m256i sum = dot_block32(codes, x->codes + 32 * xb);
        const float xd = x->scales[xb];
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(xd)), acc[m]);
        acc[m] = _mm256_fmadd_ps(min, _mm256_set1_ps(xd * (float)x->sums32[xb]), acc[m]);
    }
}
#endif

#endif
