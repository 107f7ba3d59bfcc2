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

   Each block type is a header of its own (int8_types.h lists them): its group-block
   layout, the move between a file block and a group-block, and its kernel.

   The result is the float32 product of the dequantized weight and x as rounded
   (``gguf_round_x`` gives that x), up to float32 rounding of each block's scaled sum;
   the integer sums are exact. Needs AVX2. */

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_simd.h"
#if !INT8_SIMD
#error "gguf_int8.c needs AVX2, F16C and FMA"
#endif

#define GROUP 8      /* weight rows in a group */
#define X_BLOCK 32   /* values of x that share a scale */
#define MAX_X_ROWS 8 /* rows of x in one call */

/* x as the kernels take it: rows of codes and, per block, what the types need of them */
typedef struct {
    const int8_t *codes;      /* [rows][k] */
    const float *scales;      /* [rows][k / 32] */
    const int32_t *offsets16; /* [rows][k / 16], Q6_K's (int8_q6_k.h) */
    const int32_t *sums32;    /* [rows][k / 32]: sums of the codes */
    const int32_t *sums16;    /* [rows][k / 16]: sums of the codes */
    int64_t k;
} rounded_x;

#include "int8_types.h"

#define IS_TYPE(code, name, values, bytes, group) case code: return 1;
int gguf_int8_type(int type) {
    switch (type) { INT8_TYPE_LIST(IS_TYPE) default: return 0; }
}
#define VALUES(code, name, values, bytes, group) case code: return values;
static int64_t block_values(int type) {
    switch (type) { INT8_TYPE_LIST(VALUES) default: return 0; }
}
#define BYTES(code, name, values, bytes, group) case code: return bytes;
static int64_t block_bytes(int type) {
    switch (type) { INT8_TYPE_LIST(BYTES) default: return 0; }
}
/* bytes of eight rows' block in a group */
#define GROUP_BYTES(code, name, values, bytes, group) case code: return group;
int64_t gguf_group_block_bytes(int type) {
    switch (type) { INT8_TYPE_LIST(GROUP_BYTES) default: return 0; }
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
                  int32_t *offsets16, int32_t *sums32, int32_t *sums16) {
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
            sums16[c / 16] = _mm256_cvtsi256_si32(s);
            sums16[c / 16 + 1] = _mm256_extract_epi32(s, 4);
            sums32[c / 32] = sums16[c / 16] + sums16[c / 16 + 1];
        }
    }
}

/* m rows of x rounded, in one allocation (``buffer``, for ``free``) */
typedef struct {
    rounded_x x;
    void *buffer;
} rounded_rows;

/* over ``threads`` threads where there are more rows than a decode step's */
static rounded_rows round_rows(const float *x, int64_t m, int64_t k, int threads) {
    const size_t blocks = (size_t)(m * (k / X_BLOCK));
    char *buffer = malloc(sizeof(float) * blocks + sizeof(int32_t) * 5 * blocks + (size_t)(m * k));
    float *scales = (float *)buffer;
    int32_t *offsets16 = (int32_t *)(scales + blocks), *sums32 = offsets16 + 2 * blocks;
    int32_t *sums16 = sums32 + blocks;
    int8_t *codes = (int8_t *)(sums16 + 2 * blocks);
#pragma omp parallel for schedule(static) num_threads(threads) if (m > MAX_X_ROWS)
    for (int64_t r = 0; r < m; r++)
        gguf_round_x(x + r * k, k, codes + r * k, scales + r * (k / X_BLOCK),
                     offsets16 + r * (k / 16), sums32 + r * (k / 32), sums16 + r * (k / 16));
    return (rounded_rows){{codes, scales, offsets16, sums32, sums16, k}, buffer};
}

/* x [m, k] -> x as rounded [m, k] float32: each row's codes times their block's scale,
   what the kernel multiplies. */
void gguf_round_rows(const float *x, int64_t m, int64_t k, float *out) {
    rounded_rows rounded = round_rows(x, m, k, 1);
    for (int64_t i = 0; i < m * k; i++)
        out[i] = (float)rounded.x.codes[i] * rounded.x.scales[i / X_BLOCK];
    free(rounded.buffer);
}

/* -- groups ----------------------------------------------------------------------------- */

/* Row r's block ``block`` <-> its place in a group-block ``group`` */
static void move_block(int type, uint8_t *block, uint8_t *group, int r, int to_group) {
#define MOVE(code, name, values, bytes, group_bytes)                                        \
    case code: move_##name(block, group, r, to_group); break;
    switch (type) { INT8_TYPE_LIST(MOVE) default: break; }
#undef MOVE
}

/* rows [n, row_bytes] in the file's layout -> groups [ceil(n / 8), k / B * group-block] */
void gguf_group(int type, const uint8_t *rows, int64_t n, int64_t k, uint8_t *groups) {
    const int64_t blocks = k / block_values(type), bytes = block_bytes(type);
    const int64_t group_bytes = gguf_group_block_bytes(type), row_bytes = blocks * bytes;
    const int64_t count = (n + GROUP - 1) / GROUP;
    uint8_t zero[256] = {0}; /* the largest file block */
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


/* A group's eight outputs for each of ``rows`` rows of x, into out[m][8]. Inlined with
   a constant ``rows`` (one, for the batch-1 step that matters most, else the count):
   the loops over x's rows then unroll and their accumulators live in registers. */

static void group_rows(int type, const uint8_t *group, int64_t blocks, const rounded_x *x,
                       int rows, __m256 *acc) {
#define FOR_ROWS(code, name, values, bytes, group_bytes)                                    \
    case code:                                                                              \
        if (rows == 1)                                                                      \
            group_##name(group, blocks, x, 1, acc);                                         \
        else                                                                                \
            group_##name(group, blocks, x, rows, acc);                                      \
        break;
    switch (type) { INT8_TYPE_LIST(FOR_ROWS) default: break; }
#undef FOR_ROWS
}

/* y [m, n] = round(x) [m, k] @ W^T (+ bias), W's n rows in ``groups`` of type ``type``
   (one of gguf_int8_type's), ``group_bytes`` apart; m <= 8 (the arguments are
   gguf_linear's). */
void gguf_linear_int8(int type, const float *x, int64_t m, int64_t k, const uint8_t *groups,
                      int64_t n, int64_t group_bytes, const float *bias, float *y,
                      int threads) {
    rounded_rows rows = round_rows(x, m, k, threads);
    const rounded_x rounded = rows.x;
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
    free(rows.buffer);
}

/* -- many rows of x --------------------------------------------------------------------- */

/* Rows of x a group's kernel takes at once, and groups a thread's x tiles pass over in
   turn before it moves on (see gguf_gemm_int8). On a Zen 4 core, 256 rows of x times
   1024 x 4096, 768 x 2048 and 2048 x 768 weights, tiles of 8 rows ran as fast as of 4
   for Q4_0 and Q4_K and 5-10% faster for Q6_K and Q8_0 (with AVX-512's registers and
   with AVX2's alike); chunks of 2 to 8 groups ran alike, 5-10% faster than of 1. */
#define TILE_ROWS 8
#define CHUNK_GROUPS 4

/* One group's outputs for ``rows`` (1..TILE_ROWS) rows of x (+ bias) into y's ``valid``
   columns from ``y`` on, its rows ``n`` apart: group_rows with a whole tile's row count
   a constant, so that its loops unroll. */
static void group_into(int type, const uint8_t *group, int64_t blocks, const rounded_x *x,
                       int rows, const float *bias, float *y, int64_t n, int64_t valid) {
    __m256 acc[MAX_X_ROWS];
#define FOR_TILE(code, name, values, bytes, group_bytes)                                    \
    case code:                                                                              \
        if (rows == TILE_ROWS)                                                              \
            group_##name(group, blocks, x, TILE_ROWS, acc);                                 \
        else                                                                                \
            group_##name(group, blocks, x, rows, acc);                                      \
        break;
    switch (type) { INT8_TYPE_LIST(FOR_TILE) default: return; }
#undef FOR_TILE
    for (int r = 0; r < rows; r++) {
        float out[GROUP];
        _mm256_storeu_ps(out, acc[r]);
        for (int64_t i = 0; i < valid; i++) y[r * n + i] = out[i] + (bias ? bias[i] : 0.0f);
    }
}

/* x's rows from ``first`` on */
static rounded_x rows_from(const rounded_x *x, int64_t first) {
    const int64_t k = x->k;
    return (rounded_x){x->codes + first * k,       x->scales + first * (k / 32),
                       x->offsets16 + first * (k / 16), x->sums32 + first * (k / 32),
                       x->sums16 + first * (k / 16), k};
}

/* y [m, n] = round(x) [m, k] @ W^T (+ bias) for any number of rows m, with the
   arguments of gguf_linear_int8 and the same result row for row: x is rounded once (a
   row per thread), then each thread takes its share of the groups, CHUNK_GROUPS at a
   time, and passes every tile of TILE_ROWS rows of x over them, so that the chunk's
   groups are read from memory once and stay in the core's caches while x's tiles
   stream past. ``threads`` 0: as many as the caller's OpenMP setting holds when it
   runs (torch's thread count, which the engine lowers while other processes keep
   cores busy), so that a call bound once in a captured graph follows it. */
void gguf_gemm_int8(int type, const float *x, int64_t m, int64_t k, const uint8_t *groups,
                    int64_t n, int64_t group_bytes, const float *bias, float *y, int threads) {
    if (threads <= 0) threads = omp_get_max_threads();
    rounded_rows rows = round_rows(x, m, k, threads);
    const rounded_x rounded = rows.x;
    const int64_t blocks = k / block_values(type);
    const int64_t count = (n + GROUP - 1) / GROUP;
    /* smaller chunks where the groups are few, so that every thread has several */
    int64_t chunk = CHUNK_GROUPS;
    while (chunk > 1 && count < 4 * chunk * threads) chunk /= 2;
    const int64_t chunks = (count + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t last = count < (c + 1) * chunk ? count : (c + 1) * chunk;
        for (int64_t first = 0; first < m; first += TILE_ROWS) {
            const int tile = (int)(m - first < TILE_ROWS ? m - first : TILE_ROWS);
            const rounded_x part = rows_from(&rounded, first);
            for (int64_t g = c * chunk; g < last; g++) {
                const int64_t valid = n - GROUP * g < GROUP ? n - GROUP * g : GROUP;
                group_into(type, groups + g * group_bytes, blocks, &part, tile,
                           bias ? bias + GROUP * g : NULL, y + first * n + GROUP * g, n, valid);
            }
        }
    }
    free(rows.buffer);
}
