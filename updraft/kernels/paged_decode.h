/* The decode-attention kernel over one kind of cache row, included by paged_attention.c
   once per kind. Before each inclusion the includer defines:

   KV            the element type of a cache row (float, or int8_t codes);
   KV_NAME(n)    the kind's name for function n;
   KV_LOAD8(p)   eight elements at p as floats (a vec8);
   KV_SCALE(r,n) what every element of the row r (n elements long) is multiplied by:
                 1 for floats, the float32 stored right after an int8 row's codes.

   A row's scale multiplies a finished dot product (a key) or a position's weight (a
   value) once, so reading int8 rows costs a widening per element and nothing per
   group of elements. Strides and offsets count elements of KV. */

/* out[i] = q . rows[i] for four rows, n % 8 == 0: four independent chains */
static void KV_NAME(dot4)(const float *restrict q, const KV *const rows[4], int64_t n,
                          float out[4]) {
    vec8 acc[4] = {{0}};
    for (int64_t d = 0; d < n; d += 8) {
        const vec8 x = load8(q + d);
        for (int i = 0; i < 4; i++) acc[i] += x * KV_LOAD8(rows[i] + d);
    }
    for (int i = 0; i < 4; i++) out[i] = sum8(acc[i]);
}

static float KV_NAME(dot)(const float *restrict a, const KV *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * (float)b[i];
    return acc;
}

/* o[c] = sum over t of p[t] * rows(t)[c] for columns [first, first + SLICE): the columns
   stay in registers across the positions */
static void KV_NAME(weighted_slice)(float *restrict o, const float *restrict p,
                                    const KV *values, const int64_t *slots, int64_t context,
                                    int64_t stride, int64_t value_dim, int64_t first) {
    vec8 acc[SLICE / 8] = {{0}};
    for (int64_t t = 0; t < context; t++) {
        if (slots[t] < 0) continue;
        const KV *head_row = values + slots[t] * stride;
        const float w = p[t] * KV_SCALE(head_row, value_dim);
        const vec8 weight = {w, w, w, w, w, w, w, w};
        for (int c = 0; c < SLICE / 8; c++) acc[c] += weight * KV_LOAD8(head_row + first + 8 * c);
    }
    memcpy(o + first, acc, sizeof acc);
}

static void KV_NAME(axpy)(float *restrict y, float a, const KV *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * (float)x[i];
}

void KV_NAME(paged_decode_attention)(const float *query, const KV *key_cache,
                                     const KV *value_cache, const int64_t *block_table,
                                     const int64_t *seq_lens, const int64_t *starts,
                                     float *out, float *lse, int64_t requests, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, int64_t value_dim,
                                     int64_t head_stride, int64_t slot_stride,
                                     int64_t max_blocks, int64_t block_size, int64_t num_slots,
                                     float scale, int threads) {
    /* 0: OpenMP's count at the call, which the engine lowers while other processes keep
       cores busy; a launch bound in a captured graph passes it, as the linears do */
    if (threads <= 0) threads = omp_get_max_threads();
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
               reads slot 0's row (always in the cache) and is masked after */
            int64_t t = 0;
            if (head_dim % 8 == 0)
                for (; t + 4 <= context; t += 4)
                    for (int64_t kh = 0; kh < last - first; kh++) {
                        const KV *rows[4];
                        float row_scales[4];
                        for (int i = 0; i < 4; i++) {
                            const int64_t slot = slots[t + i] < 0 ? 0 : slots[t + i];
                            rows[i] = key_cache + slot * slot_stride + (first + kh) * head_stride;
                            row_scales[i] = KV_SCALE(rows[i], head_dim) * scale;
                        }
                        for (int64_t g = 0; g < group; g++) {
                            const int64_t h = kh * group + g;
                            float dots[4];
                            KV_NAME(dot4)(q + h * head_dim, rows, head_dim, dots);
                            for (int i = 0; i < 4; i++)
                                scores[h * context + t + i] =
                                    slots[t + i] < 0 ? MASKED : dots[i] * row_scales[i];
                        }
                    }
            for (; t < context; t++) {
                for (int64_t h = 0; h < item_heads; h++) scores[h * context + t] = MASKED;
                if (slots[t] < 0) continue;
                for (int64_t kh = 0; kh < last - first; kh++) {
                    const KV *row = key_cache + slots[t] * slot_stride + (first + kh) * head_stride;
                    const float row_scale = KV_SCALE(row, head_dim) * scale;
                    for (int64_t g = 0; g < group; g++) {
                        int64_t h = kh * group + g;
                        scores[h * context + t] =
                            KV_NAME(dot)(q + h * head_dim, row, head_dim) * row_scale;
                    }
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
                        KV_NAME(weighted_slice)(o + h * value_dim, scores + h * context,
                                                value_cache + (first + kh) * head_stride,
                                                slots, context, slot_stride, value_dim, c);
                }
            for (int64_t t = 0; sliced < value_dim && t < context; t++) {
                if (slots[t] < 0) continue;
                for (int64_t kh = 0; kh < last - first; kh++) {
                    const KV *row = value_cache + slots[t] * slot_stride + (first + kh) * head_stride;
                    const float row_scale = KV_SCALE(row, value_dim);
                    for (int64_t g = 0; g < group; g++) {
                        int64_t h = kh * group + g;
                        KV_NAME(axpy)(o + h * value_dim + sliced,
                                      scores[h * context + t] * row_scale, row + sliced,
                                      value_dim - sliced);
                    }
                }
            }
        }
        free(scores);
        free(slots);
    }
}
