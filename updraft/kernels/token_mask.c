/* Constrained decoding's mask on the logits, in place: in each of ``num_rows`` rows
   (``rows[i]`` of ``logits`` [*, vocab]), every token whose bit in ``bitmask[i]`` (one
   bit per token, ``words`` int32 words, bit t % 32 of word t / 32) is clear, and every
   token past the bitmask's ``words * 32``, becomes -inf. A constrained row allows few
   tokens, so most words are 0: those fill 32 logits at once. Rows outside the logits
   are skipped, so memory stays safe even if a caller passes a bad row. */

#include <stdint.h>
#include <string.h>

/* -inf by its bits: the kernels build with -ffast-math, which assumes no infinities
   in arithmetic; a store of the bits is no arithmetic. */
static const uint32_t MINUS_INF = 0xff800000u;

static void forbid(float *logits, int64_t from, int64_t to) {
    for (int64_t t = from; t < to; t++) memcpy(logits + t, &MINUS_INF, sizeof MINUS_INF);
}

void mask_logits(float *logits, int64_t num_logit_rows, int64_t vocab, const int64_t *rows,
                 int64_t num_rows, const int32_t *bitmask, int64_t words, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < num_rows; i++) {
        if (rows[i] < 0 || rows[i] >= num_logit_rows) continue;
        float *row = logits + rows[i] * vocab;
        const uint32_t *bits = (const uint32_t *)bitmask + i * words;
        const int64_t covered = words * 32 < vocab ? words * 32 : vocab;
        for (int64_t w = 0; w * 32 < covered; w++) {
            const uint32_t word = bits[w];
            const int64_t first = w * 32, end = first + 32 < covered ? first + 32 : covered;
            if (word == 0xffffffffu) continue;
            if (word == 0) {
                forbid(row, first, end);
                continue;
            }
            for (int64_t t = first; t < end; t++)
                if (!((word >> (t - first)) & 1u)) forbid(row, t, t + 1);
        }
        forbid(row, covered, vocab);
    }
}
