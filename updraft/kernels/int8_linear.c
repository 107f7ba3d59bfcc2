/* Weight-only int8 linear for the CPU: y = x @ (w * scale)^T + bias.

   x [M, K] float32, w [N, K] int8 (one scale per output row), y [M, N] float32.
   Decode reads each weight once per token, so a step is bound by weight bytes: int8
   weights are a quarter of float32's. Each weight row is widened to float once, into a
   buffer that stays in L1, and then serves all M rows of x. Output rows are split over
   the OpenMP threads. */

#include <stdint.h>
#include <stdlib.h>

static float dot(const float *restrict a, const float *restrict b, int64_t k) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < k; i++) acc += a[i] * b[i];
    return acc;
}

static float dot_int8(const float *restrict a, const int8_t *restrict b, int64_t k) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < k; i++) acc += a[i] * (float)b[i];
    return acc;
}

void int8_linear(const float *x, const int8_t *w, const float *scale, const float *bias,
                 float *y, int64_t m_rows, int64_t n_rows, int64_t k, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *widened = m_rows > 1 ? malloc(sizeof(float) * k) : NULL;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < n_rows; n++) {
            const int8_t *row = w + n * k;
            float offset = bias ? bias[n] : 0.0f;
            if (m_rows == 1 || widened == NULL) {  /* no buffer: widen per row of x */
                for (int64_t m = 0; m < m_rows; m++)
                    y[m * n_rows + n] = dot_int8(x + m * k, row, k) * scale[n] + offset;
                continue;
            }
#pragma omp simd
            for (int64_t i = 0; i < k; i++) widened[i] = (float)row[i];
            for (int64_t m = 0; m < m_rows; m++)
                y[m * n_rows + n] = dot(x + m * k, widened, k) * scale[n] + offset;
        }
        free(widened);
    }
}
