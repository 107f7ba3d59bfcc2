/* Matrix-vector-bound linear layers for the CPU: y = x @ (w * scale)^T + bias.

   x [M, K] float32, w [N, K] (float32, or int8 with one scale per output row),
   y [M, N] float32. A decode step with few rows reads every weight once and does little
   else, so what counts is reading w at the memory's full speed: each thread streams
   whole rows of w, in order. With one row of x, each weight row is used as it is read.
   With more, four weight rows at a time (int8 ones widened to float into a buffer that
   stays in L1, float ones read in place) meet four rows of x at a time in one pass:
   sixteen accumulators, so eight loads serve sixteen multiply-adds (a verify step's few
   rows then cost little more than one). Output rows are split over the OpenMP threads. */

#include <stdint.h>
#include <stdlib.h>

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

/* One kernel per weight type: its one-row dot product, and the whole linear. */
#define DEFINE_LINEAR(NAME, WEIGHT)                                                        \
    static float NAME##_dot(const float *restrict a, const WEIGHT *restrict b, int64_t k) { \
        float acc = 0.0f;                                                                  \
        _Pragma("omp simd reduction(+ : acc)") for (int64_t i = 0; i < k; i++)             \
            acc += a[i] * (float)b[i];                                                     \
        return acc;                                                                        \
    }                                                                                      \
                                                                                           \
    void NAME(const float *x, const WEIGHT *w, const float *scale, const float *bias,       \
              float *y, int64_t m_rows, int64_t n_rows, int64_t k, int threads) {          \
        const int64_t tiles = (n_rows + TILE - 1) / TILE;                                  \
        _Pragma("omp parallel num_threads(threads)") {                                     \
            const int widen = sizeof(WEIGHT) != sizeof(float); /* else read in place */    \
            float *widened = m_rows > 1 && widen ? malloc(sizeof(float) * TILE * k) : NULL; \
            _Pragma("omp for schedule(static)") for (int64_t tile = 0; tile < tiles;       \
                                                     tile++) {                             \
                const int64_t first = tile * TILE;                                         \
                const int64_t count = n_rows - first < TILE ? n_rows - first : TILE;       \
                if (m_rows == 1 || (widen && widened == NULL) || count < TILE) {           \
                    for (int64_t n = first; n < first + count; n++) {                      \
                        float s = scale ? scale[n] : 1.0f, offset = bias ? bias[n] : 0.0f; \
                        for (int64_t m = 0; m < m_rows; m++)                               \
                            y[m * n_rows + n] = NAME##_dot(x + m * k, w + n * k, k) * s +   \
                                                offset;                                    \
                    }                                                                      \
                    continue;                                                              \
                }                                                                          \
                const WEIGHT *rows = w + first * k;                                        \
                const float *tile_w = (const float *)rows;                                 \
                if (widen) {                                                               \
                    _Pragma("omp simd") for (int64_t i = 0; i < TILE * k; i++) widened[i] = \
                        (float)rows[i];                                                    \
                    tile_w = widened;                                                      \
                }                                                                          \
                int64_t m = 0;                                                             \
                for (; m + 4 <= m_rows; m += 4)                                            \
                    dot_block(x + m * k, tile_w, k, y + m * n_rows + first, n_rows);      \
                for (; m < m_rows; m++)                                                    \
                    dot_tile(x + m * k, tile_w, k, y + m * n_rows + first);               \
                for (m = 0; m < m_rows; m++)                                               \
                    for (int64_t t = 0; t < TILE; t++) {                                   \
                        int64_t n = first + t;                                             \
                        y[m * n_rows + n] = y[m * n_rows + n] * (scale ? scale[n] : 1.0f) + \
                                            (bias ? bias[n] : 0.0f);                       \
                    }                                                                      \
            }                                                                              \
            free(widened);                                                                 \
        }                                                                                  \
    }

DEFINE_LINEAR(int8_linear, int8_t)
DEFINE_LINEAR(float_linear, float)
