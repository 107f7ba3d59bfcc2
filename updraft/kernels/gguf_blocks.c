/* GGUF's quantized blocks, read where they lie: dequantizing rows, and a linear layer
   for a few rows of x that widens each block in registers as it goes.

   A weight [N, K] of a block type is N rows of K / B blocks of ``block_bytes`` bytes,
   B = 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or 256 (Q4_K, Q6_K), exactly as in the file.
   Each block widens to B float32 values the way llama.cpp's reference does: every
   product of a scale and a code is exact in float32 (a half's 11 significant bits times
   a code of at most 6 bits and a sub-block scale of at most 7), so fused or separate
   multiply-adds give the same bits as the ``gguf`` package's numpy dequantization.

   Types are ggml's numbers: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q6_K 14. */

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_ROWS 8    /* rows of x the linear takes at once */
#define MAX_BLOCK 256 /* values in the largest block */

static __attribute__((unused)) float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000 | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* a subnormal half is a normal float */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline float half_at(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h); /* exact, as the portable conversion below */
#else
    return half_to_float(h);
#endif
}

int64_t gguf_block_values(int type) { return type == 12 || type == 14 ? 256 : 32; }

int64_t gguf_block_bytes(int type) {
    switch (type) {
    case 2: return 18;  /* Q4_0: d, 16 bytes of nibbles */
    case 3: return 20;  /* Q4_1: d, m, 16 bytes */
    case 6: return 22;  /* Q5_0: d, 32 high bits, 16 bytes */
    case 7: return 24;  /* Q5_1: d, m, 32 high bits, 16 bytes */
    case 8: return 34;  /* Q8_0: d, 32 int8 */
    case 12: return 144; /* Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes */
    case 14: return 210; /* Q6_K: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 scales, d */
    default: return 0;
    }
}

/* Q4_K's sub-block j (of 8): its 6-bit scale and min. */
static void scale_min_k4(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One block of ``type`` at ``b`` -> its values in ``y``. */
static void widen_block(int type, const uint8_t *b, float *restrict y) {
    switch (type) {
    case 2: { /* low nibbles are values 0..15, high ones 16..31 */
        const float d = half_at(b);
        const uint8_t *q = b + 2;
        for (int j = 0; j < 16; j++) y[j] = d * (float)((int)(q[j] & 0xF) - 8);
        for (int j = 0; j < 16; j++) y[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
        break;
    }
    case 3: {
        const float d = half_at(b), m = half_at(b + 2);
        const uint8_t *q = b + 4;
        for (int j = 0; j < 16; j++) y[j] = d * (float)(q[j] & 0xF) + m;
        for (int j = 0; j < 16; j++) y[j + 16] = d * (float)(q[j] >> 4) + m;
        break;
    }
    case 6: { /* bit i of the high word is value i's fifth bit */
        const float d = half_at(b);
        const uint8_t *h = b + 2, *qs = b + 6;
        const uint32_t high = h[0] | (h[1] << 8) | (h[2] << 16) | ((uint32_t)h[3] << 24);
        for (int j = 0; j < 16; j++) {
            const int low = (int)((qs[j] & 0xF) | (((high >> j) & 1) << 4));
            const int top = (int)((qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4));
            y[j] = d * (float)(low - 16);
            y[j + 16] = d * (float)(top - 16);
        }
        break;
    }
    case 7: {
        const float d = half_at(b), m = half_at(b + 2);
        const uint8_t *h = b + 4, *qs = b + 8;
        const uint32_t high = h[0] | (h[1] << 8) | (h[2] << 16) | ((uint32_t)h[3] << 24);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((qs[j] & 0xF) | (((high >> j) & 1) << 4)) + m;
            y[j + 16] = d * (float)((qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4)) + m;
        }
        break;
    }
    case 8: {
        const float d = half_at(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;  /* as the reference: x * d */
        break;
    }
    case 12: { /* 4 chunks of 64: a chunk's 32 bytes, low nibbles then high */
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *scales = b + 4, *q = b + 16;
        for (int chunk = 0; chunk < 4; chunk++) {
            int scale, min;
            scale_min_k4(2 * chunk, scales, &scale, &min);
            const float d1 = d * (float)scale, m1 = dmin * (float)min;
            scale_min_k4(2 * chunk + 1, scales, &scale, &min);
            const float d2 = d * (float)scale, m2 = dmin * (float)min;
            const uint8_t *qc = q + 32 * chunk;
            float *yc = y + 64 * chunk;
            for (int l = 0; l < 32; l++) yc[l] = d1 * (float)(qc[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) yc[32 + l] = d2 * (float)(qc[l] >> 4) - m2;
        }
        break;
    }
    case 14: { /* 2 halves of 128: value 32c + l of a half from low byte l (c even) or
                  l + 32 (c odd), its nibble c / 2, and bits 2c, 2c + 1 of high byte l */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        for (int half = 0; half < 2; half++) {
            const uint8_t *lo = ql + 64 * half, *hi = lo + 32, *h = qh + 32 * half;
            const int8_t *sc = scales + 8 * half;
            float *out = y + 128 * half;
            for (int c = 0; c < 4; c++) { /* values 32c .. 32c + 31 of the half */
                const uint8_t *nibbles = c & 1 ? hi : lo;
                const int shift = c < 2 ? 0 : 4;
                const float d1 = d * (float)sc[2 * c], d2 = d * (float)sc[2 * c + 1];
                for (int l = 0; l < 16; l++)
                    out[32 * c + l] =
                        d1 * (float)((int)(((nibbles[l] >> shift) & 0xF) |
                                           (((h[l] >> (2 * c)) & 3) << 4)) - 32);
                for (int l = 16; l < 32; l++)
                    out[32 * c + l] =
                        d2 * (float)((int)(((nibbles[l] >> shift) & 0xF) |
                                           (((h[l] >> (2 * c)) & 3) << 4)) - 32);
            }
        }
        break;
    }
    }
}

/* rows of ``k`` values each, ``row_bytes`` apart -> out [rows, k] float32. */
void gguf_dequantize(int type, const uint8_t *w, int64_t rows, int64_t k, int64_t row_bytes,
                     float *out, int threads) {
    const int64_t values = gguf_block_values(type), bytes = gguf_block_bytes(type);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t blk = 0; blk < k / values; blk++)
            widen_block(type, w + r * row_bytes + blk * bytes, out + r * k + blk * values);
}

#if defined(__AVX512F__)
/* One block's values, 16 at a time in registers, multiplied into each row's 16 partial
   sums: acc[r] += w * x[r][base + offset .. + 16]. No buffer, no scalar loop. */
#define ROWS_FMA(w, offset)                                                                   \
    for (int64_t r = 0; r < m; r++)                                                          \
        acc[r] = _mm512_fmadd_ps((w), _mm512_loadu_ps(x + r * k + base + (offset)), acc[r]);


/* 16 bytes at p as 16 int32 lanes, unsigned or signed */
static inline __m512i bytes16(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline __m512i signed16(const uint8_t *p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline __m512 splat(float value) { return _mm512_set1_ps(value); }

static void block_fma(int type, const uint8_t *b, const float *x, int64_t k, int64_t base,
                      int64_t m, __m512 *acc) {
    const __m512i low4 = _mm512_set1_epi32(0xF);
    switch (type) {
    case 2:
    case 3: { /* Q4_0: d * (q - 8); Q4_1: d * q + m */
        const int with_min = type == 3;
        const __m512 d = splat(half_at(b));
        const __m512 add = with_min ? splat(half_at(b + 2)) : splat(-8.0f * half_at(b));
        const __m512i q = bytes16(b + (with_min ? 4 : 2));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, low4));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
        ROWS_FMA(_mm512_fmadd_ps(lo, d, add), 0)
        ROWS_FMA(_mm512_fmadd_ps(hi, d, add), 16)
        break;
    }
    case 6:
    case 7: { /* Q5_0: d * (q - 16); Q5_1: d * q + m; bit i of qh is value i's fifth bit */
        const int with_min = type == 7;
        const __m512 d = splat(half_at(b));
        const __m512 add = with_min ? splat(half_at(b + 2)) : splat(-16.0f * half_at(b));
        const uint8_t *h = b + (with_min ? 4 : 2);
        const uint32_t high = h[0] | (h[1] << 8) | (h[2] << 16) | ((uint32_t)h[3] << 24);
        const __m512i q = bytes16(h + 4), sixteen = _mm512_set1_epi32(16);
        const __m512i lo4 = _mm512_and_si512(q, low4), hi4 = _mm512_srli_epi32(q, 4);
        const __m512i lo = _mm512_mask_add_epi32(lo4, (__mmask16)(high & 0xFFFF), lo4, sixteen);
        const __m512i hi = _mm512_mask_add_epi32(hi4, (__mmask16)(high >> 16), hi4, sixteen);
        ROWS_FMA(_mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, add), 0)
        ROWS_FMA(_mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, add), 16)
        break;
    }
    case 8: { /* Q8_0: q * d */
        const __m512 d = splat(half_at(b));
        ROWS_FMA(_mm512_mul_ps(_mm512_cvtepi32_ps(signed16(b + 2)), d), 0)
        ROWS_FMA(_mm512_mul_ps(_mm512_cvtepi32_ps(signed16(b + 18)), d), 16)
        break;
    }
    case 12: { /* Q4_K: 4 chunks of 64, d * sc * q - dmin * min per sub-block of 32 */
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *scales = b + 4, *q = b + 16;
        for (int chunk = 0; chunk < 4; chunk++) {
            int scale, min;
            scale_min_k4(2 * chunk, scales, &scale, &min);
            const __m512 d1 = splat(d * (float)scale), m1 = splat(-dmin * (float)min);
            scale_min_k4(2 * chunk + 1, scales, &scale, &min);
            const __m512 d2 = splat(d * (float)scale), m2 = splat(-dmin * (float)min);
            for (int half = 0; half < 2; half++) {
                const __m512i bytes = bytes16(q + 32 * chunk + 16 * half);
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low4));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
                ROWS_FMA(_mm512_fmadd_ps(lo, d1, m1), 64 * chunk + 16 * half)
                ROWS_FMA(_mm512_fmadd_ps(hi, d2, m2), 64 * chunk + 32 + 16 * half)
            }
        }
        break;
    }
    case 14: { /* Q6_K: (d * sc) * (q - 32) per sub-block of 16 */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
#if defined(__AVX512BW__)
        /* A half's 128 six-bit codes assembled 64 bytes at a time: low bytes 0..63 of
           ql give values 0..63 (their low nibbles) and 64..127 (high nibbles); qh's
           bit pairs 0, 1 / 2, 3 / 4, 5 / 6, 7 give the fifth and sixth bits of values
           0..31 / 32..63 / 64..95 / 96..127. */
        const __m512i nibble = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi8(3);
        const __m512i offset = _mm512_set1_epi8(32);
        for (int half = 0; half < 2; half++) {
            const __m512i bytes = _mm512_loadu_si512(ql + 64 * half);
            const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * half));
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(h), h, 1);
            /* qh >> 0 for the first 32 bytes and >> 2 for the next: 16-bit lanes shift
               whole, and the mask keeps each byte's own two bits */
            const __m512i shift_lo = _mm512_mask_srli_epi16(both, 0xFFFF0000, both, 2);
            const __m512i high_lo = _mm512_and_si512(shift_lo, pair);
            const __m512i high_hi = _mm512_and_si512(_mm512_srli_epi16(shift_lo, 4), pair);
            const __m512i lo = _mm512_or_si512(_mm512_and_si512(bytes, nibble),
                                               _mm512_slli_epi16(high_lo, 4));
            const __m512i top = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
            const __m512i hi = _mm512_or_si512(top, _mm512_slli_epi16(high_hi, 4));
            const __m512i codes[2] = {_mm512_sub_epi8(lo, offset), _mm512_sub_epi8(hi, offset)};
            for (int part = 0; part < 2; part++) { /* values 64 part .. 64 part + 63 */
                __m128i quarters[4]; /* sub-blocks of 16 (the lane index is an immediate) */
                quarters[0] = _mm512_extracti32x4_epi32(codes[part], 0);
                quarters[1] = _mm512_extracti32x4_epi32(codes[part], 1);
                quarters[2] = _mm512_extracti32x4_epi32(codes[part], 2);
                quarters[3] = _mm512_extracti32x4_epi32(codes[part], 3);
                for (int quarter = 0; quarter < 4; quarter++) {
                    const __m128i sixteen = quarters[quarter];
                    const int value = 64 * part + 16 * quarter;
                    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sixteen));
                    const __m512 scale = splat(d * (float)scales[8 * half + value / 16]);
                    ROWS_FMA(_mm512_mul_ps(q, scale), 128 * half + value)
                }
            }
        }
#else
        const __m512i three = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
        for (int half = 0; half < 2; half++) {
            for (int c = 0; c < 4; c++) {
                const uint8_t *nibbles = ql + 64 * half + (c & 1 ? 32 : 0);
                const int shift = c < 2 ? 0 : 4;
                for (int part = 0; part < 2; part++) { /* values 32c + 16 part .. + 16 */
                    const __m512i low = bytes16(nibbles + 16 * part);
                    const __m512i high = bytes16(qh + 32 * half + 16 * part);
                    const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(low, shift), low4);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(high, 2 * c), three);
                    const __m512i code = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4));
                    const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(code, bias));
                    const __m512 scale = splat(d * (float)scales[8 * half + 2 * c + part]);
                    ROWS_FMA(_mm512_mul_ps(q, scale), 128 * half + 32 * c + 16 * part)
                }
            }
        }
#endif
        break;
    }
    }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* The same with AVX2's 8 lanes: each block's values 8 at a time, in registers, into
   every row's 8 partial sums. One row (a decode step) spreads its sums over eight
   accumulators by offset instead: one chain of multiply-adds waits out each one's
   latency (a row's Q4_K, Q6_K and Q8_0 ran 1.3-2x slower with one). */
#define ROWS_FMA8(w, offset)                                                                  \
    if (m == 1) {                                                                            \
        const int slot = ((offset) >> 3) & 7;                                                \
        acc[slot] = _mm256_fmadd_ps((w), _mm256_loadu_ps(x + base + (offset)), acc[slot]);   \
    } else                                                                                   \
        for (int64_t r = 0; r < m; r++)                                                      \
            acc[r] = _mm256_fmadd_ps((w), _mm256_loadu_ps(x + r * k + base + (offset)), acc[r]);

/* 8 bytes at p as 8 int32 lanes, unsigned or signed */
static inline __m256i bytes8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline __m256i signed8(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline __m256 splat8(float value) { return _mm256_set1_ps(value); }

static inline __attribute__((always_inline)) void block_fma8(int type, const uint8_t *b, const float *x, int64_t k, int64_t base,
                       int64_t m, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi32(0xF);
    switch (type) {
    case 2:
    case 3: { /* Q4_0: d * (q - 8); Q4_1: d * q + m */
        const int with_min = type == 3;
        const __m256 d = splat8(half_at(b));
        const __m256 add = with_min ? splat8(half_at(b + 2)) : splat8(-8.0f * half_at(b));
        const uint8_t *q = b + (with_min ? 4 : 2);
#pragma GCC unroll 2
        for (int part = 0; part < 2; part++) {
            const __m256i bytes = bytes8(q + 8 * part);
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low4));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
            ROWS_FMA8(_mm256_fmadd_ps(lo, d, add), 8 * part)
            ROWS_FMA8(_mm256_fmadd_ps(hi, d, add), 16 + 8 * part)
        }
        break;
    }
    case 6:
    case 7: { /* Q5_0: d * (q - 16); Q5_1: d * q + m; bit i of qh is value i's fifth bit */
        const int with_min = type == 7;
        const __m256 d = splat8(half_at(b));
        const __m256 add = with_min ? splat8(half_at(b + 2)) : splat8(-16.0f * half_at(b));
        const uint8_t *h = b + (with_min ? 4 : 2);
        const uint32_t high = h[0] | (h[1] << 8) | (h[2] << 16) | ((uint32_t)h[3] << 24);
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
#pragma GCC unroll 2
        for (int part = 0; part < 2; part++) {
            const __m256i bytes = bytes8(h + 4 + 8 * part);
            const __m256i fifth_lo = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32((int)(high >> (8 * part))), lanes), one);
            const __m256i fifth_hi = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32((int)(high >> (16 + 8 * part))), lanes), one);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(bytes, low4),
                                               _mm256_slli_epi32(fifth_lo, 4));
            const __m256i hi = _mm256_or_si256(_mm256_srli_epi32(bytes, 4),
                                               _mm256_slli_epi32(fifth_hi, 4));
            ROWS_FMA8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), d, add), 8 * part)
            ROWS_FMA8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), d, add), 16 + 8 * part)
        }
        break;
    }
    case 8: { /* Q8_0: q * d */
        const __m256 d = splat8(half_at(b));
#pragma GCC unroll 4
        for (int part = 0; part < 4; part++)
            ROWS_FMA8(_mm256_mul_ps(_mm256_cvtepi32_ps(signed8(b + 2 + 8 * part)), d), 8 * part)
        break;
    }
    case 12: { /* Q4_K: 4 chunks of 64, d * sc * q - dmin * min per sub-block of 32 */
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *scales = b + 4, *q = b + 16;
        float factor[8], offset[8]; /* each sub-block's d * sc and -dmin * min, first */
        for (int j = 0; j < 8; j++) {
            int scale, min;
            scale_min_k4(j, scales, &scale, &min);
            factor[j] = d * (float)scale, offset[j] = -dmin * (float)min;
        }
#pragma GCC unroll 4
        for (int chunk = 0; chunk < 4; chunk++) {
            const __m256 d1 = splat8(factor[2 * chunk]), m1 = splat8(offset[2 * chunk]);
            const __m256 d2 = splat8(factor[2 * chunk + 1]), m2 = splat8(offset[2 * chunk + 1]);
#pragma GCC unroll 4
            for (int part = 0; part < 4; part++) {
                const __m256i bytes = bytes8(q + 32 * chunk + 8 * part);
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, low4));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
                ROWS_FMA8(_mm256_fmadd_ps(lo, d1, m1), 64 * chunk + 8 * part)
                ROWS_FMA8(_mm256_fmadd_ps(hi, d2, m2), 64 * chunk + 32 + 8 * part)
            }
        }
        break;
    }
    case 14: { /* Q6_K: (d * sc) * (q - 32) per sub-block of 16 */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const uint8_t *nibbles = ql + 64 * half + (c & 1 ? 32 : 0);
                const int shift = c < 2 ? 0 : 4;
#pragma GCC unroll 4
                for (int part = 0; part < 4; part++) { /* values 32c + 8 part .. + 8 */
                    const __m256i low = bytes8(nibbles + 8 * part);
                    const __m256i high = bytes8(qh + 32 * half + 8 * part);
                    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(low, shift), low4);
                    const __m256i hi =
                        _mm256_and_si256(_mm256_srli_epi32(high, 2 * c), three);
                    const __m256i code = _mm256_or_si256(lo, _mm256_slli_epi32(hi, 4));
                    const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(code, bias));
                    const __m256 scale = splat8(d * (float)scales[8 * half + 2 * c + part / 2]);
                    ROWS_FMA8(_mm256_mul_ps(q, scale), 128 * half + 32 * c + 8 * part)
                }
            }
        }
        break;
    }
    }
}

static inline float sum8(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#endif

/* y [m, n] = x [m, k] @ W^T (+ bias), W's n rows in blocks of ``type``, m <= MAX_ROWS.
   With AVX-512 (AVX2) each block is widened 16 (8) values at a time in registers and
   multiplied into every row of x; otherwise it is widened into a buffer of the
   thread's. */
void gguf_linear(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                 int64_t row_bytes, const float *bias, float *y, int threads) {
    const int64_t values = gguf_block_values(type), bytes = gguf_block_bytes(type);
    const int64_t blocks = k / values;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *row = w + o * row_bytes;
#if defined(__AVX512F__)
        __m512 acc[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t blk = 0; blk < blocks; blk++)
            block_fma(type, row + blk * bytes, x, k, blk * values, m, acc);
        for (int64_t r = 0; r < m; r++)
            y[r * n + o] = _mm512_reduce_add_ps(acc[r]) + (bias ? bias[o] : 0.0f);
#elif defined(__AVX2__)
        __m256 acc[MAX_ROWS];
        for (int r = 0; r < MAX_ROWS; r++) acc[r] = _mm256_setzero_ps();
        if (m == 1) { /* a constant type per loop: the block's switch folds away */
#define ONE_ROW(TYPE)                                                                        \
    case TYPE:                                                                               \
        for (int64_t blk = 0; blk < blocks; blk++)                                           \
            block_fma8(TYPE, row + blk * bytes, x, k, blk * values, 1, acc);                 \
        break;
            switch (type) { ONE_ROW(2) ONE_ROW(3) ONE_ROW(6) ONE_ROW(7) ONE_ROW(8) ONE_ROW(12) ONE_ROW(14) }
#undef ONE_ROW
            const __m256 four = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            const __m256 more = _mm256_add_ps(_mm256_add_ps(acc[4], acc[5]), _mm256_add_ps(acc[6], acc[7]));
            y[o] = sum8(_mm256_add_ps(four, more)) + (bias ? bias[o] : 0.0f);
        } else {
            for (int64_t blk = 0; blk < blocks; blk++)
                block_fma8(type, row + blk * bytes, x, k, blk * values, m, acc);
            for (int64_t r = 0; r < m; r++) y[r * n + o] = sum8(acc[r]) + (bias ? bias[o] : 0.0f);
        }
#else
        float block[MAX_BLOCK] __attribute__((aligned(64)));
        float partial[MAX_ROWS][32] __attribute__((aligned(64)));
        memset(partial, 0, sizeof partial);
        for (int64_t blk = 0; blk < blocks; blk++) {
            widen_block(type, row + blk * bytes, block);
            const float *xs = x + blk * values;
            for (int64_t r = 0; r < m; r++)
                for (int64_t start = 0; start < values; start += 32)
#pragma omp simd
                    for (int i = 0; i < 32; i++)
                        partial[r][i] += xs[r * k + start + i] * block[start + i];
        }
        for (int64_t r = 0; r < m; r++) {
            float total = bias ? bias[o] : 0.0f;
#pragma omp simd reduction(+ : total)
            for (int i = 0; i < 32; i++) total += partial[r][i];
            y[r * n + o] = total;
        }
#endif
    }
}
