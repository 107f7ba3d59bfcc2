/* Linear layers for few rows on the CPU: y = x @ (w * scale)^T + bias, x [M, K] float32.

   A decode step with few rows reads every weight once and does little else, so what
   counts is reading w at the memory's full speed, and doing the few rows' multiply-adds
   on it while it is in registers.

   float_linear: w is float32 in panels (``PANEL`` output rows at a time, laid out
   [K][PANEL], zero-padded past N), packed once at load time. A panel is one contiguous
   run of memory, so each thread streams its panels in order; each step along K loads
   one vector pair of weights for PANEL outputs and multiply-adds it with up to six rows
   of x broadcast, twelve vector accumulators in all. No horizontal sums, no partial
   tiles, and one or two rows split K over two accumulator sets to keep the
   multiply-adds from waiting on each other.

   int8_linear: w is int8 [N, K] with one scale per output row. Each thread streams
   whole rows: with one row of x each weight row is used as it is read; with more, four
   weight rows at a time are widened to float into a buffer that stays in L1 and meet
   four rows of x at a time (sixteen accumulators). Output rows are split over the
   OpenMP threads. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 4

/* y[0..TILE) = x . w[t] for TILE float rows w, each k long */
static void dot_tile(const float *restrict x, const float *restrict w, int64_t k, float *y) {
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t i = 0; i < k; i++) {
        float v = x[i];
        a0 += v * w[i];
        a1 += v * w[k + i];
        a2 += v * w[2 * k + i];
        a3 += v * w[3 * k + i];
    }
    y[0] = a0;
    y[1] = a1;
    y[2] = a2;
    y[3] = a3;
}

/* y[r * n + t] = x[r] . w[t] for 4 rows x (row stride k) and TILE float rows w */
static void dot_block(const float *restrict x, const float *restrict w, int64_t k, float *y,
                      int64_t n) {
    float a00 = 0, a01 = 0, a02 = 0, a03 = 0, a10 = 0, a11 = 0, a12 = 0, a13 = 0;
    float a20 = 0, a21 = 0, a22 = 0, a23 = 0, a30 = 0, a31 = 0, a32 = 0, a33 = 0;
    const float *x0 = x, *x1 = x + k, *x2 = x + 2 * k, *x3 = x + 3 * k;
#pragma omp simd reduction(+ : a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, \
                               a30, a31, a32, a33)
    for (int64_t i = 0; i < k; i++) {
        float w0 = w[i], w1 = w[k + i], w2 = w[2 * k + i], w3 = w[3 * k + i];
        a00 += x0[i] * w0, a01 += x0[i] * w1, a02 += x0[i] * w2, a03 += x0[i] * w3;
        a10 += x1[i] * w0, a11 += x1[i] * w1, a12 += x1[i] * w2, a13 += x1[i] * w3;
        a20 += x2[i] * w0, a21 += x2[i] * w1, a22 += x2[i] * w2, a23 += x2[i] * w3;
        a30 += x3[i] * w0, a31 += x3[i] * w1, a32 += x3[i] * w2, a33 += x3[i] * w3;
    }
    y[0] = a00, y[1] = a01, y[2] = a02, y[3] = a03;
    y[n] = a10, y[n + 1] = a11, y[n + 2] = a12, y[n + 3] = a13;
    y[2 * n] = a20, y[2 * n + 1] = a21, y[2 * n + 2] = a22, y[2 * n + 3] = a23;
    y[3 * n] = a30, y[3 * n + 1] = a31, y[3 * n + 2] = a32, y[3 * n + 3] = a33;
}

/* x . b for one int8 row b, k long */
static float int8_dot(const float *restrict a, const int8_t *restrict b, int64_t k) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < k; i++) acc += a[i] * (float)b[i];
    return acc;
}

void int8_linear(const float *x, const int8_t *w, const float *scale, const float *bias,
                 float *y, int64_t m_rows, int64_t n_rows, int64_t k, int threads) {
    const int64_t tiles = (n_rows + TILE - 1) / TILE;
#pragma omp parallel num_threads(threads)
    {
        float *widened = m_rows > 1 ? malloc(sizeof(float) * TILE * k) : NULL;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t first = tile * TILE;
            const int64_t count = n_rows - first < TILE ? n_rows - first : TILE;
            if (m_rows == 1 || widened == NULL || count < TILE) {
                for (int64_t n = first; n < first + count; n++) {
                    float s = scale ? scale[n] : 1.0f, offset = bias ? bias[n] : 0.0f;
                    for (int64_t m = 0; m < m_rows; m++)
                        y[m * n_rows + n] = int8_dot(x + m * k, w + n * k, k) * s + offset;
                }
                continue;
            }
            const int8_t *rows = w + first * k;
#pragma omp simd
            for (int64_t i = 0; i < TILE * k; i++) widened[i] = (float)rows[i];
            int64_t m = 0;
            for (; m + 4 <= m_rows; m += 4)
                dot_block(x + m * k, widened, k, y + m * n_rows + first, n_rows);
            for (; m < m_rows; m++) dot_tile(x + m * k, widened, k, y + m * n_rows + first);
            for (m = 0; m < m_rows; m++)
                for (int64_t t = 0; t < TILE; t++) {
                    int64_t n = first + t;
                    y[m * n_rows + n] =
                        y[m * n_rows + n] * (scale ? scale[n] : 1.0f) + (bias ? bias[n] : 0.0f);
                }
        }
        free(widened);
    }
}

/* float_linear's panels: PANEL outputs, two vectors of 8 floats (gcc vector extensions,
   lowered to whatever the machine has: AVX2 here). */
#define PANEL 16
#define MAX_ROWS 6 /* 6 x 2 accumulators + 2 weight vectors + 1 broadcast: 15 of 16 */
typedef float vec8 __attribute__((vector_size(32)));

static inline vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v); /* an unaligned load */
    return v;
}

/* y[r][0..cols) = x[r] . panel + bias for ROWS rows x (row stride k), y row stride n */
#define DEFINE_PANEL_KERNEL(ROWS)                                                          \
    static void panel_##ROWS(const float *restrict x, const float *restrict w, int64_t k,  \
                             const float *bias, float *restrict y, int64_t n, int64_t cols) { \
        vec8 lo[ROWS], hi[ROWS], lo2[ROWS], hi2[ROWS];                                     \
        _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) lo[r] = hi[r] = lo2[r] =    \
            hi2[r] = (vec8){0};                                                            \
        int64_t i = 0;                                                                     \
        if (ROWS <= 2) /* too few chains to hide the multiply-add latency: two sets */     \
            for (; i + 2 <= k; i += 2) {                                                   \
                const float *p = w + i * PANEL;                                            \
                vec8 w0 = load8(p), w1 = load8(p + 8), w2 = load8(p + 16), w3 = load8(p + 24); \
                _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                   \
                    float a = x[r * k + i], b = x[r * k + i + 1];                          \
                    lo[r] += a * w0, hi[r] += a * w1, lo2[r] += b * w2, hi2[r] += b * w3;   \
                }                                                                          \
            }                                                                              \
        for (; i < k; i++) {                                                               \
            vec8 w0 = load8(w + i * PANEL), w1 = load8(w + i * PANEL + 8);                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                       \
                float a = x[r * k + i];                                                    \
                lo[r] += a * w0, hi[r] += a * w1;                                          \
            }                                                                              \
        }                                                                                  \
        for (int r = 0; r < ROWS; r++) {                                                   \
            float out[PANEL];                                                              \
            vec8 a = lo[r] + lo2[r], b = hi[r] + hi2[r];                                   \
            memcpy(out, &a, sizeof a);                                                     \
            memcpy(out + 8, &b, sizeof b);                                                 \
            for (int64_t c = 0; c < cols; c++) y[r * n + c] = out[c] + (bias ? bias[c] : 0.0f); \
        }                                                                                  \
    }

DEFINE_PANEL_KERNEL(1)
DEFINE_PANEL_KERNEL(2)
DEFINE_PANEL_KERNEL(3)
DEFINE_PANEL_KERNEL(4)
DEFINE_PANEL_KERNEL(5)
DEFINE_PANEL_KERNEL(6)

typedef void (*panel_kernel)(const float *, const float *, int64_t, const float *, float *,
                             int64_t, int64_t);
static const panel_kernel PANEL_KERNELS[MAX_ROWS + 1] = {NULL,    panel_1, panel_2, panel_3,
                                                         panel_4, panel_5, panel_6};

/* w: ceil(n_rows / PANEL) panels of [k][PANEL] floats */
void float_linear(const float *x, const float *w, const float *bias, float *y, int64_t m_rows,
                  int64_t n_rows, int64_t k, int threads) {
    const int64_t panels = (n_rows + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t first = p * PANEL;
        const int64_t cols = n_rows - first < PANEL ? n_rows - first : PANEL;
        for (int64_t m = 0; m < m_rows; m += MAX_ROWS) {
            const int64_t rows = m_rows - m < MAX_ROWS ? m_rows - m : MAX_ROWS;
            PANEL_KERNELS[rows](x + m * k, w + first * k, k, bias ? bias + first : NULL,
                                y + m * n_rows + first, n_rows, cols);
        }
    }
}
