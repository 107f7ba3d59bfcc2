/* Decode kernels: one row of x times a group, two halves of its blocks at once, on
   AVX-512 with VNNI, for a batch-1 decode step's linears.

   A decode step reads each weight once, from memory, for one row of x. The eight-row
   kernels (a group-block in a 256-bit register) spend as many instructions again as
   their byte products on x's broadcasts, float scaling and unpacking codes. These fill
   a 512-bit register with two parts of one group that lie close together (lanes 0-7
   one part's eight rows, 8-15 the other's), so each instruction does twice the work:
   Q4_0 and Q8_0 two neighbouring group-blocks, Q4_K and Q5_K a block's 64s c and c + 1,
   Q6_K a block's two halves of 128 values. A group is read front to back: one stream,
   which the core's own prefetcher follows. Two groups side by side (int8_prefill.h's
   pairs) are two streams a group apart: a plain read in that order reached 17-19 GB/s
   on one core where one stream reached 23-26, and fetching ahead in software did not
   close it. Within a K-quant block the two parts are read side by side, 256 to 512
   bytes apart, which the core's prefetcher follows poorly (Q6_K 5-7 GB/s, Q4_K and
   Q5_K at k = 4096 half of the eight-row kernels' speed), so those fetch 16 KB ahead
   in software; Q4_0's and Q8_0's parts are neighbours, and fetching ahead made them
   slower.

   x comes as x_pairs, built once per call: for each pair of x blocks (u, u + S) that
   meet in a register (S: the type's stride), the codes word by word (u's and u + S's,
   spread to lanes 0-7 and 8-15 as they are used), and their scales and sums' terms. Where a group's blocks are
   odd (Q4_0, Q8_0), the last is read twice with the second half of x zero.

   Where one row of x allows, less per byte:
   * Q4_0's high nibbles are kept in place (code times 16) instead of shifted down, and
     the block's sum is taken 16 times over (the low nibbles' sum shifted up, exact in
     int32 and in float32), the factor taken off once at the end;
   * Q4_K's and Q5_K's sub-block scales multiply the integer sums (vpmulld), and the
     block's d and dmin multiply once per 256 values, not per sub-block;
   * each word of codes is loaded once per block, for every sub-block that takes a part
     of it.

   The result is the eight-row kernels' up to float32 rounding: the same integer sums,
   scaled per 32 values of x, the two halves added at the end. The weights are the same
   groups: nothing is packed twice. DECODE_TYPE_LIST names the types that have one. */
#ifndef UPDRAFT_INT8_DECODE_H
#define UPDRAFT_INT8_DECODE_H

/* also VL and DQ: 256-bit masked loads and stores, and a register's upper half */
#if INT8_PAIRS && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define INT8_DECODE 1

/* One row of x as the decode kernels take it, per pair p of x blocks (u, u + S) */
typedef struct {
    const int32_t *codes;     /* [pairs][8][2]: word w (codes 4w..4w+3) of u, of u + S */
    const __m512 *scales;     /* [pairs] */
    const __m512i *minus128;  /* [pairs]: -128 x's sum (Q4_0's and Q8_0's offsets) */
    const __m512i *minus32;   /* [pairs][2]: -32 x's sums of 16 (Q6_K's) */
    const __m512 *scaled_sums; /* [pairs]: scale times sum (a minimum's factor) */
} x_pairs;

/* How far ahead the K-quants fetch: from memory, Q6_K read 20-25% slower at 4 KB than
   at 16 KB, and 8 KB ran as 16 */
#define DECODE_AHEAD 16384

/* ``bytes`` of the group from ``p`` + DECODE_AHEAD on, into L2 */
static inline __attribute__((always_inline)) void fetch_group(const uint8_t *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64)
        _mm_prefetch((const char *)(p + DECODE_AHEAD + i), _MM_HINT_T1);
}

/* x pair p's word t: u's in lanes 0-7, u + S's in 8-15 (two broadcasts, the second
   merged: x's codes stay 8 bytes a word, where 64 would overflow L1 at k = 4096) */
static inline __attribute__((always_inline)) __m512i x_word(const x_pairs *x, int64_t p, int t) {
    const int32_t *word = x->codes + 16 * p + 2 * t;
    return _mm512_mask_set1_epi32(_mm512_set1_epi32(word[0]), 0xFF00, word[1]);
}

/* the 8 outputs of a group: lane r and lane 8 + r are row r's two halves */
static inline __m256 fold_halves(__m512 acc) {
    return _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
}

static inline __m256 decode_q4_0(const uint8_t *group, int64_t blocks, const x_pairs *x) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t q = 0; q < (blocks + 1) / 2; q++) {
        const uint8_t *pa = group + 288 * q, *pb = 2 * q + 1 < blocks ? pa + 144 : pa;
        /* 16 (code - 8) = 16 low + (high nibble in place) - 128: -128 sum(x) starts it */
        __m512i low = _mm512_setzero_si512(), high = x->minus128[q];
        for (int t = 0; t < 4; t++) {
            const __m512i raw = load_pair(pa + 16 + 32 * t, pb + 16 + 32 * t);
            low = _mm512_dpbusd_epi32(low, _mm512_and_si512(raw, nibble), x_word(x, q, t));
            high = _mm512_dpbusd_epi32(high, _mm512_andnot_si512(nibble, raw), x_word(x, q, 4 + t));
        }
        /* at most 16 * 32 * 15 * 127 + 128 * 32 * 127: exact as a float */
        const __m512i sum16 = _mm512_add_epi32(_mm512_slli_epi32(low, 4), high);
        const __m512 scale = _mm512_mul_ps(halves_pair(pa, pb), x->scales[q]);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum16), scale, acc);
    }
    return fold_halves(_mm512_mul_ps(acc, _mm512_set1_ps(1.0f / 16.0f))); /* exact */
}

static inline __m256 decode_q8_0(const uint8_t *group, int64_t blocks, const x_pairs *x) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t q = 0; q < (blocks + 1) / 2; q++) {
        const uint8_t *pa = group + 544 * q, *pb = 2 * q + 1 < blocks ? pa + 272 : pa;
        /* code + 128, unsigned; -128 sum(x) starts the sums */
        __m512i even = x->minus128[q], odd = _mm512_setzero_si512();
        for (int t = 0; t < 8; t += 2) {
            const __m512i first = _mm512_xor_si512(load_pair(pa + 16 + 32 * t, pb + 16 + 32 * t), flip);
            const __m512i second = _mm512_xor_si512(load_pair(pa + 48 + 32 * t, pb + 48 + 32 * t), flip);
            even = _mm512_dpbusd_epi32(even, first, x_word(x, q, t));
            odd = _mm512_dpbusd_epi32(odd, second, x_word(x, q, t + 1));
        }
        const __m512 scale = _mm512_mul_ps(halves_pair(pa, pb), x->scales[q]);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even, odd)), scale, acc);
    }
    return fold_halves(acc);
}

/* Q4_K and Q5_K: sub-block j's codes (codes[8]) times x pair p, times its eight scales
   per block in int32 (exact: at most 32 * 31 * 127 * 63, under 2^24), into ``sums``
   scaled by x's; the minimums times x's scaled sums into ``mins`` */
static inline __attribute__((always_inline)) void add_k_decode(const __m512i codes[8],
                                                               const uint8_t *pa,
                                                               const uint8_t *pb, int j,
                                                               const x_pairs *x, int64_t p,
                                                               __m512 *sums, __m512 *mins) {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int t = 0; t < 8; t += 2) {
        even = _mm512_dpbusd_epi32(even, codes[t], x_word(x, p, t));
        odd = _mm512_dpbusd_epi32(odd, codes[t + 1], x_word(x, p, t + 1));
    }
    const __m512i scale = bytes_pair(pa + 32 + 8 * j, pb + 32 + 8 * j, 0);
    const __m512i exact = _mm512_mullo_epi32(_mm512_add_epi32(even, odd), scale);
    *sums = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), x->scales[p], *sums);
    const __m512 min = _mm512_cvtepi32_ps(bytes_pair(pa + 96 + 8 * j, pb + 96 + 8 * j, 0));
    *mins = _mm512_fmadd_ps(min, x->scaled_sums[p], *mins);
}

/* acc + d * sums - dmin * mins: a Q4_K/Q5_K group-block pair's part */
static inline __attribute__((always_inline)) __m512 add_k_block(__m512 acc, const uint8_t *pa,
                                                                const uint8_t *pb, __m512 sums,
                                                                __m512 mins) {
    acc = _mm512_fmadd_ps(sums, halves_pair(pa, pb), acc);
    return _mm512_fnmadd_ps(mins, halves_pair(pa + 16, pb + 16), acc);
}

/* Q4_K and Q5_K pair the halves of one block: lanes 0-7 its 64s c (sub-blocks 2c, 2c +
   1), lanes 8-15 its 64s c + 1 (2c + 2, 2c + 3), read front to back; a sub-block's
   scales and minimums are 16 bytes after its pair's, d and dmin the block's for both. */
static inline __m256 decode_q4_k(const uint8_t *group, int64_t blocks, const x_pairs *x) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = group + 1184 * i;
        __m512 sums = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
        for (int c = 0; c < 4; c += 2) {
            fetch_group(pa + 296 * c, 592);
            __m512i low[8], high[8];
            for (int t = 0; t < 8; t++) {
                const int at = 160 + 32 * (8 * c + t);
                const __m512i raw = load_pair(pa + at, pa + at + 256);
                low[t] = _mm512_and_si512(raw, nibble);
                high[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
            }
            add_k_decode(low, pa, pa + 16, 2 * c, x, 4 * i + c, &sums, &mins);
            add_k_decode(high, pa, pa + 16, 2 * c + 1, x, 4 * i + c + 1, &sums, &mins);
        }
        acc = add_k_block(acc, pa, pa, sums, mins);
    }
    return fold_halves(acc);
}

static inline __m256 decode_q5_k(const uint8_t *group, int64_t blocks, const x_pairs *x) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    /* qh's bits j (lanes 0-7) and j + 2 (8-15) to bit 4, for j = 0, 1 (left) and 4, 5
       (right) */
    const __m512i halves = _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000, 2);
    const __m512i left[2] = {_mm512_sub_epi16(_mm512_set1_epi16(4), halves),
                             _mm512_sub_epi16(_mm512_set1_epi16(3), halves)};
    const __m512i right[2] = {halves, _mm512_add_epi16(_mm512_set1_epi16(1), halves)};
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = group + 1440 * i;
        __m512 sums = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
        for (int c = 0; c < 4; c += 2) {
            fetch_group(pa + 360 * c, 720);
            __m512i low[8], high[8];
            for (int t = 0; t < 8; t++) {
                const __m512i qh = load_pair(pa + 160 + 32 * t, pa + 160 + 32 * t);
                const int at = 416 + 32 * (8 * c + t);
                const __m512i raw = load_pair(pa + at, pa + at + 256);
                const __m512i bit_low = c == 0 ? _mm512_sllv_epi16(qh, left[0]) : _mm512_srlv_epi16(qh, right[0]);
                const __m512i bit_high = c == 0 ? _mm512_sllv_epi16(qh, left[1]) : _mm512_srlv_epi16(qh, right[1]);
                /* (nibble & 0x0F) | (bit & 0x10) */
                low[t] = _mm512_ternarylogic_epi32(_mm512_and_si512(raw, nibble), bit_low, fifth, 0xF8);
                high[t] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble),
                                                    bit_high, fifth, 0xF8);
            }
            add_k_decode(low, pa, pa + 16, 2 * c, x, 4 * i + c, &sums, &mins);
            add_k_decode(high, pa, pa + 16, 2 * c + 1, x, 4 * i + c + 1, &sums, &mins);
        }
        acc = add_k_block(acc, pa, pa, sums, mins);
    }
    return fold_halves(acc);
}

/* Q6_K pairs the halves of one block (128 values each: lanes 0-7 the first, 8-15 the
   second). In a half, quarter q's codes take a nibble of ql words (q % 2) * 8 .. + 7
   (the second half's 512 bytes on) and two bits of qh's 8 words (256 bytes on). Per x
   block (quarter q), two sub-blocks of 16 with int8 scales (the second half's 64 bytes
   on): each sub-block's sum (codes 0..63, x's -32 sums16 to start) times its scale in
   int32, exact. */
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

static inline __m256 decode_q6_k(const uint8_t *group, int64_t blocks, const x_pairs *x) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *pa = group + 1680 * i;
        __m512i qh[8];
        for (int w = 0; w < 8; w++) qh[w] = load_pair(pa + 1168 + 32 * w, pa + 1424 + 32 * w);
        __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) { /* x pair 4 i + q: sub-blocks 2q, 2q + 1 of each half */
            const int64_t p = 4 * i + q;
            fetch_group(pa + 420 * q, 420);
            __m512i lo = x->minus32[2 * p], hi = x->minus32[2 * p + 1];
            for (int w = 0; w < 4; w++) {
                const int ql = 144 + 32 * (w + 8 * (q % 2));
                lo = _mm512_dpbusd_epi32(lo, q6_k_codes(load_pair(pa + ql, pa + ql + 512), qh[w], q), x_word(x, p, w));
                hi = _mm512_dpbusd_epi32(
                    hi, q6_k_codes(load_pair(pa + ql + 128, pa + ql + 640), qh[4 + w], q), x_word(x, p, 4 + w));
            }
            const __m512i first = bytes_pair(pa + 16 + 16 * q, pa + 80 + 16 * q, 1);
            const __m512i second = bytes_pair(pa + 24 + 16 * q, pa + 88 + 16 * q, 1);
            const __m512i exact = _mm512_add_epi32(_mm512_mullo_epi32(lo, first),
                                                   _mm512_mullo_epi32(hi, second));
            sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), x->scales[p], sum);
        }
        acc = _mm512_fmadd_ps(sum, halves_pair(pa, pa), acc);
    }
    return fold_halves(acc);
}

/* X(type code, name, S: x blocks u and u + S meet in a register's halves) */
#define DECODE_TYPE_LIST(X) X(2, q4_0, 1) X(8, q8_0, 1) X(12, q4_k, 2) X(13, q5_k, 2) X(14, q6_k, 4)

/* x_pairs of one row of x of ``x_blocks`` blocks (its rounded_x, prefill terms
   included): pair p holds x blocks u = 2 S (p / S) + p % S and u + S (S: ``stride``;
   zero past the end), into ``buffer`` (64-byte aligned, x_pairs_bytes of it) */
static inline int64_t x_pairs_count(int64_t x_blocks, int stride) {
    return (x_blocks + 2 * stride - 1) / (2 * stride) * stride;
}
static inline size_t x_pairs_bytes(int64_t x_blocks, int stride) {
    return (size_t)x_pairs_count(x_blocks, stride) * 64 * (1 + 1 + 1 + 2 + 1);
}
static x_pairs build_x_pairs(const rounded_x *x, int64_t x_blocks, int stride, void *buffer) {
    const int64_t pairs = x_pairs_count(x_blocks, stride);
    __m512i *minus128 = buffer, *minus32 = minus128 + pairs;
    __m512 *scales = (__m512 *)(minus32 + 2 * pairs), *scaled_sums = scales + pairs;
    int32_t *codes = (int32_t *)(scaled_sums + pairs);
    const __mmask16 high = 0xFF00;
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t u = 2 * stride * (p / stride) + p % stride, w = u + stride;
        const int both = w < x_blocks; /* else the second half stays zero */
        for (int t = 0; t < 8; t++) {
            int32_t first, second = 0;
            memcpy(&first, x->codes + 32 * u + 4 * t, 4);
            if (both) memcpy(&second, x->codes + 32 * w + 4 * t, 4);
            codes[16 * p + 2 * t] = first;
            codes[16 * p + 2 * t + 1] = second;
        }
        minus128[p] = _mm512_mask_set1_epi32(_mm512_set1_epi32(x->minus128[u]), high,
                                             both ? x->minus128[w] : 0);
        for (int s = 0; s < 2; s++)
            minus32[2 * p + s] = _mm512_mask_set1_epi32(_mm512_set1_epi32(x->minus32[2 * u + s]),
                                                        high, both ? x->minus32[2 * w + s] : 0);
        scales[p] = _mm512_mask_blend_ps(high, _mm512_set1_ps(x->scales[u]),
                                         _mm512_set1_ps(both ? x->scales[w] : 0.0f));
        scaled_sums[p] = _mm512_mask_blend_ps(high, _mm512_set1_ps(x->scaled_sums[u]),
                                              _mm512_set1_ps(both ? x->scaled_sums[w] : 0.0f));
    }
    return (x_pairs){codes, scales, minus128, minus32, scaled_sums};
}

#else
#define INT8_DECODE 0
#endif

#endif
