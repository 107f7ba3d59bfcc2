/* Routed experts of a mixture-of-experts MLP, over rows already grouped by expert.

   Rows [offsets[e], offsets[e + 1]) of x go to expert e: h = silu(x W_gate^T) * (x W_up^T)
   with gate_up[e] = [W_gate; W_up] ([2 * inter, hidden]), then out = h W_down^T with
   down[e] [hidden, inter]. Each expert's weights are streamed once, whatever its row
   count, and an expert with no rows is not read at all: the work follows the tokens
   routed, not the number of experts. Offsets outside [0, rows] are clamped, so memory
   stays safe even if a caller passes inconsistent ones. */

#include <math.h>
#include <stdint.h>

static float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static int64_t clamp(int64_t value, int64_t low, int64_t high) {
    return value < low ? low : (value > high ? high : value);
}

void grouped_mlp(const float *x, const int64_t *offsets, const float *gate_up,
                 const float *down, float *h, float *out, int64_t rows, int64_t experts,
                 int64_t hidden, int64_t inter, int threads) {
    for (int64_t e = 0; e < experts; e++) {
        const int64_t first = clamp(offsets[e], 0, rows);
        const int64_t last = clamp(offsets[e + 1], first, rows);
        if (first == last) continue;
        const float *gate = gate_up + e * 2 * inter * hidden;
        const float *up = gate + inter * hidden;
        const float *w_down = down + e * hidden * inter;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t j = 0; j < inter; j++) {
            for (int64_t r = first; r < last; r++) {
                float a = dot(x + r * hidden, gate + j * hidden, hidden);
                float b = dot(x + r * hidden, up + j * hidden, hidden);
                h[r * inter + j] = a / (1.0f + expf(-a)) * b;
            }
        }
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t c = 0; c < hidden; c++) {
            for (int64_t r = first; r < last; r++)
                out[r * hidden + c] = dot(h + r * inter, w_down + c * inter, inter);
        }
    }
}
