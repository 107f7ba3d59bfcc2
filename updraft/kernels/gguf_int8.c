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

/* the largest of v's eight lanes, in every lane */
static inline __m256 max8(__m256 v) {
    v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
}

static inline float sum8(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

/* x [k] -> codes [k] int8, scales [k / 32], sums4 [k / 4] (each 4 codes' sum, for the
   blocks whose codes are offset) and float sums [k / 32] of x itself. k % 32 == 0.
   Eight lanes at a time: each step of a decode rounds x before every linear, and one
   value at a time that was a twentieth of a small layer's product. The codes are as
   one value at a time gives them: IEEE division, then rounding half to even. */
void gguf_round_x(const float *x, int64_t k, int8_t *codes, float *scales, int32_t *sums4,
                  float *sums) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i limit = _mm256_set1_epi32(127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < k / X_BLOCK; b++) {
        const float *v = x + b * X_BLOCK;
        __m256 part[4];
        for (int i = 0; i < 4; i++) part[i] = _mm256_loadu_ps(v + 8 * i);
        const __m256 largest = max8(_mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, part[0]), _mm256_andnot_ps(sign, part[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, part[2]), _mm256_andnot_ps(sign, part[3]))));
        const float d = _mm256_cvtss_f32(largest) / 127.0f;
        scales[b] = d;
        sums[b] = sum8(_mm256_add_ps(_mm256_add_ps(part[0], part[1]),
                                     _mm256_add_ps(part[2], part[3])));
        __m256i q[4];
        for (int i = 0; i < 4; i++) {
            /* a zero block stays zero (and is not divided by 0) */
            const __m256 ratio =
                d > 0.0f ? _mm256_div_ps(part[i], _mm256_set1_ps(d)) : _mm256_setzero_ps();
            const __m256i rounded = _mm256_cvtps_epi32(
                _mm256_round_ps(ratio, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            q[i] = _mm256_max_epi32(_mm256_min_epi32(rounded, limit), _mm256_set1_epi32(-127));
        }
        /* int32 -> int8 packs within 128-bit lanes: put the eight 4-byte runs in order */
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
            order);
        _mm256_storeu_si256((__m256i *)(codes + b * X_BLOCK), bytes);
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes);
        _mm256_storeu_si256((__m256i *)(sums4 + b * X_BLOCK / 4),
                            _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
}

/* unsigned bytes times signed bytes -> 8 int32 lanes, each the sum of 4 products */
static inline __m256i dot_bytes(__m256i unsigned_codes, __m256i signed_codes) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_codes, signed_codes),
                             _mm256_set1_epi16(1));
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

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

/* 32 six-bit codes (0..63, standing for -32..31) times x block ``xb``, each half of 16
   times its own int8 scale, as 8 lanes. The byte products' pair sums (int16) have x's
   pair sums times 32 taken off, and are then summed in pairs weighted by the scales
   (vpmaddwd with the scales where plain pair sums take ones): every sum stays exact,
   and one multiply by d times x's scale is left per block. ``scales``: the block's 16
   scales; ``pick`` takes the two of this part, each 8 times. */
static inline __m256 q6_k_part(__m256i codes, const rounded_x *x, int64_t xb, float d,
                               __m128i scales, __m128i pick) {
    const __m256i v = load32(x->codes + X_BLOCK * xb);
    const __m256i pairs = _mm256_sub_epi16(_mm256_maddubs_epi16(codes, v),
                                           _mm256_maddubs_epi16(_mm256_set1_epi8(32), v));
    const __m256i sum =
        _mm256_madd_epi16(pairs, _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * x->scales[xb]));
}

/* byte ``2 * part`` eight times, then byte ``2 * part + 1`` eight times */
static inline __m128i q6_k_pick(int part) {
    return _mm_unpacklo_epi64(_mm_set1_epi8((char)(2 * part)), _mm_set1_epi8((char)(2 * part + 1)));
}

static float row_q6_k(const uint8_t *row, const rounded_x *x, int64_t blocks) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x30);
    __m128i pick[8];
    for (int part = 0; part < 8; part++) pick[part] = q6_k_pick(part);
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + 210 * b;
        const __m128i scales = _mm_loadu_si128((const __m128i *)(block + 192));
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
            const __m128i *p = pick + 4 * half;
            even = _mm256_add_ps(even, q6_k_part(codes[0], x, first, d, scales, p[0]));
            odd = _mm256_add_ps(odd, q6_k_part(codes[1], x, first + 1, d, scales, p[1]));
            even = _mm256_add_ps(even, q6_k_part(codes[2], x, first + 2, d, scales, p[2]));
            odd = _mm256_add_ps(odd, q6_k_part(codes[3], x, first + 3, d, scales, p[3]));
        }
    }
    return sum8(_mm256_add_ps(even, odd));
}

/* Eight rows at once (Q4_0, Q8_0, and each 32 values of a Q6_K block). One row's block
   product is 8 int32 lanes; widening and scaling them one row at a time (a convert, a
   scalar fp16 scale, a broadcast, a multiply-add) costs as much as the byte products
   themselves. For eight rows the lanes are summed across (``lanes_of``), so that lane r
   holds row r's block sum: then one convert, one vector of the eight rows' fp16 scales
   and one multiply-add serve all eight, and x's codes are loaded once for them.

   Eight rows read side by side are eight short streams, too short for the hardware
   prefetcher to follow: the next eight rows are fetched ahead, a few lines a block
   (``ahead``). */

/* The cache lines of the eight rows after these, spread over the blocks of a pass.
   Both helpers must be inlined (as the kernels that call them are): left to the
   compiler, Q4_0's eight-row pass ran 1.6x slower. */
typedef struct {
    const uint8_t *next;
    int64_t lines, per_block;
} ahead;

static inline __attribute__((always_inline)) ahead ahead_of(const uint8_t *rows,
                                                              int64_t row_bytes,
                                                              int64_t blocks) {
    const int64_t lines = (8 * row_bytes + 63) / 64;
    return (ahead){rows + 8 * row_bytes, lines, (lines + blocks - 1) / blocks};
}

/* block ``b``'s share of the lines */
static inline __attribute__((always_inline)) void fetch_ahead(ahead a, int64_t b) {
    for (int64_t l = b * a.per_block; l < (b + 1) * a.per_block && l < a.lines; l++)
        _mm_prefetch((const char *)(a.next + 64 * l), _MM_HINT_T0);
}

/* s[r]'s eight lanes summed, as lane r */
static inline __m256i lanes_of(const __m256i s[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]),
                                        _mm256_hadd_epi32(s[2], s[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]),
                                        _mm256_hadd_epi32(s[6], s[7]));
    /* a: rows 0-3 over lanes 0-3, then rows 0-3 over lanes 4-7; b: rows 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

static inline int half_bits(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return bits;
}

/* the fp16 scales at the start of eight rows' block ``offset`` bytes in, inserted into
   a register: stored to memory and loaded as one, they made every block wait out a
   failed store forwarding (about a tenth of Q4_0's eight-row pass) */
static inline __m256 scales_of(const uint8_t *rows, int64_t row_bytes, int64_t offset) {
    const uint8_t *p = rows + offset;
    __m128i h = _mm_insert_epi16(_mm_setzero_si128(), half_bits(p), 0);
    h = _mm_insert_epi16(h, half_bits(p + row_bytes), 1);
    h = _mm_insert_epi16(h, half_bits(p + 2 * row_bytes), 2);
    h = _mm_insert_epi16(h, half_bits(p + 3 * row_bytes), 3);
    h = _mm_insert_epi16(h, half_bits(p + 4 * row_bytes), 4);
    h = _mm_insert_epi16(h, half_bits(p + 5 * row_bytes), 5);
    h = _mm_insert_epi16(h, half_bits(p + 6 * row_bytes), 6);
    h = _mm_insert_epi16(h, half_bits(p + 7 * row_bytes), 7);
    return _mm256_cvtph_ps(h);
}

/* y[0..7] = eight rows from ``rows`` times x; Q4_0 (``bytes`` 18) or Q8_0 (34) */
static inline __attribute__((always_inline)) void eight_rows_of_32s(
    int type, const uint8_t *rows, int64_t row_bytes, const rounded_x *x,
    const int32_t *block_sums, int64_t blocks, float *y) {
    const int64_t bytes = type == 2 ? 18 : 34;
    const ahead next = ahead_of(rows, row_bytes, blocks);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        fetch_ahead(next, b);
        const __m256i v = load32(x->codes + X_BLOCK * b);
        __m256i s[8];
        for (int r = 0; r < 8; r++) {
            const uint8_t *block = rows + r * row_bytes + bytes * b;
            if (type == 2) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(block + 2));
                const __m256i w = _mm256_and_si256(
                    _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
                s[r] = dot_bytes(w, v);
            } else {
                const __m256i w = load32(block + 2);
                s[r] = dot_bytes(_mm256_sign_epi8(w, w), _mm256_sign_epi8(v, w));
            }
        }
        __m256i sum = lanes_of(s);
        if (type == 2) /* codes 0..15 stand for -8..7 */
            sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * block_sums[b]));
        const __m256 scale =
            _mm256_mul_ps(scales_of(rows, row_bytes, bytes * b), _mm256_set1_ps(x->scales[b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc);
    }
    _mm256_storeu_ps(y, acc);
}

static void eight_rows_q4_0(const uint8_t *rows, int64_t row_bytes, const rounded_x *x,
                            const int32_t *block_sums, int64_t blocks, float *y) {
    eight_rows_of_32s(2, rows, row_bytes, x, block_sums, blocks, y);
}

static void eight_rows_q8_0(const uint8_t *rows, int64_t row_bytes, const rounded_x *x,
                            const int32_t *block_sums, int64_t blocks, float *y) {
    eight_rows_of_32s(8, rows, row_bytes, x, block_sums, blocks, y);
}

/* Q6_K, eight rows: part ``part`` (0-3) of half ``half`` of block ``b`` of each row,
   summed across as for Q4_0, then scaled by the rows' d times x's scale. */
static inline __attribute__((always_inline)) __m256 q6_k_eight_part(
    const uint8_t *rows, int64_t row_bytes, const rounded_x *x, int64_t b, int half, int part,
    __m128i pick, __m256 d, __m256 acc) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x30);
    const int64_t xb = 8 * b + 4 * half + part;
    const __m256i v = load32(x->codes + X_BLOCK * xb);
    const __m256i offset = _mm256_maddubs_epi16(_mm256_set1_epi8(32), v);
    __m256i s[8];
    for (int r = 0; r < 8; r++) {
        const uint8_t *block = rows + r * row_bytes + 210 * b;
        const __m256i l = load32(block + 64 * half + 32 * (part & 1));
        const __m256i h = load32(block + 128 + 32 * half);
        const __m256i low = part < 2 ? l : _mm256_srli_epi16(l, 4);
        const __m256i high = part == 0   ? _mm256_slli_epi16(h, 4)
                             : part == 1 ? _mm256_slli_epi16(h, 2)
                             : part == 2 ? h
                                         : _mm256_srli_epi16(h, 2);
        const __m256i codes =
            _mm256_or_si256(_mm256_and_si256(low, nibble), _mm256_and_si256(high, pair));
        const __m128i scales = _mm_loadu_si128((const __m128i *)(block + 192));
        s[r] = _mm256_madd_epi16(
            _mm256_sub_epi16(_mm256_maddubs_epi16(codes, v), offset),
            _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick)));
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes_of(s)),
                           _mm256_mul_ps(d, _mm256_set1_ps(x->scales[xb])), acc);
}

static void eight_rows_q6_k(const uint8_t *rows, int64_t row_bytes, const rounded_x *x,
                            int64_t blocks, float *y) {
    const ahead next = ahead_of(rows, row_bytes, blocks);
    __m128i pick[8];
    for (int part = 0; part < 8; part++) pick[part] = q6_k_pick(part);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        fetch_ahead(next, b);
        const __m256 d = scales_of(rows, row_bytes, 210 * b + 208);
        for (int half = 0; half < 2; half++) {
            acc = q6_k_eight_part(rows, row_bytes, x, b, half, 0, pick[4 * half], d, acc);
            acc = q6_k_eight_part(rows, row_bytes, x, b, half, 1, pick[4 * half + 1], d, acc);
            acc = q6_k_eight_part(rows, row_bytes, x, b, half, 2, pick[4 * half + 2], d, acc);
            acc = q6_k_eight_part(rows, row_bytes, x, b, half, 3, pick[4 * half + 3], d, acc);
        }
    }
    _mm256_storeu_ps(y, acc);
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
    int32_t *block_sums = malloc(sizeof(int32_t) * (k / X_BLOCK));
    gguf_round_x(x, k, codes, scales, sums4, scales + k / X_BLOCK);
    for (int64_t b = 0; b < k / X_BLOCK; b++) {
        int32_t total = 0;
        for (int i = 0; i < X_BLOCK / 4; i++) total += sums4[b * X_BLOCK / 4 + i];
        block_sums[b] = total;
    }
    const rounded_x rounded = {codes, scales, sums4, scales + k / X_BLOCK};
    const int64_t values = type == 12 || type == 14 ? 256 : 32;
    const int64_t blocks = k / values;
    /* Q4_0, Q8_0 and Q6_K go eight rows at a time; the rest of their rows, and Q4_K,
       one at a time */
    const int64_t grouped = type == 2 || type == 8 || type == 14 ? n / 8 * 8 : 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < grouped / 8; g++) {
            const uint8_t *rows = w + 8 * g * row_bytes;
            if (type == 2)
                eight_rows_q4_0(rows, row_bytes, &rounded, block_sums, blocks, y + 8 * g);
            else if (type == 14)
                eight_rows_q6_k(rows, row_bytes, &rounded, blocks, y + 8 * g);
            else
                eight_rows_q8_0(rows, row_bytes, &rounded, block_sums, blocks, y + 8 * g);
        }
#pragma omp for schedule(static)
        for (int64_t o = grouped; o < n; o++) {
            const uint8_t *row = w + o * row_bytes;
            switch (type) {
            case 2: y[o] = row_q4_0(row, &rounded, blocks); break;
            case 8: y[o] = row_q8_0(row, &rounded, blocks); break;
            case 12: y[o] = row_q4_k(row, &rounded, blocks); break;
            default: y[o] = row_q6_k(row, &rounded, blocks); break;
            }
        }
    }
    if (bias)
        for (int64_t o = 0; o < n; o++) y[o] += bias[o];
    free(codes);
    free(scales);
    free(sums4);
    free(block_sums);
}
