/* Decode attention over a paged KV cache, read in place.

   One query token per request. Request b's context is positions [0, seq_lens[b]), or
   [starts[b], seq_lens[b]) where ``starts`` is given (a sliding window's); the
   K/V of position t live at slot block_table[b][t / block_size] * block_size +
   t % block_size of each cache, whose slots are slot_stride floats apart and hold
   kv_heads keys of head_dim and values of value_dim. GQA caches are
   [num_slots, kv_heads, head_dim] each; a latent (MLA) cache is one [num_slots, width]
   tensor read as one KV head whose key is the first head_dim columns of a row and whose
   value is the first value_dim of the same row. Each K/V row is read once,
   whole (every KV head) and in order, for all the query heads of a work item: a request,
   or a request's single KV head when there are fewer requests than threads.

   With ``lse`` (not NULL), each head's log-sum-exp of its scaled scores goes there
   [requests, heads] too, MASKED where nothing was read: what merging attention over
   shards of a context (decode context parallelism) weighs each shard by.

   A request with no context (a padding row) gets zeros. A slot outside the cache (a
   block id of -1 where the context says a position exists) is skipped rather than read:
   memory stays safe even if a caller passes an inconsistent step. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The score of a position not read: finite (the build assumes no infinities) and so
   low that its exp is 0 next to any real score. */
#define MASKED (-1e30f)

/* Eight floats as one vector (GCC's vector extension: AVX2's ymm, or two of SSE's).
   A decode step's attention is a few thousand dot products and multiply-adds of 64
   values: written one at a time, each dot product's additions made one chain, and each
   multiply-add stored the output a position had just written (a store, then a load of
   it, per position and head). Several positions' dot products at once, and an output's
   columns kept in registers across the positions, run about 3x faster. */
typedef float vec8 __attribute__((vector_size(32)));
#define SLICE 64 /* output columns kept in registers: 8 vectors */

static inline vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum8(vec8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* out[i] = q . rows[i] for four rows, n % 8 == 0: four independent chains */
static void dot4(const float *restrict q, const float *const rows[4], int64_t n, float out[4]) {
    vec8 acc[4] = {{0}};
    for (int64_t d = 0; d < n; d += 8) {
        const vec8 x = load8(q + d);
        for (int i = 0; i < 4; i++) acc[i] += x * load8(rows[i] + d);
    }
    for (int i = 0; i < 4; i++) out[i] = sum8(acc[i]);
}

static float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* o[c] = sum over t of p[t] * rows(t)[c] for columns [first, first + SLICE): the columns
   stay in registers across the positions */
static void weighted_slice(float *restrict o, const float *restrict p, const float *values,
                           const int64_t *slots, int64_t context, int64_t stride,
                           int64_t first) {
    vec8 acc[SLICE / 8] = {{0}};
    for (int64_t t = 0; t < context; t++) {
        if (slots[t] < 0) continue;
        const float *row = values + slots[t] * stride + first;
        const vec8 weight = {p[t], p[t], p[t], p[t], p[t], p[t], p[t], p[t]};
        for (int c = 0; c < SLICE / 8; c++) acc[c] += weight * load8(row + 8 * c);
    }
    memcpy(o + first, acc, sizeof acc);
}

static void axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

void paged_decode_attention(const float *query, const float *key_cache,
                            const float *value_cache, const int64_t *block_table,
                            const int64_t *seq_lens, const int64_t *starts,
                            float *out, float *lse,
                            int64_t requests,
                            int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t value_dim, int64_t slot_stride, int64_t max_blocks,
                            int64_t block_size, int64_t num_slots, float scale,
                            int threads) {
    const int64_t group = heads / kv_heads;
    /* A work item is a request's KV heads [first, last): all of them when there are
       requests enough to share out, so each K/V row is read whole and in order; one
       each otherwise, so a lone request still uses every thread. */
    const int64_t split = requests >= threads ? 1 : kv_heads;
    const int64_t per_item = kv_heads / split;
#pragma omp parallel num_threads(threads)
    {
        int64_t capacity = 0;
        float *scores = NULL; /* [heads of the item, context] */
        int64_t *slots = NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < requests * split; item++) {
            const int64_t b = item / split;
            const int64_t first = (item % split) * per_item, last = first + per_item;
            const int64_t item_heads = (last - first) * group;
            const int64_t start = starts && starts[b] > 0 ? starts[b] : 0;
            /* positions [start, start + context) are read; score u is position start + u */
            const int64_t context = seq_lens[b] > start ? seq_lens[b] - start : 0;
            float *o = out + (b * heads + first * group) * value_dim;
            memset(o, 0, sizeof(float) * item_heads * value_dim);
            float *item_lse = lse ? lse + b * heads + first * group : NULL;
            if (item_lse)
                for (int64_t h = 0; h < item_heads; h++) item_lse[h] = MASKED;
            if (context == 0) continue;
            if (context > capacity) {
                free(scores);
                free(slots);
                scores = malloc(sizeof(float) * heads * context);
                slots = malloc(sizeof(int64_t) * context);
                capacity = (scores && slots) ? context : 0;
                if (capacity == 0) continue; /* out of memory: zeros, not a crash */
            }
            for (int64_t u = 0; u < context; u++) {
                const int64_t position = start + u;
                const int64_t block = block_table[b * max_blocks + position / block_size];
                const int64_t slot = block * block_size + position % block_size;
                slots[u] = (block < 0 || slot >= num_slots) ? -1 : slot;
            }
            const float *q = query + (b * heads + first * group) * head_dim;
            /* scores: four positions at a time (each K row read for every head of the
               item while it is in cache), the rest one at a time; a skipped position
               reads the query itself and is masked after */
            int64_t t = 0;
            if (head_dim % 8 == 0)
                for (; t + 4 <= context; t += 4)
                    for (int64_t kh = 0; kh < last - first; kh++)
                        for (int64_t g = 0; g < group; g++) {
                            const int64_t h = kh * group + g;
                            const float *rows[4];
                            for (int i = 0; i < 4; i++)
                                rows[i] = slots[t + i] < 0 ? q + h * head_dim
                                                           : key_cache + slots[t + i] * slot_stride +
                                                                 (first + kh) * head_dim;
                            float dots[4];
                            dot4(q + h * head_dim, rows, head_dim, dots);
                            for (int i = 0; i < 4; i++)
                                scores[h * context + t + i] =
                                    slots[t + i] < 0 ? MASKED : dots[i] * scale;
                        }
            for (; t < context; t++) {
                for (int64_t h = 0; h < item_heads; h++) scores[h * context + t] = MASKED;
                if (slots[t] < 0) continue;
                const float *row = key_cache + slots[t] * slot_stride + first * head_dim;
                for (int64_t kh = 0; kh < last - first; kh++)
                    for (int64_t g = 0; g < group; g++) {
                        int64_t h = kh * group + g;
                        scores[h * context + t] =
                            dot(q + h * head_dim, row + kh * head_dim, head_dim) * scale;
                    }
            }
            for (int64_t h = 0; h < item_heads; h++) {
                float *s = scores + h * context;
                float top = MASKED;
                for (int64_t t = 0; t < context; t++)
                    if (s[t] > top) top = s[t];
                /* a skipped position's exp underflows to 0: no branch, so the loop
                   vectorises (the kernel is built with -ffast-math, no infinities) */
                float total = 0.0f;
#pragma omp simd reduction(+ : total)
                for (int64_t t = 0; t < context; t++) {
                    s[t] = expf(s[t] - top);
                    total += s[t];
                }
                float inverse = total > 0.0f ? 1.0f / total : 0.0f;
                if (item_lse && total > 0.0f) item_lse[h] = top + logf(total);
#pragma omp simd
                for (int64_t t = 0; t < context; t++) s[t] *= inverse;
            }
            /* values: a head's output SLICE columns at a time, in registers; the rest
               of a head's columns (value_dim % SLICE) one position at a time */
            const int64_t sliced = value_dim / SLICE * SLICE;
            for (int64_t kh = 0; kh < last - first; kh++)
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = kh * group + g;
                    for (int64_t c = 0; c < sliced; c += SLICE)
                        weighted_slice(o + h * value_dim, scores + h * context,
                                       value_cache + (first + kh) * value_dim, slots, context,
                                       slot_stride, c);
                }
            for (int64_t t = 0; sliced < value_dim && t < context; t++) {
                if (slots[t] < 0) continue;
                const float *row = value_cache + slots[t] * slot_stride + first * value_dim;
                for (int64_t kh = 0; kh < last - first; kh++)
                    for (int64_t g = 0; g < group; g++) {
                        int64_t h = kh * group + g;
                        axpy(o + h * value_dim + sliced, scores[h * context + t],
                             row + kh * value_dim + sliced, value_dim - sliced);
                    }
            }
        }
        free(scores);
        free(slots);
    }
}

/* The step's keys and values into the cache: row i of ``key`` and of ``value`` (each
   ``row_bytes`` long, ``key_stride`` / ``value_stride`` bytes apart) goes to slot
   slot_mapping[i] modulo ``slots`` of the key and the value cache (each ``slots`` rows
   of ``row_bytes``, one after the other). The modulo is Python's: slot -1, a padding
   row's, is the spare last slot, and no slot lies outside the cache. */
void write_kv(char *cache, int64_t slots, int64_t row_bytes, const char *key,
              int64_t key_stride, const char *value, int64_t value_stride,
              const int64_t *slot_mapping, int64_t rows) {
    char *value_cache = cache + slots * row_bytes;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t slot = ((slot_mapping[i] % slots) + slots) % slots;
        memcpy(cache + slot * row_bytes, key + i * key_stride, (size_t)row_bytes);
        memcpy(value_cache + slot * row_bytes, value + i * value_stride, (size_t)row_bytes);
    }
}
