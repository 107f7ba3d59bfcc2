/* Prefill kernels: many rows of x times two groups at once, on AVX-512 with VNNI.

   A prefill passes every tile of x's rows over a weight group while it is in the cache
   (gguf_gemm_int8). With the decode kernels (one group, eight rows in a 256-bit
   register) the work per byte product is as many instructions again: x's codes
   broadcast, sums scaled, codes unpacked. Here two neighbouring groups' group-blocks
   fill the two halves of a 512-bit register (lanes 0-7 group g's rows, 8-15 group g +
   1's), so each instruction does twice the work; x's four codes come from memory as a
   broadcast operand of vpdpbusd itself; the offsets of unsigned codes (Q4_0's 8, Q8_0's
   128, Q6_K's 32) start the integer sums (rounded_x's minus8, minus128, minus32)
   instead of being taken off after; and a group-block's codes are unpacked once for
   every row of x in a tile. The float work stays one scaled sum per 32 values (per x
   block, whose scale is its own), so the sums are the decode kernels' up to float32
   rounding.

   The weights are the decode kernels' groups, in the same layout: nothing is packed
   twice. Each pair_ kernel is inlined for a constant number of rows of x (gguf_int8.c's
   pair_rows). */
#ifndef UPDRAFT_INT8_PREFILL_H
#define UPDRAFT_INT8_PREFILL_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT8_PAIRS 1

/* a 256-bit word of group a and the same word of group b, as one 512-bit register */
static inline __m512i load_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load32(a)), load32(b), 1);
}

/* eight fp16s of each group (a row each), as sixteen floats */
static inline __m512 halves_pair(const uint8_t *a, const uint8_t *b) {
    const __m128i low = _mm_loadu_si128((const __m128i *)a);
    const __m128i high = _mm_loadu_si128((const __m128i *)b);
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1));
}

/* eight bytes of each group (a row each), as sixteen int32s */
static inline __m512i bytes_pair(const uint8_t *a, const uint8_t *b, int is_signed) {
    const __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a),
                                            _mm_loadl_epi64((const __m128i *)b));
    return is_signed ? _mm512_cvtepi8_epi32(both) : _mm512_cvtepu8_epi32(both);
}

/* acc + the products of u's unsigned bytes and the four signed bytes at p (in every
   lane): vpdpbusd with p as its broadcast operand, one instruction where gcc would
   broadcast into a register first */
static inline __attribute__((always_inline)) __m512i dot_at(__m512i acc, __m512i u, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)p));
    return acc;
}

/* start + the products of ``count`` words of unsigned codes with x's codes at v, in two
   chains (vpdpbusd's latency) */
static inline __attribute__((always_inline)) __m512i dot_pair(const __m512i *u, const int8_t *v,
                                                              int count, __m512i start) {
    __m512i even = start, odd = _mm512_setzero_si512();
    for (int t = 0; t < count; t += 2) {
        even = dot_at(even, u[t], v + 4 * t);
        odd = dot_at(odd, u[t + 1], v + 4 * t + 4);
    }
    return _mm512_add_epi32(even, odd);
}

/* acc[m] += (the block's integer sums) * (weight scales * x's scale) */
static inline __attribute__((always_inline)) __m512 add_scaled(__m512 acc, __m512i sum, __m512 scale,
                                                               float xd) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(xd)), acc);
}

/* a 32-value block pair's codes (codes[8], unsigned) times each row's x block i, the sums
   started at ``offset`` (x's code sums times the codes' offset: minus8 or minus128),
   scaled by d and x's scale */
static inline __attribute__((always_inline)) void add_block32(const __m512i codes[8], __m512 d,
                                                              const int32_t *offset,
                                                              const rounded_x *x, int64_t i,
                                                              int rows, __m512 *acc) {
    for (int m = 0; m < rows; m++) {
        const int64_t xb = m * (x->k / 32) + i;
        const __m512i sum = dot_pair(codes, x->codes + 32 * xb, 8, _mm512_set1_epi32(offset[xb]));
        acc[m] = add_scaled(acc[m], sum, d, x->scales[xb]);
    }
}

static inline __attribute__((always_inline)) void pair_q4_0(const uint8_t *a, const uint8_t *b,
                                                            int64_t blocks, const rounded_x *x,
                                                            int rows, __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = a + 144 * i, *pb = b + 144 * i;
        __m512i codes[8];
        for (int t = 0; t < 4; t++) {
            const __m512i raw = load_pair(pa + 16 + 32 * t, pb + 16 + 32 * t);
            codes[t] = _mm512_and_si512(raw, nibble);
            codes[4 + t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
        add_block32(codes, halves_pair(pa, pb), x->minus8, x, i, rows, acc);
    }
}

/* signed codes flipped to code + 128, 128 times x's sum taken off (minus128) */
static inline __attribute__((always_inline)) void pair_q8_0(const uint8_t *a, const uint8_t *b,
                                                            int64_t blocks, const rounded_x *x,
                                                            int rows, __m512 *acc) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = a + 272 * i, *pb = b + 272 * i;
        __m512i codes[8];
        for (int t = 0; t < 8; t++)
            codes[t] = _mm512_xor_si512(load_pair(pa + 16 + 32 * t, pb + 16 + 32 * t), flip);
        add_block32(codes, halves_pair(pa, pb), x->minus128, x, i, rows, acc);
    }
}

/* Q4_K and Q5_K: sub-block j's codes (codes[8]) times each row's x block, scaled by d
   scale_j and x's; the minimums dmin min_j times x's scaled sums */
static inline __attribute__((always_inline)) void add_k_sub_block(const __m512i codes[8],
                                                                  __m512 scale, __m512 min,
                                                                  const rounded_x *x,
                                                                  int64_t block, int rows,
                                                                  __m512 *acc) {
    for (int m = 0; m < rows; m++) {
        const int64_t xb = m * (x->k / 32) + block;
        const __m512i sum = dot_pair(codes, x->codes + 32 * xb, 8, _mm512_setzero_si512());
        acc[m] = add_scaled(acc[m], sum, scale, x->scales[xb]);
        acc[m] = _mm512_fnmadd_ps(min, _mm512_set1_ps(x->scaled_sums[xb]), acc[m]);
    }
}

/* d scale_j and dmin min_j of a Q4_K/Q5_K group-block pair's sub-block j */
static inline __attribute__((always_inline)) void k_scales(const uint8_t *pa, const uint8_t *pb,
                                                           int j, __m512 d, __m512 dmin,
                                                           __m512 *scale, __m512 *min) {
    *scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(bytes_pair(pa + 32 + 8 * j, pb + 32 + 8 * j, 0)));
    *min = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(bytes_pair(pa + 96 + 8 * j, pb + 96 + 8 * j, 0)));
}

static inline __attribute__((always_inline)) void pair_q4_k(const uint8_t *a, const uint8_t *b,
                                                            int64_t blocks, const rounded_x *x,
                                                            int rows, __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = a + 1184 * i, *pb = b + 1184 * i;
        const __m512 d = halves_pair(pa, pb), dmin = halves_pair(pa + 16, pb + 16);
        for (int j = 0; j < 8; j++) { /* sub-block j: nibbles j % 2 of the words of 64s j / 2 */
            __m512i codes[8];
            for (int t = 0; t < 8; t++) {
                const int at = 160 + 32 * (8 * (j / 2) + t);
                const __m512i raw = load_pair(pa + at, pb + at);
                codes[t] = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(raw, 4) : raw, nibble);
            }
            __m512 scale, min;
            k_scales(pa, pb, j, d, dmin, &scale, &min);
            add_k_sub_block(codes, scale, min, x, 8 * i + j, rows, acc);
        }
    }
}

static inline __attribute__((always_inline)) void pair_q5_k(const uint8_t *a, const uint8_t *b,
                                                            int64_t blocks, const rounded_x *x,
                                                            int rows, __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = a + 1440 * i, *pb = b + 1440 * i;
        const __m512 d = halves_pair(pa, pb), dmin = halves_pair(pa + 16, pb + 16);
        __m512i qh[8];
        for (int t = 0; t < 8; t++) qh[t] = load_pair(pa + 160 + 32 * t, pb + 160 + 32 * t);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) { /* nibble j % 2 of the words of 64s j / 2, bit j of qh */
            __m512i codes[8];
            for (int t = 0; t < 8; t++) {
                const int at = 416 + 32 * (8 * (j / 2) + t);
                const __m512i raw = load_pair(pa + at, pb + at);
                const __m512i low = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(raw, 4) : raw, nibble);
                const __m512i bit = j <= 4 ? _mm512_slli_epi16(qh[t], 4 - j) : _mm512_srli_epi16(qh[t], j - 4);
                codes[t] = _mm512_ternarylogic_epi32(low, bit, fifth, 0xF8); /* low | (bit & fifth) */
            }
            __m512 scale, min;
            k_scales(pa, pb, j, d, dmin, &scale, &min);
            add_k_sub_block(codes, scale, min, x, 8 * i + j, rows, acc);
        }
    }
}

/* Q6_K: per x block of 32, two sub-blocks of 16 with int8 scales; each sub-block's
   integer sum (codes 0..63, x's -32 sums16 to start) times d scale_s as a float, taken
   once per group-block pair for every row of x: per row that is two conversions and
   three multiplies, where scaling the sums in int32 (vpmulld, twice) and then d and x's
   scale took one more, on the units the products need too. */
static inline __attribute__((always_inline)) void pair_q6_k(const uint8_t *a, const uint8_t *b,
                                                            int64_t blocks, const rounded_x *x,
                                                            int rows, __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi8(0x30);
    for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = a + 1680 * i, *pb = b + 1680 * i;
        const __m512 d = halves_pair(pa, pb);
        for (int half = 0; half < 2; half++)
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) { /* x block 4 half + q: sub-blocks s, s + 1 */
                const int s = 8 * half + 2 * q;
                __m512i codes[8]; /* word w: values 32 q + 4 w .. + 3 of the half */
                for (int w = 0; w < 8; w++) {
                    const int ql = 144 + 32 * (16 * half + w + 8 * (q % 2)), qh = 1168 + 32 * (8 * half + w);
                    const __m512i low = load_pair(pa + ql, pb + ql), high = load_pair(pa + qh, pb + qh);
                    const __m512i bits = q == 0   ? _mm512_slli_epi16(high, 4)
                                         : q == 1 ? _mm512_slli_epi16(high, 2)
                                         : q == 2 ? high
                                                  : _mm512_srli_epi16(high, 2);
                    const __m512i nibbles = q < 2 ? low : _mm512_srli_epi16(low, 4);
                    /* (nibbles & 0x0F) | (bits & 0x30) */
                    codes[w] = _mm512_ternarylogic_epi32(_mm512_and_si512(nibbles, nibble), bits, pair, 0xF8);
                }
                const __m512 first = _mm512_mul_ps(d, _mm512_cvtepi32_ps(bytes_pair(pa + 16 + 8 * s, pb + 16 + 8 * s, 1)));
                const __m512 second =
                    _mm512_mul_ps(d, _mm512_cvtepi32_ps(bytes_pair(pa + 16 + 8 * (s + 1), pb + 16 + 8 * (s + 1), 1)));
#pragma GCC unroll 8
                for (int m = 0; m < rows; m++) {
                    const int64_t xb = m * (x->k / 32) + 8 * i + 4 * half + q;
                    const int8_t *v = x->codes + 32 * xb;
                    __m512i lo = _mm512_set1_epi32(x->minus32[2 * xb]);
                    __m512i hi = _mm512_set1_epi32(x->minus32[2 * xb + 1]);
                    for (int w = 0; w < 4; w++) {
                        lo = dot_at(lo, codes[w], v + 4 * w);
                        hi = dot_at(hi, codes[4 + w], v + 16 + 4 * w);
                    }
                    const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), second,
                                                        _mm512_mul_ps(_mm512_cvtepi32_ps(lo), first));
                    acc[m] = _mm512_fmadd_ps(both, _mm512_set1_ps(x->scales[xb]), acc[m]);
                }
            }
    }
}

#define PAIR_TYPE_LIST(X) X(2, q4_0) X(8, q8_0) X(12, q4_k) X(13, q5_k) X(14, q6_k)

#else
#define INT8_PAIRS 0
#endif

#endif
