/* One row of x, rounded to int8, times a weight in GGUF blocks: what llama.cpp computes
   for a decode step, and as fast, where a float32 x cannot be.

   With x in float32 (gguf_blocks.c), every weight is widened to a float and multiplied:
   on a CPU with AVX2 but not AVX-512 that is compute-bound at a third to a half of the
   memory's speed for 4- and 6-bit blocks. Rounding x to int8 in blocks of 32 (a scale
   each, max |x| / 127, as ggml's Q8_0) lets the codes multiply as bytes, 32 at a time
   (vpmaddubsw), into exact int32 sums; each block's or sub-block's sum is widened once
   and scaled by weight scale times x scale.

   The result is the float32 product of the dequantized weight and x as rounded
   (``gguf_round_x`` gives that x), up to float32 rounding of the scaled sums; the
   integer sums are exact. Q4_K's minimums multiply x's own float32 sums, unrounded.

   Types: Q4_0 2, Q8_0 8, Q4_K 12, Q6_K 14 (ggml's numbers); needs AVX2. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#if !defined(__AVX2__) || !defined(__F16C__) || !defined(__FMA__)
#error "gguf_int8.c needs AVX2, F16C and FMA"
#endif

#define X_BLOCK 32

static inline float half_at(const uint8_t *p) {
    return _cvtsh_ss((uint16_t)(p[0] | (p[1] << 8)));
}

/* x [k] -> codes [k] int8, scales [k / 32], sums4 [k / 4] (each 4 codes' sum, for the
   blocks whose codes are offset) and float sums [k / 32] of x itself. k % 32 == 0. */
void gguf_round_x(const float *x, int64_t k, int8_t *codes, float *scales, int32_t *sums4,
                  float *sums) {
    for (int64_t b = 0; b < k / X_BLOCK; b++) {
        const float *v = x + b * X_BLOCK;
        float amax = 0.0f, total = 0.0f;
        for (int i = 0; i < X_BLOCK; i++) {
            amax = fmaxf(amax, fabsf(v[i]));
            total += v[i];
        }
        const float d = amax / 127.0f;
        scales[b] = d;
        sums[b] = total;
        for (int i = 0; i < X_BLOCK; i++) {
            /* rounding half to even, as numpy's; a zero block stays zero */
            const int q = d > 0.0f ? (int)nearbyintf(v[i] / d) : 0;
            codes[b * X_BLOCK + i] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
        }
        for (int i = 0; i < X_BLOCK / 4; i++) {
            const int8_t *c = codes + b * X_BLOCK + 4 * i;
            sums4[b * X_BLOCK / 4 + i] = c[0] + c[1] + c[2] + c[3];
        }
    }
}

/* unsigned bytes times signed bytes -> 8 int32 lanes, each the sum of 4 products */
static inline __m256i dot_bytes(__m256i unsigned_codes, __m256i signed_codes) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_codes, signed_codes),
                             _mm256_set1_epi16(1));
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

static inline float sum8(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

typedef struct {
    const int8_t *codes;
    const float *scales;
    const int32_t *sums4;
    const float *sums;
} rounded_x;

/* One block's scaled sum, as 8 lanes. */
static inline __m256 q8_0_block(const uint8_t *block, const rounded_x *x, int64_t b) {
    const __m256i w = load32(block + 2), v = load32(x->codes + X_BLOCK * b);
    /* |w| as unsigned, w's sign moved onto x */
    const __m256i sum = dot_bytes(_mm256_sign_epi8(w, w), _mm256_sign_epi8(v, w));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(half_at(block) * x->scales[b]));
}

typedef __m256 (*block_sum)(const uint8_t *, const rounded_x *, int64_t);

/* A row of blocks of 32, summed two blocks at a time into two registers: one chain of
   additions would wait out each one's latency. Inlined with a constant ``sum``. */
static inline __attribute__((always_inline)) float row_of_32s(block_sum sum, int64_t bytes,
                                                              const uint8_t *row,
                                                              const rounded_x *x,
                                                              int64_t blocks) {
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        even = _mm256_add_ps(even, sum(row + bytes * b, x, b));
        odd = _mm256_add_ps(odd, sum(row + bytes * (b + 1), x, b + 1));
    }
    if (b < blocks) even = _mm256_add_ps(even, sum(row + bytes * b, x, b));
    return sum8(_mm256_add_ps(even, odd));
}

static float row_q8_0(const uint8_t *row, const rounded_x *x, int64_t blocks) {
    return row_of_32s(q8_0_block, 34, row, x, blocks);
}

static inline __m256 q4_0_block(const uint8_t *block, const rounded_x *x, int64_t b) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(block + 2));
    /* low nibbles are values 0..15, high ones 16..31 */
    const __m256i w =
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    __m256i sum = dot_bytes(w, load32(x->codes + X_BLOCK * b));
    /* codes 0..15 stand for -8..7 */
    sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(load32(x->sums4 + 8 * b), 3));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(half_at(block) * x->scales[b]));
}

static float row_q4_0(const uint8_t *row, const rounded_x *x, int64_t blocks) {
    return row_of_32s(q4_0_block, 18, row, x, blocks);
}

/* Q4_K's 12 bytes of 6-bit scales and mins -> scales[8], mins[8] as bytes. Sub-blocks
   0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take the
   nibbles of bytes 8-11 (scale low, min high) with the top 2 bits of bytes 0-3 (scales)
   and 4-7 (mins) above them: four bytes at a time, as 32-bit words. */
static inline void q4_k_scales(const uint8_t *q, uint32_t scales[2], uint32_t mins[2]) {
    uint32_t w[3];
    memcpy(w, q, sizeof w);
    const uint32_t six = 0x3F3F3F3F, four = 0x0F0F0F0F, two = 0x03030303;
    scales[0] = w[0] & six;
    mins[0] = w[1] & six;
    scales[1] = (w[2] & four) | (((w[0] >> 6) & two) << 4);
    mins[1] = ((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4);
}

/* 8 bytes as 8 float32 lanes */
static inline __m256 bytes_as_floats(const uint32_t pair[2]) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)pair)));
}

/* Each sub-block's factor d * scale_j * (x block's scale) is computed for the 8 at once,
   and broadcast from memory (a load, where a permute would take a shuffle); the
   minimums' part, dmin * min_j * (x's sum over sub-block j), is a lane-wise multiply-add
   per block. */
static float row_q4_k(const uint8_t *row, const rounded_x *x, int64_t blocks) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + 144 * b;
        uint32_t scale_bytes[2], min_bytes[2];
        q4_k_scales(block + 4, scale_bytes, min_bytes);
        float f[8] __attribute__((aligned(32)));
        _mm256_store_ps(f, _mm256_mul_ps(_mm256_mul_ps(bytes_as_floats(scale_bytes),
                                                       _mm256_set1_ps(half_at(block))),
                                         _mm256_loadu_ps(x->scales + 8 * b)));
        mins = _mm256_fmadd_ps(
            _mm256_mul_ps(bytes_as_floats(min_bytes), _mm256_loadu_ps(x->sums + 8 * b)),
            _mm256_set1_ps(half_at(block + 2)), mins);
        for (int chunk = 0; chunk < 4; chunk++) { /* sub-blocks 2 chunk (low nibbles), + 1 */
            const __m256i bytes = load32(block + 16 + 32 * chunk);
            const int8_t *xc = x->codes + 256 * b + 64 * chunk;
            const __m256i sum0 = dot_bytes(_mm256_and_si256(bytes, nibble), load32(xc));
            const __m256i sum1 =
                dot_bytes(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), load32(xc + 32));
            low = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum0), _mm256_broadcast_ss(f + 2 * chunk), low);
            high = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum1), _mm256_broadcast_ss(f + 2 * chunk + 1),
                                   high);
        }
    }
    return sum8(_mm256_sub_ps(_mm256_add_ps(low, high), mins));
}

/* 32 six-bit codes (0..63, standing for -32..31) times x block ``xb``, scaled: lanes 0-3
   are the first sub-block of 16 (scale sc[0]), lanes 4-7 the second (sc[1]) */
static inline __m256 q6_k_part(__m256i codes, const rounded_x *x, int64_t xb, float d,
                               const int8_t *sc) {
    __m256i sum = dot_bytes(codes, load32(x->codes + X_BLOCK * xb));
    sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(load32(x->sums4 + 8 * xb), 5));
    const float s = d * x->scales[xb];
    const __m256 scale = _mm256_set_m128(_mm_set1_ps(s * (float)sc[1]), _mm_set1_ps(s * (float)sc[0]));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sum), scale);
}

static float row_q6_k(const uint8_t *row, const rounded_x *x, int64_t blocks) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x30);
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + 210 * b;
        const int8_t *scales = (const int8_t *)(block + 192);
        const float d = half_at(block + 208);
        for (int half = 0; half < 2; half++) {
            /* a half's 128 codes, 32 bytes at a time: values 32c .. 32c + 31 take low
               bytes c % 2, their nibble c / 2, and bits 2c, 2c + 1 of the high bytes */
            const __m256i l0 = load32(block + 64 * half), l1 = load32(block + 64 * half + 32);
            const __m256i h = load32(block + 128 + 32 * half);
            __m256i codes[4];
            codes[0] = _mm256_or_si256(_mm256_and_si256(l0, nibble),
                                       _mm256_and_si256(_mm256_slli_epi16(h, 4), pair));
            codes[1] = _mm256_or_si256(_mm256_and_si256(l1, nibble),
                                       _mm256_and_si256(_mm256_slli_epi16(h, 2), pair));
            codes[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nibble),
                                       _mm256_and_si256(h, pair));
            codes[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nibble),
                                       _mm256_and_si256(_mm256_srli_epi16(h, 2), pair));
            const int64_t first = 8 * b + 4 * half; /* the x block of codes[0] */
            const int8_t *sc = scales + 8 * half;
            even = _mm256_add_ps(even, q6_k_part(codes[0], x, first, d, sc));
            odd = _mm256_add_ps(odd, q6_k_part(codes[1], x, first + 1, d, sc + 2));
            even = _mm256_add_ps(even, q6_k_part(codes[2], x, first + 2, d, sc + 4));
            odd = _mm256_add_ps(odd, q6_k_part(codes[3], x, first + 3, d, sc + 6));
        }
    }
    return sum8(_mm256_add_ps(even, odd));
}

int gguf_int8_type(int type) { return type == 2 || type == 8 || type == 12 || type == 14; }

/* y [n] = round(x) [k] @ W^T (+ bias), W's n rows in blocks of ``type`` (one of
   gguf_int8_type's), ``row_bytes`` apart; x is one row (``m`` is 1: the arguments are
   gguf_linear's). */
void gguf_linear_int8(int type, const float *x, int64_t m, int64_t k, const uint8_t *w,
                      int64_t n, int64_t row_bytes, const float *bias, float *y, int threads) {
    (void)m;
    int8_t *codes = malloc((size_t)k);
    float *scales = malloc(sizeof(float) * (k / X_BLOCK) * 2);
    int32_t *sums4 = malloc(sizeof(int32_t) * (k / 4));
    gguf_round_x(x, k, codes, scales, sums4, scales + k / X_BLOCK);
    const rounded_x rounded = {codes, scales, sums4, scales + k / X_BLOCK};
    const int64_t values = type == 12 || type == 14 ? 256 : 32;
    const int64_t blocks = k / values;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *row = w + o * row_bytes;
        float dot;
        switch (type) {
        case 2: dot = row_q4_0(row, &rounded, blocks); break;
        case 8: dot = row_q8_0(row, &rounded, blocks); break;
        case 12: dot = row_q4_k(row, &rounded, blocks); break;
        default: dot = row_q6_k(row, &rounded, blocks); break;
        }
        y[o] = dot + (bias ? bias[o] : 0.0f);
    }
    free(codes);
    free(scales);
    free(sums4);
}
