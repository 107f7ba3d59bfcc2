/* Linear layers on the CPU over weights in panels, in any of five formats, and the routed
   experts of a mixture-of-experts MLP over the same panels.

   y = x @ W^T + bias, x [M, K] float32, W [N, K] in ``PANEL``-row panels: panel p holds
   rows [16p, 16p + 16) transposed, [K][16], zero past N, one contiguous run of memory.
   A format is how one step along K of a panel (16 weights) is stored:

     F32   16 float32                 BF16  16 bfloat16         F16  16 IEEE half
     I8    16 int8 codes              I4    8 bytes: byte j holds weight j in its low
                                            nibble and weight j + 8 in its high one

   I8 and I4 are quantized in groups of ``group`` steps along K: weight = scale * (code -
   zero), one scale (and optionally one zero) per output row and group, stored per panel
   as [K / group][16] float32. Without zeros, I4's zero is 8 (codes 0..15 are -8..7) and
   I8's is 0.

   Few rows (a decode step): each step along K widens 16 weights in registers (a shift for
   bfloat16, F16C's conversion for half, byte or nibble unpacking for codes) and
   multiply-adds them with up to six rows of x broadcast; a quantized group's zero is
   subtracted once per group, through x's precomputed sum over the group. Weights are
   read once, at the memory's speed, and never exist as float32 anywhere. More rows (a batch, a prefill):
   each thread widens one panel at a time into a [K][16] float32 buffer of its own, which
   stays in its cache, and runs the float32 panel kernel over every row of x; the
   widening is paid once per panel, not once per six rows.

   A step of 16 weights is one AVX-512 register where the machine has them (built with
   -march=native), else two AVX2 ones, else plain C; the same kernels serve all three.
   Output panels are split over the OpenMP threads. */

#include <math.h>
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

enum format { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, I4 = 4 };

/* Bytes of one step along K of a panel. */
static int64_t step_bytes(int format) {
    switch (format) {
    case F32: return PANEL * 4;
    case BF16:
    case F16: return PANEL * 2;
    case I8: return PANEL;
    default: return PANEL / 2;
    }
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

static inline pvec widen_bf16(const void *w, int64_t i) {
    const uint16_t *p = (const uint16_t *)w + i * PANEL;
#if defined(__AVX512F__)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (pvec)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#elif defined(__AVX2__)
    __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8)));
    return joined(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                  _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)));
#else
    float f[PANEL];
    for (int j = 0; j < PANEL; j++) {
        uint32_t bits = (uint32_t)p[j] << 16;
        memcpy(f + j, &bits, sizeof bits);
    }
    return load16(f);
#endif
}

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
   weights. BYTES: of one step along k. */
#define DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, ROWS)                               \
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
            if (ROWS <= 2) /* too few chains to hide the multiply-add latency: two sets */ \
                for (; i + 2 <= end; i += 2) {                                             \
                    __builtin_prefetch((const char *)w + i * BYTES + PREFETCH_BYTES);      \
                    const pvec w0 = WIDEN(w, i), w1 = WIDEN(w, i + 1);                     \
                    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {               \
                        sum[r] = pmuladd(sum[r], x[r * k + i], w0);                        \
                        sum2[r] = pmuladd(sum2[r], x[r * k + i + 1], w1);                  \
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

#define DEFINE_FORMAT(NAME, WIDEN, QUANT, BYTES)                                           \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, 1)                                      \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, 2)                                      \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, 3)                                      \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, 4)                                      \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, 5)                                      \
    DEFINE_PANEL_KERNEL(NAME, WIDEN, QUANT, BYTES, 6)

DEFINE_FORMAT(f32, widen_f32, 0, PANEL * 4)
DEFINE_FORMAT(bf16, widen_bf16, 0, PANEL * 2)
DEFINE_FORMAT(f16, widen_f16, 0, PANEL * 2)
DEFINE_FORMAT(i8, widen_i8, 1, PANEL)
DEFINE_FORMAT(i4, widen_i4, 1, PANEL / 2)

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
    for (int64_t start = 0, g = 0; start < k; start += group, g++) {
        const pvec zero = group_zero(q, g);
        const pvec scale = quantized ? load16(q->scales + g * PANEL) : psplat(1.0f);
        const int64_t end = start + group < k ? start + group : k;
        for (int64_t i = start; i < end; i++) {
            __builtin_prefetch((const char *)w + i * bytes + PREFETCH_BYTES);
            pvec step;
            switch (format) {
            case F32: step = widen_f32(w, i); break;
            case BF16: step = widen_bf16(w, i); break;
            case F16: step = widen_f16(w, i); break;
            case I8: step = widen_i8(w, i); break;
            default: step = widen_i4(w, i); break;
            }
            store16(out + i * PANEL, pscale(step, zero, scale));
        }
    }
}

/* y[m_rows, n_rows] (row stride ``y_stride``) = x [m_rows, k] @ W^T + bias, W in panels
   of ``format``; scales and zeros as the header says (NULL for the float formats). */
void panel_linear(const float *x, const void *w, int format, const float *scales,
                  const float *zeros, int64_t group, const float *bias, float *y,
                  int64_t y_stride, int64_t m_rows, int64_t n_rows, int64_t k, int threads) {
    const int64_t panels = (n_rows + PANEL - 1) / PANEL, bytes = step_bytes(format);
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
            const void *panel = (const char *)w + p * k * bytes;
            int kind = format;
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
}

static int64_t clamp(int64_t value, int64_t low, int64_t high) {
    return value < low ? low : (value > high ? high : value);
}

/* Routed experts over rows already grouped by expert: rows [offsets[e], offsets[e + 1])
   of x [rows, hidden] go to expert e, h = act(x W_gate^T) * (x W_up^T), out = h W_down^T,
   act SiLU (``activation`` 0) or GELU with the tanh approximation (1, Gemma's).
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
                 int64_t experts, int64_t hidden, int64_t inter, int threads, int activation) {
    const int64_t bytes = step_bytes(format);
    const int64_t gate_up_panels = (2 * inter + PANEL - 1) / PANEL;
    const int64_t down_panels = (hidden + PANEL - 1) / PANEL;
    const int64_t gate_up_bytes = gate_up_panels * hidden * bytes;
    const int64_t down_bytes = down_panels * inter * bytes;
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
                     gate_up_zeros ? gate_up_zeros + gu_q : NULL, gate_up_group, NULL,
                     gate_up_out + first * 2 * inter, 2 * inter, count, 2 * inter, hidden,
                     threads);
        for (int64_t r = first; r < last; r++) {
            const float *gate = gate_up_out + r * 2 * inter, *up = gate + inter;
            if (activation == 1) {
                /* 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), as torch's gelu "tanh" */
                for (int64_t j = 0; j < inter; j++) {
                    const float g = gate[j];
                    const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
                    h[r * inter + j] = 0.5f * g * (1.0f + tanhf(inner)) * up[j];
                }
                continue;
            }
#pragma omp simd
            for (int64_t j = 0; j < inter; j++)
                h[r * inter + j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
        }
        panel_linear(h + first * inter, (const char *)down + e * down_bytes, format,
                     down_scales ? down_scales + down_q : NULL,
                     down_zeros ? down_zeros + down_q : NULL, down_group, NULL,
                     out + first * hidden, hidden, count, hidden, inter, threads);
    }
}
