/* Matrix-vector-bound linear layers for the CPU: y = x @ (w * scale)^T + bias.

   x [M, K] float32, w [N, K] (float32, or int8 with one scale per output row),
   y [M, N] float32. A decode step with few rows reads every weight once and does little
   else, so what counts is reading w at the memory's full speed: each thread streams
   whole rows of w, in order. With one row of x, each weight row is used as it is read.
   With more, four weight rows at a time are widened to float into a buffer that stays
   in L1, and each row of x meets all four in one pass, so one load of x serves four
   multiply-adds. Output rows are split over the OpenMP threads. */

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
            float *widened = m_rows > 1 ? malloc(sizeof(float) * TILE * k) : NULL;         \
            _Pragma("omp for schedule(static)") for (int64_t tile = 0; tile < tiles;       \
                                                     tile++) {                             \
                const int64_t first = tile * TILE;                                         \
                const int64_t count = n_rows - first < TILE ? n_rows - first : TILE;       \
                if (m_rows == 1 || widened == NULL || count < TILE) {                      \
                    for (int64_t n = first; n < first + count; n++) {                      \
                        float s = scale ? scale[n] : 1.0f, offset = bias ? bias[n] : 0.0f; \
                        for (int64_t m = 0; m < m_rows; m++)                               \
                            y[m * n_rows + n] = NAME##_dot(x + m * k, w + n * k, k) * s +   \
                                                offset;                                    \
                    }                                                                      \
                    continue;                                                              \
                }                                                                          \
                const WEIGHT *rows = w + first * k;                                        \
                _Pragma("omp simd") for (int64_t i = 0; i < TILE * k; i++) widened[i] =    \
                    (float)rows[i];                                                        \
                for (int64_t m = 0; m < m_rows; m++) {                                     \
                    float out[TILE];                                                       \
                    dot_tile(x + m * k, widened, k, out);                                  \
                    for (int64_t t = 0; t < TILE; t++) {                                   \
                        int64_t n = first + t;                                             \
                        y[m * n_rows + n] =                                                \
                            out[t] * (scale ? scale[n] : 1.0f) + (bias ? bias[n] : 0.0f);  \
                    }                                                                      \
                }                                                                          \
            }                                                                              \
            free(widened);                                                                 \
        }                                                                                  \
    }

DEFINE_LINEAR(int8_linear, int8_t)
DEFINE_LINEAR(float_linear, float)
