/* A few rows of x, rounded to int8, times a weight in GGUF blocks regrouped eight rows
   at a time: what llama.cpp computes for a decode step, and as fast, where a float32 x
   cannot be.

   With x in float32 (gguf_blocks.c), every weight is widened to a float and multiplied:
   on a CPU with AVX2 but not AVX-512 that is compute-bound at a third to a half of the
   memory's speed for 4- and 6-bit blocks. Rounded to int8 in blocks of 32 (a scale
   each, max |x| / 127, as ggml's Q8_0), x's codes multiply the weight's as bytes, 32 at
   a time, into exact integer sums, widened to float once per x block. The byte products
   are the build's (int8_simd.h): vpdpbusd where the CPU has VNNI (AVX512-VNNI or
   AVX-VNNI), four products added into an int32 in one instruction; with AVX2 alone,
   vpmaddubsw's pair sums added as int16 and widened once per sub-block. (ggml rounds x
   for the K-quants in blocks of 256, its Q8_K, so that a whole block's sum stays an
   integer; here the K-quants' float work a block grows by a few instructions, and their
   error is that of 32-value blocks.)

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

   Prefill. Where the CPU has AVX-512 with VNNI, a prefill's tiles over Q4_0, Q8_0,
   Q4_K, Q5_K and Q6_K groups run int8_prefill.h's kernels: two groups in one 512-bit
   register, over the same groups and the same rounded x, so a prefill's row is a
   decode step's product up to float32 rounding. With AVX2 alone, a prefill over Q4_0,
   Q8_0, Q4_K, Q5_K and Q6_K runs int8_unpacked.h's kernels: each group's codes built
   once, then every row of x over them.

   Decode. Where the CPU has AVX-512 with VNNI, one row of x (a batch-1 decode step)
   over Q4_0, Q8_0, Q4_K, Q5_K and Q6_K groups runs int8_decode.h's kernels: two nearby
   parts of one group in one 512-bit register, the group read front to back as one
   stream, over the same groups and the same rounded x. With AVX2 alone, Q4_0, Q4_K,
   Q5_K and Q6_K run int8_decode_avx2.h's, the eight-row kernels' sums for one row
   without the work of the rows that are not there.

   Each block type is a header of its own (int8_types.h lists them): its group-block
   layout, the move between a file block and a group-block, its kernel, and its unpack_,
   row r of a group-block as integer codes and a float32 scale and minimum per 16 values.

   The result is the float32 product of the dequantized weight and x as rounded
   (``gguf_round_x`` gives that x), up to float32 rounding of each block's scaled sum;
   the integer sums are exact. Without AVX2, F16C and FMA (a build for plain x86-64, or
   another CPU) the same product comes from portable C: x rounded to the same codes, and
   one kernel for every type over its unpack_, integer sums per 16 values scaled in
   float. It is some thirty times slower than the SIMD kernels (3 ms against 0.1 for a
   1024 x 4096 Q4_K weight and one row of x, one thread); ``gguf_int8_simd`` says which
   a build has. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_simd.h"

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
    /* what the prefill kernels (int8_prefill.h) start or end a block's sums with */
    const int32_t *minus8;    /* [rows][k / 32]: -8 sums32 (Q4_0's codes 0..15 for -8..7) */
    const int32_t *minus128;  /* [rows][k / 32]: -128 sums32 (Q8_0's codes flipped) */
    const int32_t *minus32;   /* [rows][k / 16]: -32 sums16 (Q6_K's codes 0..63 for -32..31) */
    const float *scaled_sums; /* [rows][k / 32]: scales * sums32, what a minimum multiplies */
    int64_t k;
} rounded_x;

#include "int8_types.h"
#include "int8_prefill.h"
#include "int8_decode.h"
#include "int8_decode_avx2.h"
#include "int8_unpacked.h"

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

/* 2: this build multiplies bytes with VNNI, 1: with AVX2, 0: in portable C */
int gguf_int8_simd(void) { return INT8_SIMD ? 1 + INT8_VNNI : 0; }

/* row r of a group-block of ``type``: codes [values], scale and min [values / 16], each
   value scale[i / 16] * codes[i] + min[i / 16] exactly (the portable kernel's view, and
   the tests', through gguf_int8_unpack) */
static void unpack_block(int type, const uint8_t *group, int r, int8_t *codes, float *scale,
                         float *min) {
#define UNPACK(code, name, values, bytes, group_bytes)                                      \
    case code: unpack_##name(group, r, codes, scale, min); break;
    switch (type) { INT8_TYPE_LIST(UNPACK) default: break; }
#undef UNPACK
}
void gguf_int8_unpack(int type, const uint8_t *group, int r, int8_t *codes, float *scale,
                      float *min) {
    unpack_block(type, group, r, codes, scale, min);
}

/* -- x ---------------------------------------------------------------------------------- */

/* A block of 32 codes' sums: per 16 and per 32, and Q6_K's offsets16 for the AVX2
   kernel: 32 times the sums of codes 4i, 4i + 1 and of codes 4i + 2, 4i + 3 over a 16's
   four fours, as the two int16 halves of an int32 (the halves of a lane of vpmaddubsw's
   pair sums; at most 32 * 8 * 127 each). */
static void sum_block(const int8_t *codes, int32_t *offsets16, int32_t *sums32,
                      int32_t *sums16) {
    for (int h = 0; h < 2; h++) {
        int32_t first = 0, second = 0;
        for (int i = 16 * h; i < 16 * h + 16; i += 4) {
            first += codes[i] + codes[i + 1];
            second += codes[i + 2] + codes[i + 3];
        }
        sums16[h] = first + second;
        offsets16[h] = (int32_t)((uint32_t)(uint16_t)(32 * first) | ((uint32_t)(uint16_t)(32 * second) << 16));
    }
    sums32[0] = sums16[0] + sums16[1];
}

/* ggml's rounding of x to Q8_0 (its SIMD form): scale max |x| / 127, each code x times
   127 / max |x|, rounded half to even and clamped to +-127; a zero block stays zero. A
   multiplication, not a division by the scale: a vector division the compiler may turn
   into an approximate reciprocal (-ffast-math), which would give another code near a
   half. The portable loop below computes the same products, so every build's codes are
   the same. */
static inline float code_factor(float largest) { return largest > 0.0f ? 127.0f / largest : 0.0f; }

#if INT8_SIMD
static inline float max8(__m256 v) {
    v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_cvtss_f32(_mm256_max_ps(v, _mm256_shuffle_ps(v, v, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* 32 values of x -> their codes; returns max |x| */
static float round_block(const float *x, int8_t *codes) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i limit = _mm256_set1_epi32(127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 largest = _mm256_setzero_ps();
    for (int i = 0; i < X_BLOCK; i += 8)
        largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    const float top = max8(largest);
    const __m256 factor = _mm256_set1_ps(code_factor(top));
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        const __m256 ratio = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), factor);
        const __m256i rounded = _mm256_cvtps_epi32(
            _mm256_round_ps(ratio, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        q[i] = _mm256_max_epi32(_mm256_min_epi32(rounded, limit), _mm256_set1_epi32(-127));
    }
    /* int32 -> int8 packs within 128-bit lanes: put the eight 4-byte runs in order */
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    _mm256_storeu_si256((__m256i *)codes, bytes);
    return top;
}
#else
static float round_block(const float *x, int8_t *codes) {
    float top = 0.0f;
    for (int i = 0; i < X_BLOCK; i++) top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    const float factor = code_factor(top);
    for (int i = 0; i < X_BLOCK; i++) {
        const long rounded = lrintf(x[i] * factor); /* half to even, as vroundps */
        codes[i] = (int8_t)(rounded > 127 ? 127 : rounded < -127 ? -127 : rounded);
    }
    return top;
}
#endif

/* x [k] -> codes [k] int8, scales [k / 32], and the codes' sums (sum_block) in
   thirty-twos [k / 32] (Q4_0's offset codes, Q4_K's minimums), sixteens [k / 16] and
   Q6_K's offsets16 [k / 16]. k % 32 == 0. */
void gguf_round_x(const float *x, int64_t k, int8_t *codes, float *scales,
                  int32_t *offsets16, int32_t *sums32, int32_t *sums16) {
    for (int64_t c = 0; c < k; c += X_BLOCK) {
        scales[c / X_BLOCK] = round_block(x + c, codes + c) / 127.0f;
        sum_block(codes + c, offsets16 + c / 16, sums32 + c / 32, sums16 + c / 16);
    }
}

/* m rows of x rounded, in one allocation (``buffer``, for ``free``) */
typedef struct {
    rounded_x x;
    void *buffer;
} rounded_rows;

/* the prefill kernels' terms (rounded_x's minus8 .. scaled_sums) of one row's blocks */
static void block_terms(const float *scales, const int32_t *sums32, const int32_t *sums16,
                        int64_t k, int32_t *minus8, int32_t *minus128, int32_t *minus32,
                        float *scaled_sums) {
    for (int64_t b = 0; b < k / 32; b++) {
        minus8[b] = -8 * sums32[b];
        minus128[b] = -128 * sums32[b];
        scaled_sums[b] = scales[b] * (float)sums32[b];
    }
    for (int64_t s = 0; s < k / 16; s++) minus32[s] = -32 * sums16[s];
}

/* over ``threads`` threads where there are more rows than a decode step's; ``terms``:
   the prefill kernels' terms too (a decode step's kernels read none of them) */
static rounded_rows round_rows(const float *x, int64_t m, int64_t k, int threads, int terms) {
    const size_t blocks = (size_t)(m * (k / X_BLOCK));
    /* per block: a scale and scaled sum, 9 int32 (offsets16, sums16, minus32 two each) */
    char *buffer = malloc(sizeof(float) * 2 * blocks + sizeof(int32_t) * 9 * blocks + (size_t)(m * k));
    float *scales = (float *)buffer, *scaled_sums = scales + blocks;
    int32_t *offsets16 = (int32_t *)(scaled_sums + blocks), *sums32 = offsets16 + 2 * blocks;
    int32_t *sums16 = sums32 + blocks, *minus8 = sums16 + 2 * blocks, *minus128 = minus8 + blocks;
    int32_t *minus32 = minus128 + blocks;
    int8_t *codes = (int8_t *)(minus32 + 2 * blocks);
#pragma omp parallel for schedule(static) num_threads(threads) if (m > MAX_X_ROWS)
    for (int64_t r = 0; r < m; r++) {
        const int64_t at32 = r * (k / 32), at16 = r * (k / 16);
        gguf_round_x(x + r * k, k, codes + r * k, scales + at32, offsets16 + at16, sums32 + at32,
                     sums16 + at16);
        if (terms)
            block_terms(scales + at32, sums32 + at32, sums16 + at16, k, minus8 + at32,
                        minus128 + at32, minus32 + at16, scaled_sums + at32);
    }
    return (rounded_rows){{codes, scales, offsets16, sums32, sums16, minus8, minus128, minus32,
                           scaled_sums, k},
                          buffer};
}

/* x [m, k] -> x as rounded [m, k] float32: each row's codes times their block's scale,
   what the kernel multiplies. */
void gguf_round_rows(const float *x, int64_t m, int64_t k, float *out) {
    rounded_rows rounded = round_rows(x, m, k, 1, 0);
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

/* x's rows from ``first`` on, as a rounded_x of their own */
static rounded_x rows_from(const rounded_x *x, int64_t first) {
    const int64_t k = x->k;
    const int64_t at32 = first * (k / 32), at16 = first * (k / 16);
    return (rounded_x){x->codes + first * k, x->scales + at32, x->offsets16 + at16,
                       x->sums32 + at32, x->sums16 + at16, x->minus8 + at32,
                       x->minus128 + at32, x->minus32 + at16, x->scaled_sums + at32, k};
}

#if INT8_SIMD

/* A group's eight outputs for each of ``rows`` rows of x, into out[m] (lane r: row r).
   Each kernel is inlined with a constant row count (4, 2 or 1; other counts are summed
   of them; 8 for Q4_K, Q5_K and Q6_K without VNNI, eight_rows): its loops over x's rows then
   unroll and their accumulators stay in registers. With a variable count they were kept
   in memory, and 8 rows cost 15 times one; a constant 8 spilled. A group is read once
   per part, from L1 after the first. */
#if !INT8_VNNI
/* The K-quants build each word's codes (nibbles; Q5_K's fifth bits, Q6_K's qh pairs from
   a second and third load): without VNNI, a whole tile of 8 rows of x in one kernel,
   spilling, shares that work by 8 and ran 6-13% faster than 4 + 4 on a Zen 3 (Q4_K,
   Q5_K, Q6_K). A function of its own: inside group_rows' body its eight accumulators
   slowed the other types' tiles by a tenth. */
static __attribute__((noinline)) int eight_rows(int type, const uint8_t *group, int64_t blocks,
                                                const rounded_x *x, float out[][GROUP]) {
    __m256 acc[8];
    if (type == 12)
        group_q4_k(group, blocks, x, 8, acc);
    else if (type == 13)
        group_q5_k(group, blocks, x, 8, acc);
    else if (type == 14)
        group_q6_k(group, blocks, x, 8, acc);
    else
        return 0;
    for (int m = 0; m < 8; m++) _mm256_storeu_ps(out[m], acc[m]);
    return 1;
}
#endif

static void group_rows(int type, const uint8_t *group, int64_t blocks, const rounded_x *x,
                       int rows, float out[][GROUP]) {
#if !INT8_VNNI
    if (rows == 8 && eight_rows(type, group, blocks, x, out)) return;
#endif
    __m256 acc[MAX_X_ROWS];
#define FOR_ROWS(code, name, values, bytes, group_bytes)                                    \
    case code:                                                                              \
        if (part == 4)                                                                      \
            group_##name(group, blocks, &from, 4, acc + done);                              \
        else if (part == 2)                                                                 \
            group_##name(group, blocks, &from, 2, acc + done);                              \
        else                                                                                \
            group_##name(group, blocks, &from, 1, acc + done);                              \
        break;
    for (int done = 0; done < rows;) {
        const int left = rows - done;
        const int part = left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const rounded_x from = rows_from(x, done);
        switch (type) { INT8_TYPE_LIST(FOR_ROWS) default: return; }
        done += part;
    }
#undef FOR_ROWS
    for (int m = 0; m < rows; m++) _mm256_storeu_ps(out[m], acc[m]);
}
#else
/* sixteen codes' products, summed: widened to int16 first, so that SSE2's pmaddwd
   takes them (inlined, gcc 12 left the loop scalar: a fifth of the speed) */
static __attribute__((noinline)) int32_t dot16(const int16_t *a, const int16_t *b) {
    int32_t sum = 0;
    for (int i = 0; i < 16; i++) sum += a[i] * b[i];
    return sum;
}

/* Portable: each of the eight rows unpacked (its type's unpack_), then for each row of x
   an integer sum per 16 values, times the row's scale and x's; the minimums times x's
   sum per 16. */
static void group_rows(int type, const uint8_t *group, int64_t blocks, const rounded_x *x,
                       int rows, float out[][GROUP]) {
    const int64_t values = block_values(type), group_bytes = gguf_group_block_bytes(type);
    int16_t xs[MAX_X_ROWS][256], ws[256]; /* the largest block */
    int8_t codes[256];
    float scale[16], min[16];
    for (int m = 0; m < rows; m++)
        for (int r = 0; r < GROUP; r++) out[m][r] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        for (int m = 0; m < rows; m++)
            for (int64_t i = 0; i < values; i++) xs[m][i] = x->codes[m * x->k + b * values + i];
        for (int r = 0; r < GROUP; r++) {
            unpack_block(type, group + b * group_bytes, r, codes, scale, min);
            for (int64_t i = 0; i < values; i++) ws[i] = codes[i];
            for (int m = 0; m < rows; m++) {
                const int64_t first = (m * x->k + b * values) / 16; /* x's sixteens */
                float sum = 0.0f;
                for (int s = 0; s < values / 16; s++) {
                    const float xd = x->scales[(first + s) / 2];
                    const float dot = (float)dot16(ws + 16 * s, xs[m] + 16 * s);
                    sum += (dot * scale[s] + (float)x->sums16[first + s] * min[s]) * xd;
                }
                out[m][r] += sum;
            }
        }
    }
}
#endif

#if INT8_SIMD
/* a group's eight outputs (+ bias) into y's columns 8g.. of n */
static inline void store_group(__m256 out, const float *bias, float *y, int64_t g, int64_t n) {
    const int64_t valid = n - GROUP * g < GROUP ? n - GROUP * g : GROUP;
    if (valid == GROUP) {
        if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias + GROUP * g));
        _mm256_storeu_ps(y + GROUP * g, out);
        return;
    }
    float lanes[GROUP];
    _mm256_storeu_ps(lanes, out);
    for (int64_t i = 0; i < valid; i++) y[GROUP * g + i] = lanes[i] + (bias ? bias[GROUP * g + i] : 0.0f);
}
#endif

#if INT8_DECODE
/* the x_pairs stride of ``type``'s one-row kernel (int8_decode.h); 0: it has none */
static int decode_stride(int type) {
#define STRIDE(code, name, stride) case code: return stride;
    switch (type) { DECODE_TYPE_LIST(STRIDE) default: return 0; }
#undef STRIDE
}

/* gguf_linear_int8 for one row of x (int8_decode.h): x's pairs built once, then each
   thread takes a contiguous share of the groups. */
static void decode_row(int type, const float *x, int64_t k, const uint8_t *groups, int64_t n,
                       int64_t group_bytes, const float *bias, float *y, int threads) {
    rounded_rows rows = round_rows(x, 1, k, 1, 1);
    const int64_t blocks = k / block_values(type), count = (n + GROUP - 1) / GROUP;
    const int stride = decode_stride(type);
    void *buffer = aligned_alloc(64, x_pairs_bytes(k / X_BLOCK, stride));
    const x_pairs pairs = build_x_pairs(&rows.x, k / X_BLOCK, stride, buffer);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < count; g++) {
        const uint8_t *group = groups + g * group_bytes;
        __m256 out;
#define DECODE(code, name, stride)                                                       \
    case code: out = decode_##name(group, blocks, &pairs); break;
        switch (type) { DECODE_TYPE_LIST(DECODE) default: out = _mm256_setzero_ps(); }
#undef DECODE
        store_group(out, bias, y, g, n);
    }
    free(buffer);
    free(rows.buffer);
}
#define HAS_DECODE_ROW(type) decode_stride(type)
#elif INT8_ROW_AVX2
/* whether ``type`` has an AVX2 one-row kernel (int8_decode_avx2.h) */
static int has_row_kernel(int type) {
#define HAS(code, name) case code: return 1;
    switch (type) { ROW_TYPE_LIST(HAS) default: return 0; }
#undef HAS
}

/* gguf_linear_int8 for one row of x (int8_decode_avx2.h): x rounded once, with the
   terms the kernels read, then each thread takes a contiguous share of the groups. */
static void decode_row(int type, const float *x, int64_t k, const uint8_t *groups, int64_t n,
                       int64_t group_bytes, const float *bias, float *y, int threads) {
    rounded_rows rows = round_rows(x, 1, k, 1, 1);
    const int64_t blocks = k / block_values(type), count = (n + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < count; g++) {
        const uint8_t *group = groups + g * group_bytes;
        __m256 out;
#define ROW(code, name)                                                                  \
    case code: out = row_##name(group, blocks, &rows.x); break;
        switch (type) { ROW_TYPE_LIST(ROW) default: out = _mm256_setzero_ps(); }
#undef ROW
        store_group(out, bias, y, g, n);
    }
    free(rows.buffer);
}
#define HAS_DECODE_ROW(type) has_row_kernel(type)
#endif

/* y [m, n] = round(x) [m, k] @ W^T (+ bias), W's n rows in ``groups`` of type ``type``
   (one of gguf_int8_type's), ``group_bytes`` apart; m <= 8 (the arguments are
   gguf_linear's; ``threads`` 0: the caller's OpenMP count when it runs). */
void gguf_linear_int8(int type, const float *x, int64_t m, int64_t k, const uint8_t *groups,
                      int64_t n, int64_t group_bytes, const float *bias, float *y,
                      int threads) {
    if (threads <= 0) threads = omp_get_max_threads();
#ifdef HAS_DECODE_ROW
    if (m == 1 && HAS_DECODE_ROW(type)) {
        decode_row(type, x, k, groups, n, group_bytes, bias, y, threads);
        return;
    }
#endif
    rounded_rows rows = round_rows(x, m, k, threads, 0);
    const rounded_x rounded = rows.x;
    const int64_t blocks = k / block_values(type);
    const int64_t count = (n + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < count; g++) {
        float out[MAX_X_ROWS][GROUP];
        group_rows(type, groups + g * group_bytes, blocks, &rounded, (int)m, out);
        const int64_t valid = n - GROUP * g < GROUP ? n - GROUP * g : GROUP;
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < valid; i++)
                y[r * n + GROUP * g + i] = out[r][i] + (bias ? bias[GROUP * g + i] : 0.0f);
    }
    free(rows.buffer);
}

/* -- many rows of x --------------------------------------------------------------------- */

/* Rows of x in a tile, and groups a thread's x tiles pass over in turn before it moves
   on (see gguf_gemm_int8). A tile of 8 runs as two kernels of 4 (group_rows): on a Zen 4
   core a kernel inlined for 8 rows was no faster than 4 + 4 on Q4_0 and 15% slower on
   Q8_0 (1024 x 4096, one thread); chunks of 2 to 8 groups ran alike, 5-10% faster than
   of 1. The pair kernels (int8_prefill.h) take a tile of PAIR_ROWS in one kernel, and
   chunks of 8 groups (4 pairs) ran 0-10% faster than of 4. */
#define TILE_ROWS 8
#define CHUNK_GROUPS 8

/* One group's outputs for ``rows`` (1..TILE_ROWS) rows of x (+ bias) into y's ``valid``
   columns from ``y`` on, its rows ``n`` apart. */
static void group_into(int type, const uint8_t *group, int64_t blocks, const rounded_x *x,
                       int rows, const float *bias, float *y, int64_t n, int64_t valid) {
    float out[MAX_X_ROWS][GROUP];
    group_rows(type, group, blocks, x, rows, out);
    for (int r = 0; r < rows; r++)
        for (int64_t i = 0; i < valid; i++) y[r * n + i] = out[r][i] + (bias ? bias[i] : 0.0f);
}

#if INT8_PAIRS
/* Whether ``type`` has a prefill kernel over two groups (int8_prefill.h) */
static int has_pairs(int type) {
#define HAS_PAIRS(code, name) case code: return 1;
    switch (type) { PAIR_TYPE_LIST(HAS_PAIRS) default: return 0; }
#undef HAS_PAIRS
}

/* Rows of x a pair kernel is inlined for at most, and rows in a tile over pairs: a
   group-block pair's codes are unpacked once per tile, so the more rows the less that
   costs each. Against 4, 8 rows ran Q5_K and Q6_K 10-25% faster, the others alike;
   against 8, 32 ran 2-11% faster (Q5_K and Q6_K most; one core, alternated), the
   accumulators of the rows past AVX-512's 32 registers kept in L1 (a load and a store a
   row and x block, beside eight vpdpbusd). */
#define PAIR_ROWS 32

/* Two groups' sixteen outputs (lanes 0-7: ``a``'s rows, 8-15: the next group's) for
   each of ``rows`` rows of x, as group_rows does for one */
static void pair_rows(int type, const uint8_t *a, const uint8_t *b, int64_t blocks,
                      const rounded_x *x, int rows, float out[][2 * GROUP]) {
    __m512 acc[PAIR_ROWS];
#define PAIR_FOR_ROWS(code, name)                                                           \
    case code:                                                                              \
        if (part == 32)                                                                     \
            pair_##name(a, b, blocks, &from, 32, acc + done);                               \
        else if (part == 16)                                                                \
            pair_##name(a, b, blocks, &from, 16, acc + done);                               \
        else if (part == 8)                                                                 \
            pair_##name(a, b, blocks, &from, 8, acc + done);                                \
        else if (part == 4)                                                                 \
            pair_##name(a, b, blocks, &from, 4, acc + done);                                \
        else if (part == 2)                                                                 \
            pair_##name(a, b, blocks, &from, 2, acc + done);                                \
        else                                                                                \
            pair_##name(a, b, blocks, &from, 1, acc + done);                                \
        break;
    for (int done = 0; done < rows;) {
        const int left = rows - done;
        const int part = left >= 32 ? 32 : left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const rounded_x from = rows_from(x, done);
        switch (type) { PAIR_TYPE_LIST(PAIR_FOR_ROWS) default: return; }
        done += part;
    }
#undef PAIR_FOR_ROWS
    for (int m = 0; m < rows; m++) _mm512_storeu_ps(out[m], acc[m]);
}

/* Groups g and g + 1 (both from ``group``, ``group_bytes`` apart) for ``rows`` rows of
   x, into y from column 8 g on: group_into for two groups */
static void pair_into(int type, const uint8_t *group, int64_t group_bytes, int64_t blocks,
                      const rounded_x *x, int rows, const float *bias, float *y, int64_t n,
                      int64_t valid) {
    float out[PAIR_ROWS][2 * GROUP];
    pair_rows(type, group, group + group_bytes, blocks, x, rows, out);
    for (int r = 0; r < rows; r++)
        for (int64_t i = 0; i < valid; i++) y[r * n + i] = out[r][i] + (bias ? bias[i] : 0.0f);
}
#endif

#if INT8_SIMD && !INT8_VNNI
/* Rows of x a pass over an unpacked group takes at once: against 6 and 8, 4 ran Q4_0,
   Q8_0 and Q4_K fastest on a Zen 3 (one thread, 240 rows), and Q6_K within 4% */
#define UNPACKED_ROWS 4

/* __m256i slots of a block unpacked (int8_unpacked.h); 0: the type is not unpacked */
static int64_t unpacked_slots(int type) {
    switch (type) {
    case 2: return Q4_0_SLOTS;
    case 8: return Q8_0_SLOTS;
    case 12: case 13: return K32_SLOTS;
    case 14: return Q6_K_SLOTS;
    default: return 0;
    }
}

/* one group of ``type`` unpacked into ``out`` (unpacked_slots(type) slots a block) */
static void unpack_group(int type, const uint8_t *group, int64_t blocks, __m256i *out) {
    if (type == 14)
        unpacked_q6_k(group, blocks, out);
    else if (type == 2)
        unpacked_q4_0(group, blocks, out);
    else if (type == 8)
        unpacked_q8_0(group, blocks, out);
    else
        unpacked_k32(group, blocks, type == 13, out);
}

/* ``rows`` (constant where inlined) rows of x over an unpacked group of ``type`` */
static inline __attribute__((always_inline)) void over_unpacked(int type, const __m256i *scratch,
                                                                int64_t blocks,
                                                                const rounded_x *x, int rows,
                                                                __m256 *acc) {
    if (type == 14)
        over_unpacked_q6_k(scratch, blocks, x, rows, acc);
    else if (type == 2)
        over_unpacked_q4_0(scratch, blocks, x, rows, acc);
    else if (type == 8)
        over_unpacked_q8_0(scratch, blocks, x, rows, acc);
    else if (type == 13)
        over_unpacked_k32(scratch, blocks, 1, x, rows, acc);
    else
        over_unpacked_k32(scratch, blocks, 0, x, rows, acc);
}

/* gguf_gemm_int8 over Q4_0, Q8_0, Q4_K, Q5_K or Q6_K without VNNI: each thread unpacks one group at
   a time (int8_unpacked.h) and passes every row of x over it. 0 where its scratch could
   not be had (the caller's tiles then do the work). */
static int gemm_unpacked(int type, const rounded_x *x, int64_t m, const uint8_t *groups,
                         int64_t n, int64_t group_bytes, int64_t blocks, const float *bias,
                         float *y, int threads) {
    const int64_t count = (n + GROUP - 1) / GROUP, slots = blocks * unpacked_slots(type);
    __m256i *scratch = aligned_alloc(32, (size_t)(threads * slots) * sizeof(__m256i));
    if (!scratch) return 0;
#pragma omp parallel num_threads(threads)
    {
        __m256i *own = scratch + omp_get_thread_num() * slots;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < count; g++) {
            unpack_group(type, groups + g * group_bytes, blocks, own);
            for (int64_t r = 0; r < m; r += UNPACKED_ROWS) {
                const int64_t rows = m - r < UNPACKED_ROWS ? m - r : UNPACKED_ROWS;
                __m256 acc[UNPACKED_ROWS];
                if (rows == UNPACKED_ROWS) {
                    const rounded_x from = rows_from(x, r);
                    over_unpacked(type, own, blocks, &from, UNPACKED_ROWS, acc);
                } else /* the last few rows, one at a time */
                    for (int64_t i = 0; i < rows; i++) {
                        const rounded_x one = rows_from(x, r + i);
                        over_unpacked(type, own, blocks, &one, 1, acc + i);
                    }
                for (int64_t i = 0; i < rows; i++) store_group(acc[i], bias, y + (r + i) * n, g, n);
            }
        }
    }
    free(scratch);
    return 1;
}
#endif

/* y [m, n] = round(x) [m, k] @ W^T (+ bias) for any number of rows m, with the
   arguments of gguf_linear_int8 and the same result row for row: x is rounded once (a
   row per thread), then each thread takes its share of the groups, CHUNK_GROUPS at a
   time, and passes every tile of rows of x (PAIR_ROWS where two groups go at once, else
   TILE_ROWS) over them, so that the chunk's
   groups are read from memory once and stay in the core's caches while x's tiles
   stream past. ``threads`` 0: as many as the caller's OpenMP setting holds when it
   runs (torch's thread count, which the engine lowers while other processes keep
   cores busy), so that a call bound once in a captured graph follows it. */
void gguf_gemm_int8(int type, const float *x, int64_t m, int64_t k, const uint8_t *groups,
                    int64_t n, int64_t group_bytes, const float *bias, float *y, int threads) {
    if (threads <= 0) threads = omp_get_max_threads();
#if INT8_SIMD && !INT8_VNNI
    const int unpacked = unpacked_slots(type) != 0;
#else
    const int unpacked = 0;
#endif
    /* the terms: the pairs' kernels and the unpacked groups' (Q4_0's -8 sums, Q4_K's
       and Q5_K's scaled sums) read them */
    rounded_rows rows = round_rows(x, m, k, threads, INT8_PAIRS || unpacked);
    const rounded_x rounded = rows.x;
    const int64_t blocks = k / block_values(type);
#if INT8_SIMD && !INT8_VNNI
    if (unpacked &&
        gemm_unpacked(type, &rounded, m, groups, n, group_bytes, blocks, bias, y, threads)) {
        free(rows.buffer);
        return;
    }
#endif
    const int64_t count = (n + GROUP - 1) / GROUP;
    /* smaller chunks where the groups are few, so that every thread has several */
    int64_t chunk = CHUNK_GROUPS;
    while (chunk > 1 && count < 4 * chunk * threads) chunk /= 2;
    const int64_t chunks = (count + chunk - 1) / chunk;
#if INT8_PAIRS
    const int pairs = has_pairs(type);
    const int64_t tile_rows = pairs ? PAIR_ROWS : TILE_ROWS;
#else
    const int64_t tile_rows = TILE_ROWS;
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t last = count < (c + 1) * chunk ? count : (c + 1) * chunk;
        for (int64_t first = 0; first < m; first += tile_rows) {
            const int tile = (int)(m - first < tile_rows ? m - first : tile_rows);
            int64_t g = c * chunk;
#if INT8_PAIRS
            const rounded_x part = rows_from(&rounded, first);
            for (; pairs && g + 1 < last; g += 2) {
                const int64_t valid = n - GROUP * g < 2 * GROUP ? n - GROUP * g : 2 * GROUP;
                pair_into(type, groups + g * group_bytes, group_bytes, blocks, &part, tile,
                          bias ? bias + GROUP * g : NULL, y + first * n + GROUP * g, n, valid);
            }
#endif
            /* a group left over (or every group of a type without pairs), TILE_ROWS rows
               of the tile at a time */
            for (; g < last; g++)
                for (int64_t r = first; r < first + tile; r += TILE_ROWS) {
                    const int rows = (int)(first + tile - r < TILE_ROWS ? first + tile - r : TILE_ROWS);
                    const rounded_x these = rows_from(&rounded, r);
                    const int64_t valid = n - GROUP * g < GROUP ? n - GROUP * g : GROUP;
                    group_into(type, groups + g * group_bytes, blocks, &these, rows,
                               bias ? bias + GROUP * g : NULL, y + r * n + GROUP * g, n, valid);
                }
        }
    }
    free(rows.buffer);
}
