/* Decode kernels: one row of x times two groups at once, on AVX-512 with VNNI, for a
   batch-1 decode step's linears.

   A decode step reads each weight once, from memory, for one row of x. The eight-row
   kernels (one group in a 256-bit register) spend as many instructions again as their
   byte products on x's broadcasts, float scaling and unpacking codes, and so read their
   weights at about half of what a core can stream. These take int8_prefill.h's two
   groups in one 512-bit register (lanes 0-7 group g's rows, 8-15 group g + 1's) and its
   x broadcast inside vpdpbusd, and do less per byte where one row of x allows:

   * each word of codes is loaded (and its two groups joined) once per block, where the
     prefill kernels load it again for every sub-block that takes a nibble of it;
   * Q4_0's high nibbles are kept in place (code times 16) instead of shifted down, and
     the block's sum is taken 16 times over (the low nibbles' sum shifted up, exact in
     int32 and in float32), the factor taken off once at the end;
   * Q4_K's and Q5_K's sub-block scales multiply the integer sums (vpmulld), and the
     block's d and dmin multiply once per 256 values, not per sub-block;
   * both groups' next group-blocks are fetched into L2 a few KB ahead, as the eight-row
     kernels fetch theirs (fetch_ahead).

   The result is the eight-row kernels' up to float32 rounding: the same integer sums,
   scaled per 32 values of x. The weights are the same groups: nothing is packed twice.
   DECODE_TYPE_LIST names the types that have one. */
#ifndef UPDRAFT_INT8_DECODE_H
#define UPDRAFT_INT8_DECODE_H

#if INT8_PAIRS
#define INT8_DECODE 1

/* How far ahead of a group-block both streams fetch into L2. The eight-row kernels'
   3 KB (fetch_ahead) is less than a group of most weights, so each pair's first
   group-blocks would wait on memory; 24 KB reaches into the next pair: from memory, with
   one thread and 2 MiB pages, 12-24 KB read 10-40% faster than 3 KB here, and a pair
   ahead (14-70 KB on the 500M model's weights) no faster than 24 KB. */
#define DECODE_AHEAD 24576

/* ``bytes`` of group-blocks a and b, DECODE_AHEAD on, into L2 (called for each part of
   a block in turn, so that the requests spread over the block's work) */
static inline __attribute__((always_inline)) void fetch_both(const uint8_t *a, const uint8_t *b,
                                                             int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) {
        _mm_prefetch((const char *)(a + DECODE_AHEAD + i), _MM_HINT_T1);
        _mm_prefetch((const char *)(b + DECODE_AHEAD + i), _MM_HINT_T1);
    }
}

static inline __m512 decode_q4_0(const uint8_t *a, const uint8_t *b, int64_t blocks,
                                 const rounded_x *x) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = a + 144 * i, *pb = b + 144 * i;
        fetch_both(pa, pb, 144);
        const int8_t *v = x->codes + 32 * i;
        /* 16 (code - 8) = 16 low + (high nibble in place) - 128: -128 sum(x) starts it */
        __m512i low = _mm512_setzero_si512(), high = _mm512_set1_epi32(x->minus128[i]);
        for (int t = 0; t < 4; t++) {
            const __m512i raw = load_pair(pa + 16 + 32 * t, pb + 16 + 32 * t);
            low = dot_at(low, _mm512_and_si512(raw, nibble), v + 4 * t);
            high = dot_at(high, _mm512_andnot_si512(nibble, raw), v + 16 + 4 * t);
        }
        /* at most 16 * 32 * 15 * 127 + 128 * 32 * 127: exact as a float */
        const __m512i sum16 = _mm512_add_epi32(_mm512_slli_epi32(low, 4), high);
        const __m512 scale = _mm512_mul_ps(halves_pair(pa, pb), _mm512_set1_ps(x->scales[i]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum16), scale, acc);
    }
    return _mm512_mul_ps(acc, _mm512_set1_ps(1.0f / 16.0f)); /* a power of two: exact */
}

static inline __m512 decode_q8_0(const uint8_t *a, const uint8_t *b, int64_t blocks,
                                 const rounded_x *x) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = a + 272 * i, *pb = b + 272 * i;
        fetch_both(pa, pb, 272);
        __m512i codes[8]; /* code + 128, unsigned; -128 sum(x) starts the sums */
        for (int t = 0; t < 8; t++)
            codes[t] = _mm512_xor_si512(load_pair(pa + 16 + 32 * t, pb + 16 + 32 * t), flip);
        const __m512i sum = dot_pair(codes, x->codes + 32 * i, 8, _mm512_set1_epi32(x->minus128[i]));
        acc = add_scaled(acc, sum, halves_pair(pa, pb), x->scales[i]);
    }
    return acc;
}

/* Q4_K and Q5_K: sub-block j's codes (codes[8]) times x block ``xb``, times its eight
   scales per group in int32 (exact: at most 32 * 31 * 127 * 63, under 2^24), into
   ``sums`` scaled by x's; the minimums times x's scaled sums into ``mins`` */
static inline __attribute__((always_inline)) void add_k_decode(const __m512i codes[8],
                                                               const uint8_t *pa,
                                                               const uint8_t *pb, int j,
                                                               const rounded_x *x, int64_t xb,
                                                               __m512 *sums, __m512 *mins) {
    const __m512i dot = dot_pair(codes, x->codes + 32 * xb, 8, _mm512_setzero_si512());
    const __m512i exact = _mm512_mullo_epi32(dot, bytes_pair(pa + 32 + 8 * j, pb + 32 + 8 * j, 0));
    *sums = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(x->scales[xb]), *sums);
    const __m512 min = _mm512_cvtepi32_ps(bytes_pair(pa + 96 + 8 * j, pb + 96 + 8 * j, 0));
    *mins = _mm512_fmadd_ps(min, _mm512_set1_ps(x->scaled_sums[xb]), *mins);
}

/* acc + d * sums - dmin * mins: a Q4_K/Q5_K group-block pair's part */
static inline __attribute__((always_inline)) __m512 add_k_block(__m512 acc, const uint8_t *pa,
                                                                const uint8_t *pb, __m512 sums,
                                                                __m512 mins) {
    acc = _mm512_fmadd_ps(sums, halves_pair(pa, pb), acc);
    return _mm512_fnmadd_ps(mins, halves_pair(pa + 16, pb + 16), acc);
}

static inline __m512 decode_q4_k(const uint8_t *a, const uint8_t *b, int64_t blocks,
                                 const rounded_x *x) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = a + 1184 * i, *pb = b + 1184 * i;
        __m512 sums = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c, 2c + 1: the nibbles of 64s c */
            fetch_both(pa + 296 * c, pb + 296 * c, 296);
            __m512i low[8], high[8];
            for (int t = 0; t < 8; t++) {
                const int at = 160 + 32 * (8 * c + t);
                const __m512i raw = load_pair(pa + at, pb + at);
                low[t] = _mm512_and_si512(raw, nibble);
                high[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
            }
            add_k_decode(low, pa, pb, 2 * c, x, 8 * i + 2 * c, &sums, &mins);
            add_k_decode(high, pa, pb, 2 * c + 1, x, 8 * i + 2 * c + 1, &sums, &mins);
        }
        acc = add_k_block(acc, pa, pb, sums, mins);
    }
    return acc;
}

static inline __m512 decode_q5_k(const uint8_t *a, const uint8_t *b, int64_t blocks,
                                 const rounded_x *x) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = a + 1440 * i, *pb = b + 1440 * i;
        __m512 sums = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
        __m512i qh[8];
        for (int t = 0; t < 8; t++) qh[t] = load_pair(pa + 160 + 32 * t, pb + 160 + 32 * t);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c, 2c + 1: nibbles of 64s c, bits 2c, 2c + 1 */
            fetch_both(pa + 360 * c, pb + 360 * c, 360);
            __m512i low[8], high[8];
            for (int t = 0; t < 8; t++) {
                const int at = 416 + 32 * (8 * c + t);
                const __m512i raw = load_pair(pa + at, pb + at);
                /* bit j of qh to bit 4: shifted left 4 - j or right j - 4 (j = 2c, 2c + 1) */
                const __m512i bit_low = 2 * c <= 4 ? _mm512_slli_epi16(qh[t], 4 - 2 * c)
                                                   : _mm512_srli_epi16(qh[t], 2 * c - 4);
                const __m512i bit_high = 2 * c + 1 <= 4 ? _mm512_slli_epi16(qh[t], 3 - 2 * c)
                                                        : _mm512_srli_epi16(qh[t], 2 * c - 3);
                /* (nibble & 0x0F) | (bit & 0x10) */
                low[t] = _mm512_ternarylogic_epi32(_mm512_and_si512(raw, nibble), bit_low, fifth, 0xF8);
                high[t] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble),
                                                    bit_high, fifth, 0xF8);
            }
            add_k_decode(low, pa, pb, 2 * c, x, 8 * i + 2 * c, &sums, &mins);
            add_k_decode(high, pa, pb, 2 * c + 1, x, 8 * i + 2 * c + 1, &sums, &mins);
        }
        acc = add_k_block(acc, pa, pb, sums, mins);
    }
    return acc;
}

/* Q6_K: in each half of 128 values, ql's 16 words hold quarters 0, 2 (words 0-7, low and
   high nibbles) and 1, 3 (words 8-15), qh's 8 words two bits of each quarter; each is
   loaded once a half. Per x block (quarter q), two sub-blocks of 16 with int8 scales:
   each sub-block's sum (codes 0..63, x's -32 sums16 to start) times its scale in int32,
   exact. */
static inline __attribute__((always_inline)) __m512i q6_k_codes(__m512i ql, __m512i qh, int q) {
    const __m512i nibbles = q < 2 ? ql : _mm512_srli_epi16(ql, 4);
    const __m512i bits = q == 0   ? _mm512_slli_epi16(qh, 4)
                         : q == 1 ? _mm512_slli_epi16(qh, 2)
                         : q == 2 ? qh
                                  : _mm512_srli_epi16(qh, 2);
    /* (nibbles & 0x0F) | (bits & 0x30) */
    return _mm512_ternarylogic_epi32(_mm512_and_si512(nibbles, _mm512_set1_epi8(0x0F)), bits,
                                     _mm512_set1_epi8(0x30), 0xF8);
}

static inline __m512 decode_q6_k(const uint8_t *a, const uint8_t *b, int64_t blocks,
                                 const rounded_x *x) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = a + 1680 * i, *pb = b + 1680 * i;
        __m512 sum = _mm512_setzero_ps();
        for (int half = 0; half < 2; half++) {
            __m512i qh[8];
            for (int w = 0; w < 8; w++) {
                const int at = 1168 + 32 * (8 * half + w);
                qh[w] = load_pair(pa + at, pb + at);
            }
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) { /* x block 4 half + q: sub-blocks s, s + 1 */
                const int s = 8 * half + 2 * q;
                const int64_t xb = 8 * i + 4 * half + q;
                fetch_both(pa + 210 * (4 * half + q), pb + 210 * (4 * half + q), 210);
                const int8_t *v = x->codes + 32 * xb;
                __m512i lo = _mm512_set1_epi32(x->minus32[2 * xb]);
                __m512i hi = _mm512_set1_epi32(x->minus32[2 * xb + 1]);
                for (int w = 0; w < 4; w++) {
                    const int ql = 144 + 32 * (16 * half + w + 8 * (q % 2));
                    lo = dot_at(lo, q6_k_codes(load_pair(pa + ql, pb + ql), qh[w], q), v + 4 * w);
                    hi = dot_at(hi, q6_k_codes(load_pair(pa + ql + 128, pb + ql + 128), qh[4 + w], q),
                                v + 16 + 4 * w);
                }
                const __m512i first = bytes_pair(pa + 16 + 8 * s, pb + 16 + 8 * s, 1);
                const __m512i second = bytes_pair(pa + 16 + 8 * (s + 1), pb + 16 + 8 * (s + 1), 1);
                const __m512i exact = _mm512_add_epi32(_mm512_mullo_epi32(lo, first),
                                                       _mm512_mullo_epi32(hi, second));
                sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(x->scales[xb]), sum);
            }
        }
        acc = _mm512_fmadd_ps(sum, halves_pair(pa, pb), acc);
    }
    return acc;
}

#define DECODE_TYPE_LIST(X) X(2, q4_0) X(8, q8_0) X(12, q4_k) X(13, q5_k) X(14, q6_k)

#else
#define INT8_DECODE 0
#endif

#endif
