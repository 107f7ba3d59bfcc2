/* Linear layers on the CPU over weights in panels, in any of five formats, and the routed
   experts of a mixture-of-experts MLP over the same panels.

   y = x @ W^T + bias, x [M, K] float32, W [N, K] in ``PANEL``-row panels: panel p holds
   rows [16p, 16p + 16) transposed, [K][16], zero past N, one contiguous run of memory.
   A format is how one step along K of a panel (16 weights) is stored:

     F32   16 float32                 BF16  16 bfloat16, in pairs of steps (below)
     F16   16 IEEE half               I8    16 int8 codes
     I4    8 bytes: byte j holds weight j in its low nibble and weight j + 8 in its high one

   A bfloat16 panel holds its steps in pairs, [K / 2][16][2] (K rounded up to even, the
   last pair's second weight zero where K is odd): the two weights of one row at k and
   k + 1 are one 32-bit word, the operand of AVX512-BF16's pair dot product
   (``vdpbf16ps``), so the same bytes serve the float32 kernels (a shift and a mask
   widen a pair's two steps) and bfloat16 products.

   I8 and I4 are quantized in groups of ``group`` steps along K: weight = scale * (code -
   zero), one scale (and optionally one zero) per output row and group, stored per panel
   as [K / group][16] float32. Without zeros, I4's zero is 8 (codes 0..15 are -8..7) and
   I8's is 0.

   Few rows (a decode step): each step along K widens 16 weights in registers (a shift and
   a mask for a bfloat16 pair, F16C's conversion for half, byte or nibble unpacking for
   codes) and multiply-adds them with up to six rows of x broadcast; a quantized group's
   zero is subtracted once per group, through x's precomputed sum over the group. Weights
   are read once, at the memory's speed, and never exist as float32 anywhere. More rows
   (a batch, a prefill): each thread widens one panel at a time into a [K][16] float32
   buffer of its own, which stays in its cache, and runs the float32 panel kernel over
   every row of x; the widening is paid once per panel, not once per six rows.

   BF16_PRODUCTS is BF16's panels with one difference where the kernel is built for
   AVX512-BF16: from ``BF16_PRODUCT_ROWS`` rows of x, x is rounded to bfloat16 once (to
   nearest, ties to even) and the products are bfloat16 pairs summed in float32 (as
   oneDNN's and vLLM's bfloat16 GEMMs on such CPUs), tiles of up to 12 rows of x times
   two panels accumulating in registers: about twice the float32 multiply-add rate, no
   widening. The rounding of x is the one error it adds; fewer rows take BF16's kernel on
   x rounded alike, so that every row count computes the same products. Built without
   AVX512-BF16 it is BF16.

   A step of 16 weights is one AVX-512 register where the machine has them (built with
   -march=native), else two AVX2 ones, else plain C; the same kernels serve all three.
   Output panels are split over the OpenMP threads. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PANEL 16
/* How far ahead of the step being read a panel's bytes are asked for. A decode step reads
   its weights once, from memory; the hardware prefetcher alone left the quantized
   kernels waiting on it (a Xeon streamed int4 panels at 6 GB/s without, 19 GB/s with;
   benchmarks/RESULTS.md). A prefetch past the end of a panel is harmless: it never
   faults. */
#define PREFETCH_BYTES 2048
#define MAX_ROWS 6 /* 6 x 2 accumulators + 2 weight vectors + 1 broadcast: 15 of 16 */
/* Whether more than two rows can take a bfloat16 pair's two steps in one go: AVX-512's 32
   registers can; with AVX2's 16, gcc's fast-math reassociation of the two multiply-adds
   spilled accumulators (0.85x at 6 rows), so there the steps go one at a time. */
#if defined(__AVX512F__)
#define PAIRS_FIT 1
#else
#define PAIRS_FIT 0
#endif
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec16 __attribute__((vector_size(64)));
/* One step along K of a panel: its 16 weights as float32, in one AVX-512 register, or
   in two AVX2 ones. (A 64-byte vector type on AVX2 would be split by the compiler
   through memory, several times slower: the pair is written out.) The kernels use it
   only through the few operations below. */
#if defined(__AVX512F__)
typedef vec16 pvec;
static inline pvec psplat(float value) { return (vec16){0} + value; }
static inline pvec padd(pvec a, pvec b) { return a + b; }
static inline pvec pmuladd(pvec acc, float a, pvec w) { return acc + a * w; }
/* (s - zero * x_sum) * scale: a quantized group's sum with its zero taken off */
static inline pvec pgroup(pvec s, pvec zero, float x_sum, pvec scale) {
    return (s - zero * x_sum) * scale;
}
static inline pvec pscale(pvec w, pvec zero, pvec scale) { return (w - zero) * scale; }
#else
typedef struct {
    vec8 lo, hi;
} pvec;
static inline pvec psplat(float value) { return (pvec){(vec8){0} + value, (vec8){0} + value}; }
static inline pvec padd(pvec a, pvec b) { return (pvec){a.lo + b.lo, a.hi + b.hi}; }
static inline pvec pmuladd(pvec acc, float a, pvec w) {
    return (pvec){acc.lo + a * w.lo, acc.hi + a * w.hi};
}
static inline pvec pgroup(pvec s, pvec zero, float x_sum, pvec scale) {
    return (pvec){(s.lo - zero.lo * x_sum) * scale.lo, (s.hi - zero.hi * x_sum) * scale.hi};
}
static inline pvec pscale(pvec w, pvec zero, pvec scale) {
    return (pvec){(w.lo - zero.lo) * scale.lo, (w.hi - zero.hi) * scale.hi};
}
#endif

enum format { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, I4 = 4, BF16_PRODUCTS = 5 };

/* Bytes of one step along K of a panel (a bfloat16 pair's half). */
static int64_t step_bytes(int format) {
    switch (format) {
    case F32: return PANEL * 4;
    case BF16:
    case BF16_PRODUCTS:
    case F16: return PANEL * 2;
    case I8: return PANEL;
    default: return PANEL / 2;
    }
}

/* Bytes of one panel of K steps: a bfloat16 panel's K rounded up to whole pairs. */
static int64_t panel_bytes(int format, int64_t k) {
    const int paired = format == BF16 || format == BF16_PRODUCTS;
    return (paired ? (k + 1) / 2 * 2 : k) * step_bytes(format);
}

static inline vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v); /* an unaligned load */
    return v;
}

static inline pvec load16(const float *p) {
#if defined(__AVX512F__)
    pvec v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    return (pvec){load8(p), load8(p + 8)}; /* each half straight into its register */
#endif
}

static inline void store16(float *p, pvec v) {
#if defined(__AVX512F__)
    memcpy(p, &v, sizeof v);
#else
    memcpy(p, &v.lo, sizeof v.lo);
    memcpy(p + 8, &v.hi, sizeof v.hi);
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
static inline pvec joined(__m256 lo, __m256 hi) { return (pvec){(vec8)lo, (vec8)hi}; }
#endif

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f,
             mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal half: a normal float */
        float value = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -value : value;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The 16 weights of step i of a panel, widened in registers. */
static inline pvec widen_f32(const void *w, int64_t i) {
    return load16((const float *)w + i * PANEL);
}

/* Steps i and i + 1 (i even) of a bfloat16 panel are one pair, 16 32-bit words whose
   low halves are step i's weights and high halves step i + 1's. A bfloat16 is the high
   half of its float32: a shift widens the low halves, a mask the high ones. */
static inline pvec widen_bf16_even(const void *w, int64_t i) {
    const uint32_t *p = (const uint32_t *)w + i / 2 * PANEL;
#if defined(__AVX512F__)
    return (pvec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512((const void *)p), 16));
#elif defined(__AVX2__)
    return joined(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)p), 16)),
                  _mm256_castsi256_ps(
                      _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(p + 8)), 16)));
#else
    float f[PANEL];
    for (int j = 0; j < PANEL; j++) {
        const uint32_t bits = p[j] << 16;
        memcpy(f + j, &bits, sizeof bits);
    }
    return load16(f);
#endif
}

static inline pvec widen_bf16_odd(const void *w, int64_t i) {
    const uint32_t *p = (const uint32_t *)w + i / 2 * PANEL;
#if defined(__AVX512F__)
    return (pvec)_mm512_castsi512_ps(
        _mm512_and_si512(_mm512_loadu_si512((const void *)p), _mm512_set1_epi32(-65536)));
#elif defined(__AVX2__)
    const __m256i high = _mm256_set1_epi32(-65536);
    return joined(
        _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), high)),
        _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 8)), high)));
#else
    float f[PANEL];
    for (int j = 0; j < PANEL; j++) {
        const uint32_t bits = p[j] & 0xffff0000u;
        memcpy(f + j, &bits, sizeof bits);
    }
    return load16(f);
#endif
}

static inline pvec widen_bf16(const void *w, int64_t i) {
    return i & 1 ? widen_bf16_odd(w, i - 1) : widen_bf16_even(w, i);
}

/* Steps i and i + 1 of any other format, each widened on its own. */
#define WIDEN_EACH(WIDEN)                                                                  \
    static inline pvec WIDEN##_even(const void *w, int64_t i) { return WIDEN(w, i); }      \
    static inline pvec WIDEN##_odd(const void *w, int64_t i) { return WIDEN(w, i + 1); }

static inline pvec widen_f16(const void *w, int64_t i) {
    const uint16_t *p = (const uint16_t *)w + i * PANEL;
#if defined(__AVX512F__)
    return (pvec)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__AVX2__) && defined(__F16C__)
    return joined(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
#else
    float f[PANEL];
    for (int j = 0; j < PANEL; j++) f[j] = half_to_float(p[j]);
    return load16(f);
#endif
}

static inline pvec widen_i8(const void *w, int64_t i) {
    const int8_t *p = (const int8_t *)w + i * PANEL;
#if defined(__AVX512F__)
    return (pvec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return joined(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                  _mm256_cvtepi32_ps(
                      _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))));
#else
    float f[PANEL];
    for (int j = 0; j < PANEL; j++) f[j] = (float)p[j];
    return load16(f);
#endif
}

static inline pvec widen_i4(const void *w, int64_t i) {
    const uint8_t *p = (const uint8_t *)w + i * (PANEL / 2);
#if defined(__AVX2__)
    /* One widening of the 8 bytes to 32-bit lanes, then each lane's two nibbles: weight
       j in byte j's low nibble, weight j + 8 in its high one. */
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi32(0x0f));
    const __m256i high = _mm256_srli_epi32(bytes, 4);
#if defined(__AVX512F__)
    return (pvec)_mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1));
#else
    return joined(_mm256_cvtepi32_ps(low), _mm256_cvtepi32_ps(high));
#endif
#else
    float f[PANEL];
    for (int j = 0; j < PANEL / 2; j++) f[j] = (float)(p[j] & 0x0f), f[j + 8] = (float)(p[j] >> 4);
    return load16(f);
#endif
}

/* What a quantized panel's group g subtracts from its codes and multiplies them by, and
   the sums of x over each group: sum_i x_i (c_i - z) = sum_i x_i c_i - z sum_i x_i, so
   the few-row kernels multiply-add the codes as they are and subtract the zero once per
   group. */
typedef struct {
    const float *scales, *zeros; /* [K / group][PANEL] of this panel; zeros may be NULL */
    float default_zero;
    int64_t group;
    const float *x_sums; /* [rows][groups]: x's sum over each group, per row */
    int64_t groups;
} groups;

static inline pvec group_zero(const groups *q, int64_t g) {
    return q->zeros ? load16(q->zeros + g * PANEL) : psplat(q->default_zero);
}

/* y[r][0..cols) = x[r] . panel + bias for ROWS rows of x (row stride k), y row stride n.
   QUANT: the panel's codes are in groups (scales, zeros); else one group of k plain
   weights. BYTES: of one step along k. PAIRED: steps are read two at a time at every row
   count where the registers allow (a bfloat16 pair is one load); -ffast-math lets gcc
   add a pair's two products together before adding them to a row's sum. */
#define DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, PAIRED, ROWS)                       \
    static void NAME##_##ROWS(const float *restrict x, const void *restrict w, int64_t k,  \
                              const groups *q, const float *bias, float *restrict y,        \
                              int64_t n, int64_t cols) {                                    \
        pvec total[ROWS];                                                                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) total[r] = psplat(0.0f);   \
        const int64_t group = QUANT ? q->group : k;                                        \
        for (int64_t start = 0, g = 0; start < k; start += group, g++) {                   \
            const int64_t end = start + group < k ? start + group : k;                     \
            pvec sum[ROWS], sum2[ROWS], zero = psplat(0.0f);                               \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) sum[r] = sum2[r] =      \
                psplat(0.0f);                                                              \
            if (QUANT) zero = group_zero(q, g);                                            \
            int64_t i = start;                                                             \
            if (ROWS <= 2 || (PAIRED && PAIRS_FIT))                                        \
                for (; i + 2 <= end; i += 2) {                                             \
                    __builtin_prefetch((const char *)w + i * BYTES + PREFETCH_BYTES);      \
                    if (ROWS <= 2) {                                                       \
                        /* too few chains to hide the multiply-add latency: two sets */    \
                        const pvec w0 = WIDEN##_even(w, i), w1 = WIDEN##_odd(w, i);        \
                        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {           \
                            sum[r] = pmuladd(sum[r], x[r * k + i], w0);                    \
                            sum2[r] = pmuladd(sum2[r], x[r * k + i + 1], w1);              \
                        }                                                                  \
                    } else {                                                               \
                        const pvec w0 = WIDEN##_even(w, i);                                \
                        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) sum[r] =    \
                            pmuladd(sum[r], x[r * k + i], w0);                             \
                        const pvec w1 = WIDEN##_odd(w, i);                                 \
                        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) sum[r] =    \
                            pmuladd(sum[r], x[r * k + i + 1], w1);                         \
                    }                                                                      \
                }                                                                          \
            for (; i < end; i++) {                                                         \
                __builtin_prefetch((const char *)w + i * BYTES + PREFETCH_BYTES);          \
                const pvec w0 = WIDEN(w, i);                                               \
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) sum[r] =            \
                    pmuladd(sum[r], x[r * k + i], w0);                                     \
            }                                                                              \
            const pvec scale = QUANT ? load16(q->scales + g * PANEL) : psplat(0.0f);       \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                       \
                const pvec s = padd(sum[r], sum2[r]);                                      \
                total[r] = padd(total[r], QUANT ? pgroup(s, zero, q->x_sums[r * q->groups + g], \
                                                         scale)                            \
                                                : s);                                      \
            }                                                                              \
        }                                                                                  \
        for (int r = 0; r < ROWS; r++) {                                                   \
            float out[PANEL];                                                              \
            store16(out, total[r]);                                                        \
            for (int64_t c = 0; c < cols; c++) y[r * n + c] = out[c] + (bias ? bias[c] : 0.0f); \
        }                                                                                  \
    }

#define DEFINE_FORMAT(NAME, WIDEN, QUANT, BYTES, PAIRED)                                   \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, PAIRED, 1)                              \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, PAIRED, 2)                              \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, PAIRED, 3)                              \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, PAIRED, 4)                              \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, PAIRED, 5)                              \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, PAIRED, 6)

WIDEN_EACH(widen_f32)
WIDEN_EACH(widen_f16)
WIDEN_EACH(widen_i8)
WIDEN_EACH(widen_i4)
DEFINE_FORMAT(f32, widen_f32, 0, PANEL * 4, 0)
DEFINE_FORMAT(bf16, widen_bf16, 0, PANEL * 2, 1)
DEFINE_FORMAT(f16, widen_f16, 0, PANEL * 2, 0)
DEFINE_FORMAT(i8, widen_i8, 1, PANEL, 0)
DEFINE_FORMAT(i4, widen_i4, 1, PANEL / 2, 0)

typedef void (*panel_kernel)(const float *, const void *, int64_t, const groups *,
                             const float *, float *, int64_t, int64_t);
#define KERNELS(NAME) {NULL, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6}
static const panel_kernel PANEL_KERNELS[5][MAX_ROWS + 1] = {
    KERNELS(f32), KERNELS(bf16), KERNELS(f16), KERNELS(i8), KERNELS(i4)};

/* The [k][PANEL] float32 weights of one panel, into ``out``. */
static void widen_panel(int format, const void *w, int64_t k, const groups *q, float *out) {
    const int quantized = format == I8 || format == I4;
    const int64_t bytes = step_bytes(format);
    const int64_t group = quantized ? q->group : k;
    if (format == BF16 || format == BF16_PRODUCTS) { /* a pair of steps per load */
        int64_t i = 0;
        for (; i + 2 <= k; i += 2) {
            __builtin_prefetch((const char *)w + i * bytes + PREFETCH_BYTES);
            store16(out + i * PANEL, widen_bf16_even(w, i));
            store16(out + (i + 1) * PANEL, widen_bf16_odd(w, i));
        }
        if (i < k) store16(out + i * PANEL, widen_bf16_even(w, i));
        return;
    }
    for (int64_t start = 0, g = 0; start < k; start += group, g++) {
        const pvec zero = group_zero(q, g);
        const pvec scale = quantized ? load16(q->scales + g * PANEL) : psplat(1.0f);
        const int64_t end = start + group < k ? start + group : k;
        for (int64_t i = start; i < end; i++) {
            __builtin_prefetch((const char *)w + i * bytes + PREFETCH_BYTES);
            pvec step;
            switch (format) {
            case F32: step = widen_f32(w, i); break;
            case F16: step = widen_f16(w, i); break;
            case I8: step = widen_i8(w, i); break;
            default: step = widen_i4(w, i); break;
            }
            store16(out + i * PANEL, pscale(step, zero, scale));
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* From this many rows of x, BF16_PRODUCTS multiplies in bfloat16. On a Zen 4 EPYC
   (benchmarks/RESULTS.md) the products never lost from 4 rows (1.0-1.2x at 4 on weights
   streamed from memory, 1.1-1.35x at 5-6, 1.7x in cache); for 1 to 3 rows from memory
   the two tie, both at the memory's speed, so a decode step of up to three rows stays
   exact. */
#define BF16_PRODUCT_ROWS 4
/* Rows of x per tile of bfloat16 products: 12 rows x 2 panels = 24 accumulators, 2
   weight registers, the x pairs broadcast straight from memory: 26 of 32. */
#define BF16_TILE_ROWS 12

/* Pairs of steps along K per block: a block of x's rows (4 bytes a pair, a kilobyte a
   row) stays in the core's L2 cache while every panel takes its turn under it, and a
   block of two panels (32 KB) in L1 while every tile of rows goes over it. */
#define BF16_BLOCK_PAIRS 256

/* y[r][0..cols) (+)= ROWS rows of x's pairs (row stride ``stride`` words) times
   ``pairs`` pairs of PANELS panels (w[j]), products of bfloat16 summed in float32. The
   first block of K (``first_block``) starts from the bias, the others from y. */
#define DEFINE_BF16_TILE(ROWS, PANELS)                                                      \
    static void bf16_tile_##ROWS##_##PANELS(const uint32_t *restrict x, int64_t stride,    \
                                            const uint32_t *const *w, int64_t pairs,       \
                                            int first_block, const float *bias,            \
                                            float *restrict y, int64_t n, int64_t cols) {  \
        __mmask16 mask[PANELS];                                                            \
        __m512 acc[ROWS * PANELS];                                                         \
        for (int j = 0; j < PANELS; j++) {                                                 \
            const int64_t left = cols - j * PANEL;                                         \
            mask[j] = left >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);   \
        }                                                                                  \
        _Pragma("GCC unroll 12") for (int r = 0; r < ROWS; r++)                            \
            _Pragma("GCC unroll 2") for (int j = 0; j < PANELS; j++) acc[PANELS * r + j] = \
                !first_block ? _mm512_maskz_loadu_ps(mask[j], y + r * n + j * PANEL)       \
                : bias       ? _mm512_maskz_loadu_ps(mask[j], bias + j * PANEL)            \
                             : _mm512_setzero_ps();                                        \
        for (int64_t i = 0; i < pairs; i++) {                                              \
            __m512bh panel[PANELS];                                                        \
            _Pragma("GCC unroll 2") for (int j = 0; j < PANELS; j++) {                     \
                __builtin_prefetch(w[j] + i * PANEL + PREFETCH_BYTES / 4);                 \
                panel[j] = (__m512bh)_mm512_loadu_si512((const void *)(w[j] + i * PANEL)); \
            }                                                                              \
            _Pragma("GCC unroll 12") for (int r = 0; r < ROWS; r++) {                      \
                const __m512bh xr = (__m512bh)_mm512_set1_epi32((int)x[r * stride + i]);   \
                _Pragma("GCC unroll 2") for (int j = 0; j < PANELS; j++) acc[PANELS * r + j] = \
                    _mm512_dpbf16_ps(acc[PANELS * r + j], panel[j], xr);                   \
            }                                                                              \
        }                                                                                  \
        _Pragma("GCC unroll 12") for (int r = 0; r < ROWS; r++)                            \
            _Pragma("GCC unroll 2") for (int j = 0; j < PANELS; j++)                       \
                _mm512_mask_storeu_ps(y + r * n + j * PANEL, mask[j], acc[PANELS * r + j]); \
    }
#define DEFINE_BF16_TILES(ROWS) DEFINE_BF16_TILE(ROWS, 1) DEFINE_BF16_TILE(ROWS, 2)
DEFINE_BF16_TILES(1) DEFINE_BF16_TILES(2) DEFINE_BF16_TILES(3) DEFINE_BF16_TILES(4)
DEFINE_BF16_TILES(5) DEFINE_BF16_TILES(6) DEFINE_BF16_TILES(7) DEFINE_BF16_TILES(8)
DEFINE_BF16_TILES(9) DEFINE_BF16_TILES(10) DEFINE_BF16_TILES(11) DEFINE_BF16_TILES(12)

typedef void (*bf16_tile)(const uint32_t *, int64_t, const uint32_t *const *, int64_t, int,
                          const float *, float *, int64_t, int64_t);
#define BF16_TILES(ROWS) {bf16_tile_##ROWS##_1, bf16_tile_##ROWS##_2}
static const bf16_tile BF16_TILE_KERNELS[BF16_TILE_ROWS + 1][2] = {
    {NULL, NULL},   BF16_TILES(1), BF16_TILES(2), BF16_TILES(3),  BF16_TILES(4),
    BF16_TILES(5),  BF16_TILES(6), BF16_TILES(7), BF16_TILES(8),  BF16_TILES(9),
    BF16_TILES(10), BF16_TILES(11), BF16_TILES(12)};

/* x rounded to bfloat16 as vcvtneps2bf16 rounds it (to nearest, ties to even), as a float */
static inline float bf16_rounded(float x) {
    return _mm_cvtss_f32(_mm_castsi128_ps(_mm_slli_epi32(
        _mm_cvtepu16_epi32((__m128i)_mm_cvtneps_pbh(_mm_set_ss(x))), 16)));
}

/* One row of x (k values) rounded to bfloat16 (to nearest, ties to even) into ``out``'s
   ``pairs`` words, a zero completing an odd K's last pair. */
static void round_to_bf16_pairs(const float *row, int64_t k, int64_t pairs, uint32_t *out) {
    uint16_t *halves = (uint16_t *)out;
    int64_t i = 0;
    for (; i + PANEL <= k; i += PANEL)
        _mm256_storeu_si256((__m256i *)(halves + i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + i)));
    if (i < 2 * pairs) {
        const __m512 tail = _mm512_maskz_loadu_ps((__mmask16)((1u << (k - i)) - 1), row + i);
        _mm256_mask_storeu_epi16(halves + i, (__mmask16)((1u << (2 * pairs - i)) - 1),
                                 (__m256i)_mm512_cvtneps_pbh(tail));
    }
}

/* panel_linear's bfloat16 products: x rounded once into pairs of bfloat16, then block
   by block of K, two panels at a time under every tile of rows of x. Each thread keeps
   the same panels in every block (a static schedule of the same count), so it alone
   adds into their columns of y. 0 where x's bfloat16 copy found no memory. */
static int bf16_product_linear(const float *x, const void *w, const float *bias, float *y,
                               int64_t y_stride, int64_t m_rows, int64_t n_rows, int64_t k,
                               int threads) {
    const int64_t panels = (n_rows + PANEL - 1) / PANEL, pairs = (k + 1) / 2;
    const int64_t twos = (panels + 1) / 2;
    uint32_t *x_pairs = malloc(sizeof(uint32_t) * m_rows * pairs);
    if (!x_pairs) return 0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m_rows; r++)
            round_to_bf16_pairs(x + r * k, k, pairs, x_pairs + r * pairs);
        for (int64_t block = 0; block < pairs; block += BF16_BLOCK_PAIRS) {
            const int64_t count =
                pairs - block < BF16_BLOCK_PAIRS ? pairs - block : BF16_BLOCK_PAIRS;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < twos; t++) {
                const int64_t p = 2 * t;
                const int two = p + 1 < panels;
                const uint32_t *start = (const uint32_t *)w + block * PANEL;
                const uint32_t *panel[2] = {start + p * pairs * PANEL,
                                            start + (p + two) * pairs * PANEL};
                const int64_t first = p * PANEL;
                const int64_t cols = n_rows - first < 2 * PANEL ? n_rows - first : 2 * PANEL;
                for (int64_t m = 0; m < m_rows; m += BF16_TILE_ROWS) {
                    const int64_t rows = m_rows - m < BF16_TILE_ROWS ? m_rows - m : BF16_TILE_ROWS;
                    BF16_TILE_KERNELS[rows][two](x_pairs + m * pairs + block, pairs, panel, count,
                                                 block == 0, bias ? bias + first : NULL,
                                                 y + m * y_stride + first, y_stride, cols);
                }
            }
        }
    }
    free(x_pairs);
    return 1;
}
#else
#define BF16_PRODUCT_ROWS 0
#endif

/* From how many rows of x BF16_PRODUCTS multiplies in bfloat16; 0 where this build
   cannot (no AVX512-BF16), and BF16_PRODUCTS is BF16. */
int bf16_product_rows(void) { return BF16_PRODUCT_ROWS; }

/* y[m_rows, n_rows] (row stride ``y_stride``) = x [m_rows, k] @ W^T + bias, W in panels
   of ``format``; scales and zeros as the header says (NULL for the float formats).
   ``threads`` 0: the caller's OpenMP count when it runs, so that a call bound once in a
   captured graph follows torch's thread count (which the engine lowers under load). */
void panel_linear(const float *x, const void *w, int format, const float *scales,
                  const float *zeros, int64_t group, const float *bias, float *y,
                  int64_t y_stride, int64_t m_rows, int64_t n_rows, int64_t k, int threads) {
    if (threads <= 0) threads = omp_get_max_threads();
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (format == BF16_PRODUCTS && m_rows >= BF16_PRODUCT_ROWS &&
        bf16_product_linear(x, w, bias, y, y_stride, m_rows, n_rows, k, threads))
        return;
    /* Fewer rows take the exact kernel on x rounded as the products round it, so that a
       row's value does not depend on how many rows shared its step (a request decoded
       beside three others would otherwise compute with another x than alone). */
    float *rounded_x = NULL;
    if (format == BF16_PRODUCTS) {
        rounded_x = malloc(sizeof(float) * (size_t)(m_rows * k));
        if (rounded_x) {
            for (int64_t i = 0; i < m_rows * k; i++) rounded_x[i] = bf16_rounded(x[i]);
            x = rounded_x;
        }
    }
#endif
    const int64_t panels = (n_rows + PANEL - 1) / PANEL, bytes = panel_bytes(format, k);
    const int64_t groups_per_panel = group > 0 ? (k + group - 1) / group : 0;
    const int widened = format != F32 && m_rows > MAX_ROWS;
    float *x_sums = NULL;
    if (groups_per_panel && !widened) {
        x_sums = malloc(sizeof(float) * m_rows * groups_per_panel);
        for (int64_t r = 0; r < m_rows; r++)
            for (int64_t g = 0; g < groups_per_panel; g++) {
                const int64_t end = (g + 1) * group < k ? (g + 1) * group : k;
                float sum = 0.0f;
                for (int64_t i = g * group; i < end; i++) sum += x[r * k + i];
                x_sums[r * groups_per_panel + g] = sum;
            }
    }
#pragma omp parallel num_threads(threads)
    {
        float *buffer = widened ? malloc(sizeof(float) * PANEL * k) : NULL;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t first = p * PANEL;
            const int64_t cols = n_rows - first < PANEL ? n_rows - first : PANEL;
            groups q = {
                scales ? scales + p * groups_per_panel * PANEL : NULL,
                zeros ? zeros + p * groups_per_panel * PANEL : NULL,
                format == I4 ? 8.0f : 0.0f,
                group,
                NULL,
                groups_per_panel,
            };
            const void *panel = (const char *)w + p * bytes;
            int kind = format == BF16_PRODUCTS ? BF16 : format;
            if (widened && buffer) {
                widen_panel(format, panel, k, &q, buffer);
                panel = buffer, kind = F32;
            }
            for (int64_t m = 0; m < m_rows; m += MAX_ROWS) {
                const int64_t rows = m_rows - m < MAX_ROWS ? m_rows - m : MAX_ROWS;
                q.x_sums = x_sums ? x_sums + m * groups_per_panel : NULL;
                PANEL_KERNELS[kind][rows](x + m * k, panel, k, &q, bias ? bias + first : NULL,
                                          y + m * y_stride + first, y_stride, cols);
            }
        }
        free(buffer);
    }
    free(x_sums);
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    free(rounded_x);
#endif
}

static int64_t clamp(int64_t value, int64_t low, int64_t high) {
    return value < low ? low : (value > high ? high : value);
}

/* One row's activation from its gate and up halves [2 * inter] into h [inter]:
   ``activation`` 0: silu(gate) * up; 1: GELU with the tanh approximation (Gemma's) times
   up; 2: gpt-oss's clamped SwiGLU: the gate clamped above at ``limit``, the up to
   [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1). */
static void activate(const float *gate, float *h, int64_t inter, int activation, float alpha,
                     float limit) {
    const float *up = gate + inter;
    if (activation == 1) {
        /* 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), as torch's gelu "tanh" */
        for (int64_t j = 0; j < inter; j++) {
            const float g = gate[j];
            const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
            h[j] = 0.5f * g * (1.0f + tanhf(inner)) * up[j];
        }
        return;
    }
    if (activation == 2) {
#pragma omp simd
        for (int64_t j = 0; j < inter; j++) {
            const float g = fminf(gate[j], limit), u = fminf(fmaxf(up[j], -limit), limit);
            h[j] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
        }
        return;
    }
#pragma omp simd
    for (int64_t j = 0; j < inter; j++) h[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
}

/* Routed experts over rows already grouped by expert: rows [offsets[e], offsets[e + 1])
   of x [rows, hidden] go to expert e, h = act(x W_gate^T) * (x W_up^T), out = h W_down^T,
   act ``activate``'s of ``activation`` (with gpt-oss's ``alpha`` and ``limit``), and
   ``gate_up_bias`` [experts, 2 * inter] and ``down_bias`` [experts, hidden] added where
   not NULL.
   Expert e's gate_up [2 * inter, hidden] (gate rows, then up rows) and down [hidden,
   inter] are in panels of ``format``, experts one after another (``*_scales`` and
   ``*_zeros`` likewise, per expert). Each chosen expert's weights are streamed once,
   whatever its row count, and an expert with no rows is not read at all. ``gate_up_out``
   [rows, 2 * inter] and ``h`` [rows, inter] are scratch. Offsets outside [0, rows] are
   clamped, so memory stays safe even if a caller passes inconsistent ones. */
void grouped_mlp(const float *x, const int64_t *offsets, int format, const void *gate_up,
                 const float *gate_up_scales, const float *gate_up_zeros, int64_t gate_up_group,
                 const void *down, const float *down_scales, const float *down_zeros,
                 int64_t down_group, float *gate_up_out, float *h, float *out, int64_t rows,
                 int64_t experts, int64_t hidden, int64_t inter, int threads, int activation,
                 const float *gate_up_bias, const float *down_bias, float alpha, float limit) {
    const int64_t gate_up_panels = (2 * inter + PANEL - 1) / PANEL;
    const int64_t down_panels = (hidden + PANEL - 1) / PANEL;
    const int64_t gate_up_bytes = gate_up_panels * panel_bytes(format, hidden);
    const int64_t down_bytes = down_panels * panel_bytes(format, inter);
    const int64_t gate_up_groups = gate_up_group > 0 ? (hidden + gate_up_group - 1) / gate_up_group : 0;
    const int64_t down_groups = down_group > 0 ? (inter + down_group - 1) / down_group : 0;
    for (int64_t e = 0; e < experts; e++) {
        const int64_t first = clamp(offsets[e], 0, rows);
        const int64_t last = clamp(offsets[e + 1], first, rows);
        if (first == last) continue;
        const int64_t count = last - first;
        const int64_t gu_q = e * gate_up_panels * gate_up_groups * PANEL;
        const int64_t down_q = e * down_panels * down_groups * PANEL;
        panel_linear(x + first * hidden, (const char *)gate_up + e * gate_up_bytes, format,
                     gate_up_scales ? gate_up_scales + gu_q : NULL,
                     gate_up_zeros ? gate_up_zeros + gu_q : NULL, gate_up_group,
                     gate_up_bias ? gate_up_bias + e * 2 * inter : NULL,
                     gate_up_out + first * 2 * inter, 2 * inter, count, 2 * inter, hidden,
                     threads);
        for (int64_t r = first; r < last; r++)
            activate(gate_up_out + r * 2 * inter, h + r * inter, inter, activation, alpha, limit);
        panel_linear(h + first * inter, (const char *)down + e * down_bytes, format,
                     down_scales ? down_scales + down_q : NULL,
                     down_zeros ? down_zeros + down_q : NULL, down_group,
                     down_bias ? down_bias + e * hidden : NULL,
                     out + first * hidden, hidden, count, hidden, inter, threads);
    }
}
