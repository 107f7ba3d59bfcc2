/* A few rows of x, rounded to int8, times a weight in GGUF blocks regrouped eight rows
   at a time: what llama.cpp computes for a decode step, and as fast, where a float32 x
   cannot be.

   With x in float32 (gguf_blocks.c), every weight is widened to a float and multiplied:
   on a CPU with AVX2 but not AVX-512 that is compute-bound at a third to a half of the
   memory's speed for 4- and 6-bit blocks. Rounded to int8 in blocks of 32 (a scale
   each, max |x| / 127, as ggml's Q8_0), x's codes multiply the weight's as bytes, 32 at
   a time (vpmaddubsw), into exact integer sums, widened to float once per x block.
   (ggml rounds x for the K-quants in blocks of 256, its Q8_K, so that a whole block's
   sum stays an integer; here the K-quants' float work a block grows by a few
   instructions, and their error is that of 32-value blocks.)

   Groups. Read in the file's layout, eight rows side by side are eight streams, and a
   register of one row's products must be summed across its lanes before it can be
   scaled. So at load the rows are regrouped, eight at a time, block by block: the
   eight rows' scales side by side (fp16, or Q4_K's and Q6_K's sub-block scales decoded
   to a byte each, sub-block by sub-block), then their codes interleaved four bytes at
   a time, so that one 32-byte load holds four codes of each of the eight rows and lane
   r of every product is row r's. x's four matching codes are broadcast to all lanes.
   Nothing is widened: a group holds the same codes and scales as the eight rows' blocks
   (``gguf_ungroup`` gives back the file's bytes exactly). A last group short of eight
   rows is filled with zero blocks.

   Group-blocks (eight rows' block b; words are 4 bytes, at 32 t + 4 r for row r):
     Q4_0 (2)   144 B: d[8] | 4 words of nibbles
     Q8_0 (8)   272 B: d[8] | 8 words of codes
     Q4_K (12) 1184 B: d[8] | dmin[8] | scale[8 sub-blocks][8] | min[8][8] | 32 words
     Q6_K (14) 1680 B: d[8] | scale[16 sub-blocks][8] (int8) | 32 words of ql | 16 of qh

   The result is the float32 product of the dequantized weight and x as rounded
   (``gguf_round_x`` gives that x), up to float32 rounding of each block's scaled sum;
   the integer sums are exact. Needs AVX2. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#if !defined(__AVX2__) || !defined(__F16C__) || !defined(__FMA__)
#error "gguf_int8.c needs AVX2, F16C and FMA"
#endif

#define GROUP 8      /* weight rows in a group */
#define X_BLOCK 32   /* values of x that share a scale */
#define MAX_X_ROWS 8 /* rows of x in one call */

int gguf_int8_type(int type) { return type == 2 || type == 8 || type == 12 || type == 14; }

static int64_t block_values(int type) { return type == 12 || type == 14 ? 256 : 32; }

static int64_t block_bytes(int type) {
    switch (type) {
    case 2: return 18;
    case 8: return 34;
    case 12: return 144;
    default: return 210;
    }
}

/* bytes of eight rows' block in a group */
int64_t gguf_group_block_bytes(int type) {
    switch (type) {
    case 2: return 144;
    case 8: return 272;
    case 12: return 1184;
    default: return 1680;
    }
}


/* -- x ---------------------------------------------------------------------------------- */

static inline float max8(__m256 v) {
    v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_cvtss_f32(_mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* x [k] -> codes [k] int8, scales [k / 32], the codes' sums in thirty-twos [k / 32]
   (Q4_0's offset codes, Q4_K's minimums), and for each sixteen codes Q6_K's offset:
   32 times the sums of codes 0, 1 and of codes 2, 3 of its four fours, as two int16
   (the two halves of a lane of a product's pair sums). k % 32 == 0. The codes are as
   one value at a time gives them: x / scale, rounded half to even, a zero block left
   zero. */
void gguf_round_x(const float *x, int64_t k, int8_t *codes, float *scales,
                  int32_t *offsets16, int32_t *sums32) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i limit = _mm256_set1_epi32(127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t c = 0; c < k; c += X_BLOCK) {
        __m256 largest = _mm256_setzero_ps();
        for (int64_t i = c; i < c + X_BLOCK; i += 8)
            largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
        const float d = max8(largest) / 127.0f;
        scales[c / X_BLOCK] = d;
        {
            __m256i q[4];
            for (int i = 0; i < 4; i++) {
                const __m256 part = _mm256_loadu_ps(x + c + 8 * i);
                const __m256 ratio =
                    d > 0.0f ? _mm256_div_ps(part, _mm256_set1_ps(d)) : _mm256_setzero_ps();
                const __m256i rounded = _mm256_cvtps_epi32(
                    _mm256_round_ps(ratio, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                q[i] = _mm256_max_epi32(_mm256_min_epi32(rounded, limit), _mm256_set1_epi32(-127));
            }
            /* int32 -> int8 packs within 128-bit lanes: put the eight 4-byte runs in order */
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
                order);
            _mm256_storeu_si256((__m256i *)(codes + c), bytes);
            /* pair sums, as int16; a 32-bit lane's two are codes 4i, 4i + 1 and 4i + 2,
               4i + 3; summed over four lanes, lane 0 is the first sixteen's, lane 4 the
               second's */
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes);
            __m256i halves16 = _mm256_add_epi16(pairs, _mm256_srli_si256(pairs, 8));
            halves16 = _mm256_add_epi16(halves16, _mm256_srli_si256(halves16, 4));
            halves16 = _mm256_slli_epi16(halves16, 5); /* at most 32 * 8 * 127 */
            offsets16[c / 16] = _mm256_cvtsi256_si32(halves16);
            offsets16[c / 16 + 1] = _mm256_extract_epi32(halves16, 4);
            __m256i s = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
            s = _mm256_hadd_epi32(s, s);
            s = _mm256_hadd_epi32(s, s);
            sums32[c / 32] = _mm256_cvtsi256_si32(s) + _mm256_extract_epi32(s, 4);
        }
    }
}

/* x [m, k] -> x as rounded [m, k] float32: each row's codes times their block's scale,
   what the kernel multiplies. A prefill's many rows are multiplied as floats against
   widened rows; rounded first, they take the values a decode step's would, so that a
   request's tokens do not depend on whether a long prompt shared its step. */
void gguf_round_rows(const float *x, int64_t m, int64_t k, float *out) {
    int8_t *codes = malloc((size_t)k);
    float *scales = malloc(sizeof(float) * (size_t)(k / X_BLOCK));
    int32_t *offsets16 = malloc(sizeof(int32_t) * (size_t)(k / 16));
    int32_t *sums32 = malloc(sizeof(int32_t) * (size_t)(k / 32));
    for (int64_t r = 0; r < m; r++) {
        gguf_round_x(x + r * k, k, codes, scales, offsets16, sums32);
        for (int64_t i = 0; i < k; i++) out[r * k + i] = (float)codes[i] * scales[i / X_BLOCK];
    }
    free(codes);
    free(scales);
    free(offsets16);
    free(sums32);
}

/* -- groups ----------------------------------------------------------------------------- */

/* Q4_K's 12 bytes of 6-bit scales and mins <-> a byte each. Sub-blocks 0-3 take the low
   6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 the nibbles of bytes 8-11
   (scale low, min high) with the top 2 bits of bytes 0-3 (scales) and 4-7 (mins). */
static void q4_k_decode(const uint8_t *q, uint8_t scale[8], uint8_t min[8]) {
    for (int j = 0; j < 4; j++) {
        scale[j] = q[j] & 63;
        min[j] = q[j + 4] & 63;
        scale[j + 4] = (q[j + 8] & 15) | ((q[j] >> 6) << 4);
        min[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

static void q4_k_encode(const uint8_t scale[8], const uint8_t min[8], uint8_t *q) {
    for (int j = 0; j < 4; j++) {
        q[j] = (uint8_t)(scale[j] | ((scale[j + 4] >> 4) << 6));
        q[j + 4] = (uint8_t)(min[j] | ((min[j + 4] >> 4) << 6));
        q[j + 8] = (uint8_t)((scale[j + 4] & 15) | ((min[j + 4] & 15) << 4));
    }
}

/* Row r's block ``block`` <-> its place in a group-block ``group``; ``to_group`` picks
   the direction, so the two can never disagree. */
static void move_block(int type, uint8_t *block, uint8_t *group, int r, int to_group) {
#define MOVE(block_at, group_at, size)                                                       \
    (to_group ? memcpy(group + (group_at), block + (block_at), size)                         \
              : memcpy(block + (block_at), group + (group_at), size))
    switch (type) {
    case 2:
    case 8: {
        MOVE(0, 2 * r, 2);
        const int words = type == 2 ? 4 : 8;
        for (int t = 0; t < words; t++) MOVE(2 + 4 * t, 16 + 32 * t + 4 * r, 4);
        break;
    }
    case 12: {
        MOVE(0, 2 * r, 2);
        MOVE(2, 16 + 2 * r, 2);
        uint8_t scale[8], min[8];
        if (to_group) {
            q4_k_decode(block + 4, scale, min);
            for (int j = 0; j < 8; j++) {
                group[32 + 8 * j + r] = scale[j];
                group[96 + 8 * j + r] = min[j];
            }
        } else {
            for (int j = 0; j < 8; j++) {
                scale[j] = group[32 + 8 * j + r];
                min[j] = group[96 + 8 * j + r];
            }
            q4_k_encode(scale, min, block + 4);
        }
        for (int t = 0; t < 32; t++) MOVE(16 + 4 * t, 160 + 32 * t + 4 * r, 4);
        break;
    }
    default: /* Q6_K: ql[128], qh[64], scales[16], d */
        MOVE(208, 2 * r, 2);
        for (int s = 0; s < 16; s++) MOVE(192 + s, 16 + 8 * s + r, 1);
        for (int t = 0; t < 32; t++) MOVE(4 * t, 144 + 32 * t + 4 * r, 4);
        for (int t = 0; t < 16; t++) MOVE(128 + 4 * t, 1168 + 32 * t + 4 * r, 4);
        break;
    }
#undef MOVE
}

/* rows [n, row_bytes] in the file's layout -> groups [ceil(n / 8), k / B * group-block] */
void gguf_group(int type, const uint8_t *rows, int64_t n, int64_t k, uint8_t *groups) {
    const int64_t blocks = k / block_values(type), bytes = block_bytes(type);
    const int64_t group_bytes = gguf_group_block_bytes(type), row_bytes = blocks * bytes;
    const int64_t count = (n + GROUP - 1) / GROUP;
    uint8_t zero[210] = {0};
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < count; g++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *group = groups + (g * blocks + b) * group_bytes;
            for (int r = 0; r < GROUP; r++) {
                const int64_t row = g * GROUP + r;
                const uint8_t *block = row < n ? rows + row * row_bytes + b * bytes : zero;
                move_block(type, (uint8_t *)block, group, r, 1);
            }
        }
}

/* groups of ``n`` rows -> the file's bytes of rows ``which`` [count], as [count,
   row_bytes]; -1 (and nothing written) where a row is not in 0..n-1 */
int gguf_ungroup(int type, const uint8_t *groups, int64_t n, int64_t k, const int64_t *which,
                 int64_t count, uint8_t *out) {
    const int64_t blocks = k / block_values(type), bytes = block_bytes(type);
    const int64_t group_bytes = gguf_group_block_bytes(type);
    for (int64_t i = 0; i < count; i++)
        if (which[i] < 0 || which[i] >= n) return -1;
#pragma omp parallel for schedule(static) if (count > 64)
    for (int64_t i = 0; i < count; i++) {
        const int64_t g = which[i] / GROUP;
        const int r = (int)(which[i] % GROUP);
        for (int64_t b = 0; b < blocks; b++)
            move_block(type, out + (i * blocks + b) * bytes,
                       (uint8_t *)groups + (g * blocks + b) * group_bytes, r, 0);
    }
    return 0;
}

/* -- products --------------------------------------------------------------------------- */

typedef struct {
    const int8_t *codes;   /* [rows][k] */
    const float *scales;   /* [rows][k / 32] */
    const int32_t *offsets16; /* [rows][k / 16], Q6_K's */
    const int32_t *sums32; /* [rows][k / 32] */
    int64_t k;
} rounded_x;

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* A thread reads its groups as one stream, which the hardware prefetcher follows too
   closely to keep the memory busy: each group-block asks for the lines of the one a
   few KB on into the L2. On the whole-model pass of a 100M Q4_0, Q4_K_M or Q8_0 file
   that took a fifth off (3 KB, the best of 1.5 to 12 KB ahead, about level beyond). */
#define AHEAD 3072
static inline __attribute__((always_inline)) void fetch_ahead(const uint8_t *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)(p + AHEAD + i), _MM_HINT_T1);
}

/* four bytes, in every lane */
static inline __m256i broadcast4(const int8_t *p) {
    int32_t word;
    memcpy(&word, p, 4);
    return _mm256_set1_epi32(word);
}

static inline __m256 halves(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* eight bytes (one per row), each as both int16 halves of its row's lane: multiplied
   in by vpmaddwd, a sub-block's pair sums come out scaled and summed */
static inline __m256i scale_pairs(const uint8_t *p, int is_signed) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    const __m128i twice = _mm_unpacklo_epi8(bytes, bytes);
    return is_signed ? _mm256_cvtepi8_epi16(twice) : _mm256_cvtepu8_epi16(twice);
}

static inline __m256i pairs_to_int32(__m256i pairs) {
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* A group's eight outputs for each of ``rows`` rows of x, into out[m][8]. Inlined with
   a constant ``rows`` (one, for the batch-1 step that matters most, else the count):
   the loops over x's rows then unroll and their accumulators live in registers. */

static inline __attribute__((always_inline)) void group_q4_0(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 144 * b;
        fetch_ahead(gb, 144);
        __m256i low[4], high[4];
        for (int t = 0; t < 4; t++) {
            const __m256i raw = load32(gb + 16 + 32 * t);
            low[t] = _mm256_and_si256(raw, nibble); /* values 4t .. 4t + 3 */
            high[t] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble); /* + 16 */
        }
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) {
            const int8_t *v = x->codes + m * x->k + 32 * b;
            /* eight pair sums of at most 2 * 15 * 127 each fit an int16 */
            __m256i pairs = _mm256_maddubs_epi16(low[0], broadcast4(v));
            for (int t = 1; t < 4; t++)
                pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(low[t], broadcast4(v + 4 * t)));
            for (int t = 0; t < 4; t++)
                pairs = _mm256_add_epi16(pairs,
                                         _mm256_maddubs_epi16(high[t], broadcast4(v + 16 + 4 * t)));
            /* codes 0..15 stand for -8..7 */
            const __m256i sum = _mm256_sub_epi32(
                pairs_to_int32(pairs), _mm256_set1_epi32(8 * x->sums32[m * (x->k / 32) + b]));
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->scales[m * (x->k / 32) + b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[m]);
        }
    }
}

static inline __attribute__((always_inline)) void group_q8_0(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 272 * b;
        fetch_ahead(gb, 272);
        __m256i sum[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) {
            const __m256i w = load32(gb + 16 + 32 * t);
            const __m256i magnitude = _mm256_sign_epi8(w, w); /* |w|, unsigned */
            for (int m = 0; m < rows; m++) {
                /* w's sign moved onto x; a pair sum of at most 2 * 128 * 127 */
                const __m256i v = _mm256_sign_epi8(broadcast4(x->codes + m * x->k + 32 * b + 4 * t), w);
                sum[m] = _mm256_add_epi32(sum[m],
                                          pairs_to_int32(_mm256_maddubs_epi16(magnitude, v)));
            }
        }
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) {
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x->scales[m * (x->k / 32) + b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), scale, acc[m]);
        }
    }
}

/* y = d * scale_j * code - dmin * min_j over sub-blocks j of 32, one x block each: a
   sub-block's integer sum times its scale is exact, then widened and scaled by x's. */
static inline __attribute__((always_inline)) void group_q4_k(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 1184 * b;
        fetch_ahead(gb, 1184);
        __m256 sum[MAX_X_ROWS], mins[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = mins[m] = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) { /* sub-block j: nibbles j % 2 of the words of 64s j / 2 */
            __m256i codes[8];
            for (int t = 0; t < 8; t++) {
                const __m256i raw = load32(gb + 160 + 32 * (8 * (j / 2) + t));
                codes[t] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, nibble);
            }
            const __m256i scale = scale_pairs(gb + 32 + 8 * j, 0);
            const __m256 min = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(gb + 96 + 8 * j))));
            for (int m = 0; m < rows; m++) {
                const int64_t xb = m * (x->k / 32) + 8 * b + j;
                const int8_t *v = x->codes + 32 * xb;
                __m256i pairs = _mm256_maddubs_epi16(codes[0], broadcast4(v));
                for (int t = 1; t < 8; t++) /* at most 8 * 2 * 15 * 127 */
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(codes[t], broadcast4(v + 4 * t)));
                const __m256 xd = _mm256_set1_ps(x->scales[xb]);
                sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scale)), xd, sum[m]);
                /* the minimums multiply the rounded x's sum over the sub-block */
                mins[m] = _mm256_fmadd_ps(min, _mm256_set1_ps(x->scales[xb] * (float)x->sums32[xb]), mins[m]);
            }
        }
        const __m256 d = halves(gb), dmin = halves(gb + 16);
        for (int m = 0; m < rows; m++)
            acc[m] = _mm256_fnmadd_ps(mins[m], dmin, _mm256_fmadd_ps(sum[m], d, acc[m]));
    }
}

/* y = d * scale_s * (code - 32) over sub-blocks s of 16, two to an x block. In each
   half of 128 values, value 32 q + l (quarter q, l < 32) takes a nibble of ql byte l
   (q 0, 2) or l + 32 (q 1, 3), low for q < 2, and bits 2q, 2q + 1 of qh byte l. */
static inline __attribute__((always_inline)) void group_q6_k(const uint8_t *group,
                                                             int64_t blocks,
                                                             const rounded_x *x, int rows,
                                                             __m256 *acc) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x30);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *gb = group + 1680 * b;
        fetch_ahead(gb, 1680);
        __m256 sum[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = _mm256_setzero_ps();
        for (int half = 0; half < 2; half++)
            for (int q = 0; q < 4; q++) { /* x block 4 half + q: sub-blocks s, s + 1 */
                const int s = 8 * half + 2 * q;
                __m256i exact[MAX_X_ROWS];
                for (int m = 0; m < rows; m++) exact[m] = _mm256_setzero_si256();
                for (int part = 0; part < 2; part++) { /* l = 16 part .. 16 part + 15 */
                    __m256i codes[4];
                    for (int u = 0; u < 4; u++) {
                        const int word = 4 * part + u; /* l = 4 word .. 4 word + 3 */
                        const __m256i ql =
                            load32(gb + 144 + 32 * (16 * half + word + 8 * (q % 2)));
                        const __m256i qh = load32(gb + 1168 + 32 * (8 * half + word));
                        const __m256i low = q < 2 ? ql : _mm256_srli_epi16(ql, 4);
                        const __m256i high = q == 0   ? _mm256_slli_epi16(qh, 4)
                                             : q == 1 ? _mm256_slli_epi16(qh, 2)
                                             : q == 2 ? qh
                                                      : _mm256_srli_epi16(qh, 2);
                        codes[u] = _mm256_or_si256(_mm256_and_si256(low, nibble),
                                                   _mm256_and_si256(high, pair));
                    }
                    const __m256i scale = scale_pairs(gb + 16 + 8 * (s + part), 1);
                    for (int m = 0; m < rows; m++) {
                        const int64_t at = m * x->k + 256 * b + 128 * half + 32 * q + 16 * part;
                        const int8_t *v = x->codes + at;
                        /* four pair sums of up to 2 * 63 * 127 each wrap an int16, but
                           with 32 * x's taken off (codes 0..63 stand for -32..31) what is
                           left, at most 4 * 2 * 32 * 127, fits: the wrapping cancels */
                        __m256i pairs = _mm256_maddubs_epi16(codes[0], broadcast4(v));
                        for (int u = 1; u < 4; u++)
                            pairs = _mm256_add_epi16(pairs,
                                                     _mm256_maddubs_epi16(codes[u], broadcast4(v + 4 * u)));
                        pairs = _mm256_sub_epi16(pairs, _mm256_set1_epi32(x->offsets16[at / 16]));
                        exact[m] = _mm256_add_epi32(exact[m], _mm256_madd_epi16(pairs, scale));
                    }
                }
                for (int m = 0; m < rows; m++) {
                    const __m256 xd = _mm256_set1_ps(x->scales[m * (x->k / 32) + 8 * b + 4 * half + q]);
                    sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact[m]), xd, sum[m]);
                }
            }
        const __m256 d = halves(gb);
        for (int m = 0; m < rows; m++) acc[m] = _mm256_fmadd_ps(sum[m], d, acc[m]);
    }
}

static void group_rows(int type, const uint8_t *group, int64_t blocks, const rounded_x *x,
                       int rows, __m256 *acc) {
#define FOR_ROWS(kernel)                                                                      \
    (rows == 1 ? kernel(group, blocks, x, 1, acc) : kernel(group, blocks, x, rows, acc))
    switch (type) {
    case 2: FOR_ROWS(group_q4_0); break;
    case 8: FOR_ROWS(group_q8_0); break;
    case 12: FOR_ROWS(group_q4_k); break;
    default: FOR_ROWS(group_q6_k); break;
    }
#undef FOR_ROWS
}

/* y [m, n] = round(x) [m, k] @ W^T (+ bias), W's n rows in ``groups`` of type ``type``
   (one of gguf_int8_type's), ``group_bytes`` apart; m <= 8 (the arguments are
   gguf_linear's). */
void gguf_linear_int8(int type, const float *x, int64_t m, int64_t k, const uint8_t *groups,
                      int64_t n, int64_t group_bytes, const float *bias, float *y,
                      int threads) {
    int8_t *codes = malloc((size_t)(m * k));
    float *scales = malloc(sizeof(float) * (size_t)(m * k / X_BLOCK));
    int32_t *offsets16 = malloc(sizeof(int32_t) * (size_t)(m * k / 16));
    int32_t *sums32 = malloc(sizeof(int32_t) * (size_t)(m * k / 32));
    for (int64_t r = 0; r < m; r++)
        gguf_round_x(x + r * k, k, codes + r * k, scales + r * (k / X_BLOCK),
                     offsets16 + r * (k / 16), sums32 + r * (k / 32));
    const rounded_x rounded = {codes, scales, offsets16, sums32, k};
    const int64_t blocks = k / block_values(type);
    const int64_t count = (n + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < count; g++) {
        __m256 acc[MAX_X_ROWS];
        group_rows(type, groups + g * group_bytes, blocks, &rounded, (int)m, acc);
        const int64_t valid = n - GROUP * g < GROUP ? n - GROUP * g : GROUP;
        for (int64_t r = 0; r < m; r++) {
            float out[GROUP];
            _mm256_storeu_ps(out, acc[r]);
            for (int64_t i = 0; i < valid; i++)
                y[r * n + GROUP * g + i] = out[i] + (bias ? bias[GROUP * g + i] : 0.0f);
        }
    }
    free(codes);
    free(scales);
    free(offsets16);
    free(sums32);
}
