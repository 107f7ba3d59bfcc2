/* Decode kernels for AVX2 without VNNI: one row of x times a group, for a batch-1
   decode step's linears, where int8_decode.h's 512-bit kernels cannot run.

   The eight-row kernels (group_rows) serve one row of x too, but pay for rows they do
   not have: a call per group through the row-count switch, outputs copied out of an
   array lane by lane, x's terms multiplied out per block. On a Zen 3 core the 4-bit
   K-quants are bound by the core's work, not by memory (a decode pass of the 500M
   model's Q4_K linears read 16 GB/s on one core, a plain read 22). These take one row:
   * each word of a Q4_K or Q5_K block's codes is loaded once for both sub-blocks it
     holds (low and high nibbles), where the eight-row kernel loads it per sub-block;
   * Q5_K's fifth bits are loaded once a block and shifted into place per sub-block;
   * Q6_K loads each word of ql and qh once for the four codes it makes, where the
     eight-row kernel loads qh once per quarter;
   * Q4_0 takes -8 sum(x) from the rounded x's terms, built once per call;
   * the group's eight outputs come back in one register.

   The integer sums are the eight-row kernels' (vpmaddubsw pair sums added as int16
   within the same bounds, widened by vpmaddwd) and scaled in the same order, so the
   result is theirs bit for bit. The weights are the same groups. ROW_TYPE_LIST names
   the types that have one. */
#ifndef UPDRAFT_INT8_DECODE_AVX2_H
#define UPDRAFT_INT8_DECODE_AVX2_H

#if INT8_SIMD && !INT8_VNNI
#define INT8_ROW_AVX2 1

/* Q4_0: 32 values a block; x's codes 0..15 and 16..31 meet a word's low and high
   nibbles, four words each (pair sums at most 8 * 2 * 15 * 127 in all) */
static inline __m256 row_q4_0(const uint8_t *group, int64_t blocks, const rounded_x *x) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 144 * b;
        const int8_t *v = x->codes + 32 * b;
        fetch_ahead(gb, 144);
        __m256i pairs = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
            const __m256i raw = load32(gb + 16 + 32 * t);
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(_mm256_and_si256(raw, nibble), broadcast4(v + 4 * t)));
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(high, broadcast4(v + 16 + 4 * t)));
        }
        const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), _mm256_set1_epi32(x->minus8[b]));
        const __m256 scale = _mm256_mul_ps(halves(gb), _mm256_set1_ps(x->scales[b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc);
    }
    return acc;
}

/* sub-block j of a Q4_K or Q5_K group-block: its pair sums (``parts`` int16 sums of
   its eight words: two where eight could overflow) times its scales, exact in int32,
   scaled by x's block into ``sums``; its minimums times x's scaled sum into ``mins`` */
static inline __attribute__((always_inline)) void add_row_sub_block(const __m256i pairs[2],
                                                                    int parts, const uint8_t *gb,
                                                                    int j, int64_t xb,
                                                                    const rounded_x *x,
                                                                    __m256 *sums,
                                                                    __m256 *mins) {
    const __m256i scale = scale_pairs(gb + 32 + 8 * j, 0);
    __m256i exact = _mm256_madd_epi16(pairs[0], scale);
    if (parts == 2) exact = _mm256_add_epi32(exact, _mm256_madd_epi16(pairs[1], scale));
    const float xd = x->scales[xb];
    *sums = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(xd), *sums);
    const __m256 min = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(gb + 96 + 8 * j))));
    *mins = _mm256_fmadd_ps(min, _mm256_set1_ps(xd * (float)x->sums32[xb]), *mins);
}

/* acc + d * sums - dmin * mins, a Q4_K/Q5_K block's part */
static inline __attribute__((always_inline)) __m256 add_row_k_block(__m256 acc, const uint8_t *gb,
                                                                    __m256 sums, __m256 mins) {
    return _mm256_fnmadd_ps(mins, halves(gb + 16), _mm256_fmadd_ps(sums, halves(gb), acc));
}

/* Q4_K and Q5_K: 64s c holds sub-blocks 2c (low nibbles) and 2c + 1 (high); ``five``
   (Q5_K): the fifth bit of sub-block j is bit j of the qh words' bytes. */
static inline __attribute__((always_inline)) __m256 row_k(const uint8_t *group, int64_t blocks,
                                                          const rounded_x *x, int block_bytes,
                                                          int codes_at, int five) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + block_bytes * b;
        fetch_ahead(gb, block_bytes);
        __m256 sums = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
        #pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const int8_t *v = x->codes + 256 * b + 64 * c;
            /* [sub-block 2c + h][half]: with a fifth bit, four words' pair sums of at
               most 2 * 31 * 127 each; without, all eight fit one int16 */
            __m256i pairs[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()},
                                   {_mm256_setzero_si256(), _mm256_setzero_si256()}};
            for (int t = 0; t < 8; t++) {
                const __m256i raw = load32(gb + codes_at + 32 * (8 * c + t));
                __m256i low = _mm256_and_si256(raw, nibble);
                __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
                if (five) {
                    const __m256i qh = load32(gb + 160 + 32 * t);
                    low = _mm256_or_si256(low, q5_k_fifth(qh, 2 * c));
                    high = _mm256_or_si256(high, q5_k_fifth(qh, 2 * c + 1));
                }
                const int half = five ? t / 4 : 0;
                pairs[0][half] = _mm256_add_epi16(pairs[0][half], _mm256_maddubs_epi16(low, broadcast4(v + 4 * t)));
                pairs[1][half] = _mm256_add_epi16(pairs[1][half], _mm256_maddubs_epi16(high, broadcast4(v + 32 + 4 * t)));
                KEEP_BOTH_IN_REGISTERS(pairs[0][half], pairs[1][half]);
            }
            add_row_sub_block(pairs[0], 1 + five, gb, 2 * c, 8 * b + 2 * c, x, &sums, &mins);
            add_row_sub_block(pairs[1], 1 + five, gb, 2 * c + 1, 8 * b + 2 * c + 1, x, &sums, &mins);
        }
        acc = add_row_k_block(acc, gb, sums, mins);
    }
    return acc;
}

static inline __m256 row_q4_k(const uint8_t *group, int64_t blocks, const rounded_x *x) {
    return row_k(group, blocks, x, 1184, 160, 0);
}

static inline __m256 row_q5_k(const uint8_t *group, int64_t blocks, const rounded_x *x) {
    return row_k(group, blocks, x, 1440, 416, 1);
}

/* Q6_K: in half h, word w (values 4w..4w+3 of each quarter q, w < 8) of ql's first 32
   bytes, its second 32 and qh make the four quarters' codes: q 0 and 2 the low and high
   nibbles of the first, q 1 and 3 of the second, with qh's bits 2q, 2q + 1 as bits 4
   and 5. Pair sums per sixteen (four words), less 32 x's (int8_q6_k.h's wrapping
   bound), times the sixteen's scales. */
static inline __m256 row_q6_k(const uint8_t *group, int64_t blocks, const rounded_x *x) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 1680 * b;
        fetch_ahead(gb, 1680);
        __m256 sum = _mm256_setzero_ps();
        for (int half = 0; half < 2; half++) {
            const int8_t *v = x->codes + 256 * b + 128 * half;
            __m256i exact[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(),
                                _mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int part = 0; part < 2; part++) {
                __m256i pairs[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(),
                                    _mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int w = 4 * part; w < 4 * part + 4; w++) {
                    const __m256i first = load32(gb + 144 + 32 * (16 * half + w));
                    const __m256i second = load32(gb + 144 + 32 * (16 * half + 8 + w));
                    const __m256i qh = load32(gb + 1168 + 32 * (8 * half + w));
                    __m256i codes[4];
                    for (int q = 0; q < 4; q++) codes[q] = q6_k_quarter(q % 2 ? second : first, qh, q);
                    for (int q = 0; q < 4; q++)
                        pairs[q] = _mm256_add_epi16(pairs[q], _mm256_maddubs_epi16(codes[q], broadcast4(v + 32 * q + 4 * w)));
                }
                for (int q = 0; q < 4; q++) {
                    const int64_t sixteen = (256 * b + 128 * half + 32 * q + 16 * part) / 16;
                    const __m256i scale = scale_pairs(gb + 16 + 8 * (8 * half + 2 * q + part), 1);
                    const __m256i offset = _mm256_set1_epi32(x->offsets16[sixteen]);
                    exact[q] = _mm256_add_epi32(exact[q], _mm256_madd_epi16(_mm256_sub_epi16(pairs[q], offset), scale));
                }
            }
            for (int q = 0; q < 4; q++)
                sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact[q]), _mm256_set1_ps(x->scales[8 * b + 4 * half + q]), sum);
        }
        acc = _mm256_fmadd_ps(sum, halves(gb), acc);
    }
    return acc;
}

#define ROW_TYPE_LIST(X) X(2, q4_0) X(12, q4_k) X(13, q5_k) X(14, q6_k)

#else
#define INT8_ROW_AVX2 0
#endif

#endif
