/* GGUF's quantized blocks, read where they lie: dequantizing rows, and a linear layer
   for a few rows of x that widens each block in registers as it goes.

   A weight [N, K] of a block type is N rows of K / B blocks of ``block_bytes`` bytes,
   B = 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4) or 256 (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
   IQ4_XS), exactly as in the file. Each block widens to B float32 values the way
   llama.cpp's reference does: every product of a scale and a code is exact in float32
   (a half's 11 significant bits times a sub-block scale and a code of at most 13 bits
   together, Q6_K's 7 + 6, IQ4_XS's 5 + 7 with its table's -127..113: float32's 24), so
   fused or separate multiply-adds give the same bits as the ``gguf`` package's numpy
   dequantization.

   Types are ggml's numbers: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q2_K 10, Q3_K 11,
   Q4_K 12, Q5_K 13, Q6_K 14, IQ4_NL 20, IQ4_XS 23, MXFP4 39.

   MXFP4 (OCP microscaling FP4, gpt-oss's experts) is a power-of-two scale byte (E8M0)
   and 32 FP4 (E2M1) codes: 4.25 bits a weight. As llama.cpp does, its codes stand for
   twice their E2M1 values (integers, -12..12) and its scale for half of 2^(e - 127),
   so each product is an integer times a power of two: exact, in any order. */

#include <math.h>
#include <omp.h>
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

int64_t gguf_block_values(int type) {
    switch (type) {
    case 10: case 11: case 12: case 13: case 14: case 23: return 256;
    default: return 32;
    }
}

int64_t gguf_block_bytes(int type) {
    switch (type) {
    case 2: return 18;  /* Q4_0: d, 16 bytes of nibbles */
    case 3: return 20;  /* Q4_1: d, m, 16 bytes */
    case 6: return 22;  /* Q5_0: d, 32 high bits, 16 bytes */
    case 7: return 24;  /* Q5_1: d, m, 32 high bits, 16 bytes */
    case 8: return 34;  /* Q8_0: d, 32 int8 */
    case 10: return 84;  /* Q2_K: 16 scale-and-min bytes, 64 bytes of 2-bit codes, d, dmin */
    case 11: return 110; /* Q3_K: 32 bytes of third bits, 64 bytes low 2 bits, 12 bytes of
                            6-bit scales, d */
    case 12: return 144; /* Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes */
    case 13: return 176; /* Q5_K: Q4_K's d, dmin and scales, 32 bytes of fifth bits, 128 */
    case 14: return 210; /* Q6_K: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 scales, d */
    case 20: return 18;  /* IQ4_NL: d, 16 bytes of nibbles indexing IQ4_VALUES */
    case 23: return 136; /* IQ4_XS: d, 2 + 4 bytes of 6-bit scales, 128 bytes of nibbles */
    case 39: return 17;  /* MXFP4: e8m0 scale, 16 bytes of nibbles indexing MXFP4_VALUES */
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

/* Q4_K's and Q5_K's 8 sub-blocks: d * scale and -dmin * min of each, for the vector
   paths, which read them once per block. */
static void k4_factors(float d, float dmin, const uint8_t *scales, float factor[8],
                       float offset[8]) {
    for (int j = 0; j < 8; j++) {
        int scale, min;
        scale_min_k4(j, scales, &scale, &min);
        factor[j] = d * (float)scale, offset[j] = -dmin * (float)min;
    }
}

/* Q3_K's sub-block j (of 16): its 6-bit scale, less 32. The low 4 bits are byte j % 8's
   low (j < 8) or high nibble, the top two bits pair j / 4 of byte 8 + j % 4. */
static int scale_k3(int j, const uint8_t *scales) {
    const int low = (scales[j & 7] >> (j < 8 ? 0 : 4)) & 0xF;
    const int high = (scales[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
    return (low | (high << 4)) - 32;
}

/* IQ4_XS's sub-block j (of 8) of the block at b: its 6-bit scale, less 32. The low 4
   bits are a nibble of bytes 4..7, the top two bits pair j of the 16-bit word at 2. */
static int scale_iq4xs(int j, const uint8_t *b) {
    const int low = (b[4 + j / 2] >> (4 * (j & 1))) & 0xF;
    const int high = ((b[2] | (b[3] << 8)) >> (2 * j)) & 3;
    return (low | (high << 4)) - 32;
}

/* The 16 values IQ4_NL's and IQ4_XS's 4-bit codes stand for (ggml's kvalues_iq4nl):
   non-linear, denser near zero where most weights lie. */
static const int8_t IQ4_VALUES[16] __attribute__((aligned(16))) = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* E2M1's 16 codes doubled (sign bit 3; 0, .5, 1, 1.5, 2, 3, 4, 6 times two), so that
   they are int8, looked up as IQ4_VALUES are; MXFP4's scale is halved to match. */
static const int8_t MXFP4_VALUES[16] __attribute__((aligned(16))) = {
    0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* An MXFP4 block's scale byte e -> 2^(e - 128) (half its E8M0 value), built from the
   bits: e = 0 and 1 are subnormal floats. Never rounded, so every product with a code
   is exact. */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* widen_block's other half: a block of Q2_K, Q3_K, Q5_K, IQ4_XS (256 values), IQ4_NL or
   MXFP4 (32) at b -> its values. Q2_K's and Q3_K's value 32s + l of each half of 128 has
   bits 2s, 2s + 1 of the half's code byte l (and Q3_K's third bit is bit 4 half + s of
   byte l); Q5_K's value 32j + l has the low (j even) or high nibble of code byte
   32 (j / 2) + l, and bit j of fifth-bit byte l. */
static void widen_block_more(int type, const uint8_t *b, float *restrict y) {
    switch (type) {
    case 10: { /* Q2_K: d * (scale & 15) * q - dmin * (scale >> 4) per sub-block of 16 */
        const uint8_t *scales = b, *q = b + 16;
        const float d = half_at(b + 80), dmin = half_at(b + 82);
        for (int v = 0; v < 256; v++) {
            const int code = (q[32 * (v >> 7) + (v & 31)] >> (2 * ((v >> 5) & 3))) & 3;
            const int scale = scales[v >> 4];
            y[v] = d * (float)(scale & 0xF) * (float)code - dmin * (float)(scale >> 4);
        }
        break;
    }
    case 11: { /* Q3_K: d * scale * (q - 4, or q where the value's third bit is set) */
        const uint8_t *third = b, *q = b + 32, *scales = b + 96;
        const float d = half_at(b + 108);
        for (int j = 0; j < 16; j++) {
            const float dl = d * (float)scale_k3(j, scales);
            for (int v = 16 * j; v < 16 * j + 16; v++) {
                const int half = v >> 7, pair = (v >> 5) & 3, l = v & 31;
                const int low = (q[32 * half + l] >> (2 * pair)) & 3;
                const int set = (third[l] >> (4 * half + pair)) & 1;
                y[v] = dl * (float)(set ? low : low - 4);
            }
        }
        break;
    }
    case 13: { /* Q5_K: d * scale * q - dmin * min per sub-block of 32, as Q4_K's */
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *scales = b + 4, *fifth = b + 16, *q = b + 48;
        for (int j = 0; j < 8; j++) {
            int scale, min;
            scale_min_k4(j, scales, &scale, &min);
            const float dl = d * (float)scale, ml = dmin * (float)min;
            for (int l = 0; l < 32; l++) {
                const int low = (q[32 * (j / 2) + l] >> (4 * (j & 1))) & 0xF;
                y[32 * j + l] = dl * (float)(low | (((fifth[l] >> j) & 1) << 4)) - ml;
            }
        }
        break;
    }
    case 20: { /* IQ4_NL: d * table[q], low nibbles values 0..15, high ones 16..31 */
        const float d = half_at(b);
        const uint8_t *q = b + 2;
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)IQ4_VALUES[q[j] & 0xF];
            y[j + 16] = d * (float)IQ4_VALUES[q[j] >> 4];
        }
        break;
    }
    case 39: { /* MXFP4: scale * table[q], low nibbles values 0..15, high ones 16..31 */
        const float d = e8m0_half(b[0]);
        const uint8_t *q = b + 1;
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)MXFP4_VALUES[q[j] & 0xF];
            y[j + 16] = d * (float)MXFP4_VALUES[q[j] >> 4];
        }
        break;
    }
    case 23: { /* IQ4_XS: d * scale * table[q] per sub-block of 32 (16 bytes, as IQ4_NL) */
        const float d = half_at(b);
        const uint8_t *q = b + 8;
        for (int j = 0; j < 8; j++) {
            const float dl = d * (float)scale_iq4xs(j, b);
            for (int l = 0; l < 16; l++) {
                y[32 * j + l] = dl * (float)IQ4_VALUES[q[16 * j + l] & 0xF];
                y[32 * j + 16 + l] = dl * (float)IQ4_VALUES[q[16 * j + l] >> 4];
            }
        }
        break;
    }
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
    default: widen_block_more(type, b, y);
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

#if defined(__AVX2__)
/* 16 bytes' low and high nibbles (values 0..15 and 16..31 of an IQ4 or MXFP4 run of
   32) looked up in a table of 16 int8 values: one byte shuffle each. */
static inline void lookup16(const int8_t *values, const uint8_t *p, __m128i *lo, __m128i *hi) {
    const __m128i table = _mm_load_si128((const __m128i *)values);
    const __m128i nibble = _mm_set1_epi8(0xF), bytes = _mm_loadu_si128((const __m128i *)p);
    *lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, nibble));
    *hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
}
#endif

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

static inline __m512 floats16(__m128i bytes) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

/* Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS and MXFP4 (their layouts at widen_block_more). */
static inline __attribute__((always_inline)) void block_fma_more(
    int type, const uint8_t *b, const float *x, int64_t k, int64_t base, int64_t m,
    __m512 *acc) {
    const __m512i three = _mm512_set1_epi32(3);
    switch (type) {
    case 10: { /* Q2_K: d * (scale & 15) * q - dmin * (scale >> 4) per sub-block of 16 */
        const uint8_t *scales = b, *q = b + 16;
        const float d = half_at(b + 80), dmin = half_at(b + 82);
        for (int half = 0; half < 2; half++)
            for (int part = 0; part < 2; part++) {
                const __m512i bytes = bytes16(q + 32 * half + 16 * part);
                for (int pair = 0; pair < 4; pair++) {
                    const int scale = scales[8 * half + 2 * pair + part];
                    const __m512i code =
                        _mm512_and_si512(_mm512_srli_epi32(bytes, 2 * pair), three);
                    const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code),
                                                     splat(d * (float)(scale & 0xF)),
                                                     splat(-dmin * (float)(scale >> 4)));
                    ROWS_FMA(w, 128 * half + 32 * pair + 16 * part)
                }
            }
        break;
    }
    case 11: { /* Q3_K: d * scale * (q - 4, or q where the value's third bit is set) */
        const uint8_t *third = b, *q = b + 32, *scales = b + 96;
        const float d = half_at(b + 108);
        const __m512i four = _mm512_set1_epi32(4);
        for (int part = 0; part < 2; part++) {
            const __m512i thirds = bytes16(third + 16 * part);
            for (int half = 0; half < 2; half++) {
                const __m512i bytes = bytes16(q + 32 * half + 16 * part);
                for (int pair = 0; pair < 4; pair++) {
                    const __m512i low = _mm512_and_si512(_mm512_srli_epi32(bytes, 2 * pair), three);
                    const __mmask16 clear =
                        _mm512_testn_epi32_mask(thirds, _mm512_set1_epi32(1 << (4 * half + pair)));
                    const __m512i code = _mm512_mask_sub_epi32(low, clear, low, four);
                    const float dl = d * (float)scale_k3(8 * half + 2 * pair + part, scales);
                    ROWS_FMA(_mm512_mul_ps(_mm512_cvtepi32_ps(code), splat(dl)),
                             128 * half + 32 * pair + 16 * part)
                }
            }
        }
        break;
    }
    case 13: { /* Q5_K: d * scale * q - dmin * min per sub-block of 32, as Q4_K's */
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *scales = b + 4, *fifth = b + 16, *q = b + 48;
        float factor[8], offset[8];
        k4_factors(d, dmin, scales, factor, offset);
        const __m512i low4 = _mm512_set1_epi32(0xF), sixteen = _mm512_set1_epi32(16);
        for (int part = 0; part < 2; part++) {
            const __m512i fifths = bytes16(fifth + 16 * part);
            for (int chunk = 0; chunk < 4; chunk++) { /* sub-blocks 2 chunk, 2 chunk + 1 */
                const __m512i bytes = bytes16(q + 32 * chunk + 16 * part);
                const __m512i lo = _mm512_and_si512(bytes, low4), hi = _mm512_srli_epi32(bytes, 4);
                const __mmask16 lo_set =
                    _mm512_test_epi32_mask(fifths, _mm512_set1_epi32(1 << (2 * chunk)));
                const __mmask16 hi_set =
                    _mm512_test_epi32_mask(fifths, _mm512_set1_epi32(2 << (2 * chunk)));
                const __m512 q_lo =
                    _mm512_cvtepi32_ps(_mm512_mask_add_epi32(lo, lo_set, lo, sixteen));
                const __m512 q_hi =
                    _mm512_cvtepi32_ps(_mm512_mask_add_epi32(hi, hi_set, hi, sixteen));
                ROWS_FMA(_mm512_fmadd_ps(q_lo, splat(factor[2 * chunk]), splat(offset[2 * chunk])),
                         64 * chunk + 16 * part)
                ROWS_FMA(_mm512_fmadd_ps(q_hi, splat(factor[2 * chunk + 1]),
                                         splat(offset[2 * chunk + 1])),
                         64 * chunk + 32 + 16 * part)
            }
        }
        break;
    }
    case 20: { /* IQ4_NL: d * table[q], low nibbles values 0..15, high ones 16..31 */
        const __m512 d = splat(half_at(b));
        __m128i lo, hi;
        lookup16(IQ4_VALUES, b + 2, &lo, &hi);
        ROWS_FMA(_mm512_mul_ps(floats16(lo), d), 0)
        ROWS_FMA(_mm512_mul_ps(floats16(hi), d), 16)
        break;
    }
    case 23: { /* IQ4_XS: d * scale * table[q] per sub-block of 32 (16 bytes, as IQ4_NL) */
        const float d = half_at(b);
        for (int j = 0; j < 8; j++) {
            const __m512 dl = splat(d * (float)scale_iq4xs(j, b));
            __m128i lo, hi;
            lookup16(IQ4_VALUES, b + 8 + 16 * j, &lo, &hi);
            ROWS_FMA(_mm512_mul_ps(floats16(lo), dl), 32 * j)
            ROWS_FMA(_mm512_mul_ps(floats16(hi), dl), 32 * j + 16)
        }
        break;
    }
    case 39: { /* MXFP4: scale * table[q], as IQ4_NL's with MXFP4_VALUES */
        const __m512 d = splat(e8m0_half(b[0]));
        __m128i lo, hi;
        lookup16(MXFP4_VALUES, b + 1, &lo, &hi);
        ROWS_FMA(_mm512_mul_ps(floats16(lo), d), 0)
        ROWS_FMA(_mm512_mul_ps(floats16(hi), d), 16)
        break;
    }
    }
}

static inline __attribute__((always_inline)) void block_fma(
    int type, const uint8_t *b, const float *x, int64_t k, int64_t base, int64_t m,
    __m512 *acc) {
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
    default: block_fma_more(type, b, x, k, base, m, acc);
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

static inline __m256 floats8(__m128i bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

/* Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS and MXFP4 (their layouts at widen_block_more). */
static inline __attribute__((always_inline)) void block_fma8_more(
    int type, const uint8_t *b, const float *x, int64_t k, int64_t base, int64_t m, __m256 *acc) {
    const __m256i three = _mm256_set1_epi32(3), one = _mm256_set1_epi32(1);
    switch (type) {
    case 10: { /* Q2_K: d * (scale & 15) * q - dmin * (scale >> 4) per sub-block of 16 */
        const uint8_t *scales = b, *q = b + 16;
        const float d = half_at(b + 80), dmin = half_at(b + 82);
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++)
#pragma GCC unroll 4
            for (int part = 0; part < 4; part++) { /* values 32 pair + 8 part .. + 8 */
                const __m256i bytes = bytes8(q + 32 * half + 8 * part);
#pragma GCC unroll 4
                for (int pair = 0; pair < 4; pair++) {
                    const int scale = scales[8 * half + 2 * pair + part / 2];
                    const __m256i code =
                        _mm256_and_si256(_mm256_srli_epi32(bytes, 2 * pair), three);
                    const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code),
                                                     splat8(d * (float)(scale & 0xF)),
                                                     splat8(-dmin * (float)(scale >> 4)));
                    ROWS_FMA8(w, 128 * half + 32 * pair + 8 * part)
                }
            }
        break;
    }
    case 11: { /* Q3_K: d * scale * (q - 4, or q where the value's third bit is set) */
        const uint8_t *third = b, *q = b + 32, *scales = b + 96;
        const float d = half_at(b + 108);
        float factor[16];
        for (int j = 0; j < 16; j++) factor[j] = d * (float)scale_k3(j, scales);
        const __m256i four = _mm256_set1_epi32(4);
#pragma GCC unroll 4
        for (int part = 0; part < 4; part++) {
            const __m256i thirds = bytes8(third + 8 * part);
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const __m256i bytes = bytes8(q + 32 * half + 8 * part);
#pragma GCC unroll 4
                for (int pair = 0; pair < 4; pair++) {
                    const __m256i low = _mm256_and_si256(_mm256_srli_epi32(bytes, 2 * pair), three);
                    const __m256i set =
                        _mm256_and_si256(_mm256_srli_epi32(thirds, 4 * half + pair), one);
                    const __m256i code =
                        _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(set, 2)), four);
                    const __m256 dl = splat8(factor[8 * half + 2 * pair + part / 2]);
                    ROWS_FMA8(_mm256_mul_ps(_mm256_cvtepi32_ps(code), dl),
                              128 * half + 32 * pair + 8 * part)
                }
            }
        }
        break;
    }
    case 13: { /* Q5_K: d * scale * q - dmin * min per sub-block of 32, as Q4_K's */
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *scales = b + 4, *fifth = b + 16, *q = b + 48;
        float factor[8], offset[8];
        k4_factors(d, dmin, scales, factor, offset);
        const __m256i low4 = _mm256_set1_epi32(0xF);
#pragma GCC unroll 4
        for (int part = 0; part < 4; part++) {
            const __m256i fifths = bytes8(fifth + 8 * part);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m256i bytes = bytes8(q + 32 * (j / 2) + 8 * part);
                const __m256i low =
                    _mm256_and_si256(_mm256_srli_epi32(bytes, 4 * (j & 1)), low4);
                const __m256i high = _mm256_and_si256(_mm256_srli_epi32(fifths, j), one);
                const __m256i code = _mm256_or_si256(low, _mm256_slli_epi32(high, 4));
                const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), splat8(factor[j]),
                                                 splat8(offset[j]));
                ROWS_FMA8(w, 32 * j + 8 * part)
            }
        }
        break;
    }
    case 20: { /* IQ4_NL: d * table[q], low nibbles values 0..15, high ones 16..31 */
        const __m256 d = splat8(half_at(b));
        __m128i lo, hi;
        lookup16(IQ4_VALUES, b + 2, &lo, &hi);
        ROWS_FMA8(_mm256_mul_ps(floats8(lo), d), 0)
        ROWS_FMA8(_mm256_mul_ps(floats8(_mm_srli_si128(lo, 8)), d), 8)
        ROWS_FMA8(_mm256_mul_ps(floats8(hi), d), 16)
        ROWS_FMA8(_mm256_mul_ps(floats8(_mm_srli_si128(hi, 8)), d), 24)
        break;
    }
    case 23: { /* IQ4_XS: d * scale * table[q] per sub-block of 32 (16 bytes, as IQ4_NL) */
        const float d = half_at(b);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256 dl = splat8(d * (float)scale_iq4xs(j, b));
            __m128i lo, hi;
            lookup16(IQ4_VALUES, b + 8 + 16 * j, &lo, &hi);
            ROWS_FMA8(_mm256_mul_ps(floats8(lo), dl), 32 * j)
            ROWS_FMA8(_mm256_mul_ps(floats8(_mm_srli_si128(lo, 8)), dl), 32 * j + 8)
            ROWS_FMA8(_mm256_mul_ps(floats8(hi), dl), 32 * j + 16)
            ROWS_FMA8(_mm256_mul_ps(floats8(_mm_srli_si128(hi, 8)), dl), 32 * j + 24)
        }
        break;
    }
    case 39: { /* MXFP4: scale * table[q], as IQ4_NL's with MXFP4_VALUES */
        const __m256 d = splat8(e8m0_half(b[0]));
        __m128i lo, hi;
        lookup16(MXFP4_VALUES, b + 1, &lo, &hi);
        ROWS_FMA8(_mm256_mul_ps(floats8(lo), d), 0)
        ROWS_FMA8(_mm256_mul_ps(floats8(_mm_srli_si128(lo, 8)), d), 8)
        ROWS_FMA8(_mm256_mul_ps(floats8(hi), d), 16)
        ROWS_FMA8(_mm256_mul_ps(floats8(_mm_srli_si128(hi, 8)), d), 24)
        break;
    }
    }
}

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
        k4_factors(d, dmin, scales, factor, offset);
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
    default: block_fma8_more(type, b, x, k, base, m, acc);
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
   thread's. ``threads`` 0: the caller's OpenMP count when it runs (gguf_gemm_int8's). */
void gguf_linear(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                 int64_t row_bytes, const float *bias, float *y, int threads) {
    if (threads <= 0) threads = omp_get_max_threads();
    const int64_t values = gguf_block_values(type), bytes = gguf_block_bytes(type);
    const int64_t blocks = k / values;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const uint8_t *row = w + o * row_bytes;
#if defined(__AVX512F__)
        __m512 acc[MAX_ROWS];
        for (int r = 0; r < MAX_ROWS; r++) acc[r] = _mm512_setzero_ps();
        if (m == 1) { /* four accumulators in turn: no block waits on the last's sums; a
                         constant type per loop, so the block's switch folds away */
#define ONE_ROW(TYPE)                                                                        \
    case TYPE:                                                                               \
        for (int64_t blk = 0; blk < blocks; blk++)                                           \
            block_fma(TYPE, row + blk * bytes, x, k, blk * values, 1, acc + (blk & 3));      \
        break;
            switch (type) {
                ONE_ROW(2) ONE_ROW(3) ONE_ROW(6) ONE_ROW(7) ONE_ROW(8) ONE_ROW(10) ONE_ROW(11)
                ONE_ROW(12) ONE_ROW(13) ONE_ROW(14) ONE_ROW(20) ONE_ROW(23) ONE_ROW(39)
            }
#undef ONE_ROW
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]),
                                             _mm512_add_ps(acc[2], acc[3]));
            y[o] = _mm512_reduce_add_ps(sum) + (bias ? bias[o] : 0.0f);
            continue;
        }
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
            switch (type) {
                ONE_ROW(2) ONE_ROW(3) ONE_ROW(6) ONE_ROW(7) ONE_ROW(8) ONE_ROW(10) ONE_ROW(11)
                ONE_ROW(12) ONE_ROW(13) ONE_ROW(14) ONE_ROW(20) ONE_ROW(23) ONE_ROW(39)
            }
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

/* An expert's gate activation, as EXPERT_ACTIVATIONS (kernels/ops.py) numbers them:
   SiLU, GELU-tanh, or gpt-oss's clamped SwiGLU (gate clamped above at ``limit``, up into
   [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)). */
static float gated(int activation, float gate, float up, float alpha, float limit) {
    if (activation == 0) return gate / (1.0f + expf(-gate)) * up;
    if (activation == 1) {
        const float inner = 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate);
        return 0.5f * gate * (1.0f + tanhf(inner)) * up;
    }
    gate = gate > limit ? limit : gate;
    up = up > limit ? limit : (up < -limit ? -limit : up);
    return (up + 1.0f) * (gate / (1.0f + expf(-alpha * gate)));
}

/* The routed experts of rows sorted by expert (rows [offsets[e], offsets[e + 1]) to
   expert e) whose experts hold at most ``most_rows`` rows each: per expert, gate and up
   (one fused part of 2I rows, or two of I, each of its own type) over its rows, the
   gate's activation, then down into those rows of ``out`` [R, H]. Experts with more rows
   are left for the caller (a widened GEMM serves them better). Biases may be NULL.
   ``scratch``: MAX_ROWS * 3I floats. One call for the layer, so a decode step does not
   pay a call's overhead per expert. */
void gguf_grouped_rows(const float *x, int64_t hidden, int64_t inter, const int64_t *offsets,
                       int64_t experts, int64_t most_rows, int parts, const uint8_t *gate_up0,
                       int type0, const uint8_t *gate_up1, int type1, const float *gate_up_bias,
                       const uint8_t *down, int down_type, const float *down_bias,
                       int activation, float alpha, float limit, float *scratch, float *out,
                       int threads) {
    const int64_t part_rows = 2 * inter / parts;
    const int64_t up_bytes = hidden / gguf_block_values(type0) * gguf_block_bytes(type0);
    const int64_t up_bytes1 =
        parts == 2 ? hidden / gguf_block_values(type1) * gguf_block_bytes(type1) : 0;
    const int64_t down_bytes = inter / gguf_block_values(down_type) * gguf_block_bytes(down_type);
    float *both = scratch, *h = scratch + MAX_ROWS * 2 * inter;
    for (int64_t e = 0; e < experts; e++) {
        const int64_t first = offsets[e], count = offsets[e + 1] - first;
        if (count == 0 || count > most_rows) continue;
        const float *bias = gate_up_bias ? gate_up_bias + e * 2 * inter : NULL;
        for (int64_t start = first; start < first + count; start += MAX_ROWS) {
            const int64_t m = first + count - start < MAX_ROWS ? first + count - start : MAX_ROWS;
            const float *rows = x + start * hidden;
            /* gate then up, [m, 2I] (fused) or [m, I] and [m, I] (two parts) */
            gguf_linear(type0, rows, m, hidden, gate_up0 + e * part_rows * up_bytes, part_rows,
                        up_bytes, bias, both, threads);
            if (parts == 2)
                gguf_linear(type1, rows, m, hidden, gate_up1 + e * part_rows * up_bytes1,
                            part_rows, up_bytes1, bias ? bias + inter : NULL,
                            both + m * inter, threads);
            for (int64_t r = 0; r < m; r++) {
                const float *gate = parts == 2 ? both + r * inter : both + r * 2 * inter;
                const float *up = parts == 2 ? both + (m + r) * inter : gate + inter;
                for (int64_t i = 0; i < inter; i++)
                    h[r * inter + i] = gated(activation, gate[i], up[i], alpha, limit);
            }
            gguf_linear(down_type, h, m, inter, down + e * hidden * down_bytes, hidden,
                        down_bytes, down_bias ? down_bias + e * hidden : NULL,
                        out + start * hidden, threads);
        }
    }
}
