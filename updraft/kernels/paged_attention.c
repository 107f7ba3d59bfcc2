/* Decode attention over a paged KV cache, read in place.

   One query token per request. Request b's context is positions [0, seq_lens[b]), or
   [starts[b], seq_lens[b]) where ``starts`` is given (a sliding window's); the
   K/V of position t live at slot block_table[b][t / block_size] * block_size +
   t % block_size of each cache, whose slots are slot_stride elements apart and hold
   kv_heads keys of head_dim and values of value_dim, head_stride elements apart. GQA
   caches are [num_slots, kv_heads, head_dim] each, in floats, or (an int8 cache) in
   rows of head_dim int8 codes and their float32 scale, [num_slots, kv_heads,
   head_dim + 4] bytes (paged_decode_attention_int8); a latent (MLA) cache is one
   [num_slots, width]
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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

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

/* Eight int8 codes widened to floats: with AVX2 one sign-extending load and one
   conversion (GCC lowers an 8-byte vector's __builtin_convertvector to a conversion per
   element, several times slower than the float rows it replaces); else one at a time. */
static inline vec8 widen8(const int8_t *p) {
#ifdef __AVX2__
    const __m256 wide = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    vec8 v;
    memcpy(&v, &wide, sizeof v);
    return v;
#else
    vec8 v;
    for (int i = 0; i < 8; i++) v[i] = (float)p[i];
    return v;
#endif
}

static inline float int8_row_scale(const int8_t *row, int64_t n) {
    float s;
    memcpy(&s, row + n, sizeof s);
    return s;
}

/* A float cache: paged_decode_attention. */
#define KV float
#define KV_NAME(name) name
#define KV_LOAD8(p) load8(p)
#define KV_SCALE(row, n) 1.0f
#include "paged_decode.h"
#undef KV
#undef KV_NAME
#undef KV_LOAD8
#undef KV_SCALE

/* An int8 cache (--kv-cache-dtype int8): paged_decode_attention_int8. Each head's row of
   a slot is its codes, then their float32 scale (attention/kv_int8.py). */
#define KV int8_t
#define KV_NAME(name) name##_int8
#define KV_LOAD8(p) widen8(p)
#define KV_SCALE(row, n) int8_row_scale(row, n)
#include "paged_decode.h"
#undef KV
#undef KV_NAME
#undef KV_LOAD8
#undef KV_SCALE

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

/* n floats at x as int8 codes at out, then their scale (a float32) right after them:
   scale = max |x| * (1 / 127), code = x * (127 / max |x|) rounded to nearest, ties to
   even (rintf in the default rounding mode); a row of zeros (or of values under 1e-30)
   is all codes 0 with its scale. attention/kv_int8.py's quantize_rows computes the same,
   bit for bit: the scale is a product, not a quotient, because -ffast-math may turn a
   division by a constant into that product anyway. */
static void quantize_row(const float *restrict x, int8_t *restrict out, int64_t n) {
    float top = 0.0f;
    for (int64_t i = 0; i < n; i++) top = fmaxf(top, fabsf(x[i]));
    const float scale = top * (1.0f / 127.0f);
    const float inverse = top > 1e-30f ? 127.0f / top : 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float code = rintf(x[i] * inverse);
        out[i] = (int8_t)fminf(fmaxf(code, -127.0f), 127.0f);
    }
    memcpy(out + n, &scale, sizeof scale);
}

/* write_kv into an int8 cache: row i of ``key`` and ``value`` (``heads`` rows of
   ``dim`` floats each, contiguous; rows ``key_stride`` / ``value_stride`` floats apart)
   goes to slot slot_mapping[i] modulo ``slots``, each head's row quantized with its own
   scale. A slot holds heads rows of dim codes and 4 scale bytes. */
void write_kv_int8(int8_t *cache, int64_t slots, int64_t heads, int64_t dim,
                   const float *key, int64_t key_stride, const float *value,
                   int64_t value_stride, const int64_t *slot_mapping, int64_t rows) {
    const int64_t row = dim + (int64_t)sizeof(float), slot_bytes = heads * row;
    int8_t *value_cache = cache + slots * slot_bytes;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t slot = ((slot_mapping[i] % slots) + slots) % slots;
        for (int64_t h = 0; h < heads; h++) {
            quantize_row(key + i * key_stride + h * dim, cache + slot * slot_bytes + h * row, dim);
            quantize_row(value + i * value_stride + h * dim,
                         value_cache + slot * slot_bytes + h * row, dim);
        }
    }
}
