/* AVX2 prefill (no VNNI) over a Q4_0, Q8_0, Q4_K, Q5_K or Q6_K group unpacked once: a
   thread builds a group's codes, scales and d once into a scratch of its own
   (unpacked_*), then passes every row of x over that scratch (over_unpacked_*), where
   the tile kernels (group_*) built the same codes again for every tile of 8 rows. Rows
   of x go 4 at a time, and each word of codes is loaded once for the 4 (pair_sums_rows):
   a word loaded per row made two 256-bit loads per 32 byte products, and the loads,
   not the multiplies, bound the kernels. The integer sums and the float order are
   group_*'s, so a row's result is the same bits; each kernel here is its group_* twin
   with the codes read, not built, and a change to one is a change to the other. */

#if INT8_SIMD && !INT8_VNNI

/* Where each of a kernel's rows of x starts in x's arrays */
typedef struct {
    const int8_t *codes[MAX_X_ROWS];
    const float *scales[MAX_X_ROWS];
    const int32_t *sums32[MAX_X_ROWS];
    const int32_t *offsets16[MAX_X_ROWS];
    const float *scaled_sums[MAX_X_ROWS];
    const int32_t *minus8[MAX_X_ROWS];
} row_starts;

static inline __attribute__((always_inline)) row_starts starts_of(const rounded_x *x, int rows) {
    row_starts at;
    for (int m = 0; m < rows; m++) {
        at.codes[m] = x->codes + m * x->k;
        at.scales[m] = x->scales + m * (x->k / 32);
        at.sums32[m] = x->sums32 + m * (x->k / 32);
        at.offsets16[m] = x->offsets16 + m * (x->k / 16);
        at.scaled_sums[m] = x->scaled_sums + m * (x->k / 32);
        at.minus8[m] = x->minus8 + m * (x->k / 32);
    }
    return at;
}

/* pair_sums for ``rows`` rows of x at once, each at its own start plus ``offset``: a
   word of codes is loaded once for all the rows. Loaded per row, as pair_sums over each
   row in turn has it, every 32 byte products took two 256-bit loads (the word and x's
   broadcast codes), and the loads bound the kernels at half the multiply ports' rate. The
   int16 sums are pair_sums', added in the same order. */
static inline __attribute__((always_inline)) void pair_sums_rows(const __m256i *u,
                                                                 const int8_t *const *v,
                                                                 int64_t offset, int rows,
                                                                 int count, __m256i *pairs) {
    for (int t = 0; t < count; t++) {
        const __m256i word = _mm256_load_si256(u + t);
        for (int m = 0; m < rows; m++) {
            const __m256i products = _mm256_maddubs_epi16(word, broadcast4(v[m] + offset + 4 * t));
            pairs[m] = t ? _mm256_add_epi16(pairs[m], products) : products;
            KEEP_IN_REGISTER(pairs[m]);
        }
    }
}

/* __m256i slots of one Q6_K block in the scratch: 64 words of codes (x block j = 4 half
   + q, part, word u: slot 8 j + 4 part + u), 16 of scales (scale_pairs' form), d */
#define Q6_K_SLOTS (64 + 16 + 1)

static void unpacked_q6_k(const uint8_t *group, int64_t blocks, __m256i *out) {
    for (int64_t b = 0; b < blocks; b++, out += Q6_K_SLOTS) {
        const uint8_t *gb = group + 1680 * b;
        for (int half = 0; half < 2; half++)
            for (int q = 0; q < 4; q++)
                for (int word = 0; word < 8; word++) {
                    const __m256i ql = load32(gb + 144 + 32 * (16 * half + word + 8 * (q % 2)));
                    const __m256i qh = load32(gb + 1168 + 32 * (8 * half + word));
                    _mm256_store_si256(out + 8 * (4 * half + q) + word, q6_k_quarter(ql, qh, q));
                }
        for (int s = 0; s < 16; s++) _mm256_store_si256(out + 64 + s, scale_pairs(gb + 16 + 8 * s, 1));
        _mm256_store_ps((float *)(out + 80), halves(gb));
    }
}

/* group_q6_k's sums over an unpacked_q6_k scratch, for ``rows`` rows of x */
static inline __attribute__((always_inline)) void over_unpacked_q6_k(const __m256i *unpacked,
                                                                     int64_t blocks,
                                                                     const rounded_x *x,
                                                                     int rows, __m256 *acc) {
    const row_starts at = starts_of(x, rows);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, unpacked += Q6_K_SLOTS) {
        __m256 sum[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) {
            __m256i exact[MAX_X_ROWS];
            for (int m = 0; m < rows; m++) exact[m] = _mm256_setzero_si256();
            for (int part = 0; part < 2; part++) {
                const __m256i *words = unpacked + 8 * j + 4 * part;
                const __m256i scale = _mm256_load_si256(unpacked + 64 + 2 * j + part);
                __m256i pairs[MAX_X_ROWS];
                pair_sums_rows(words, at.codes, 256 * b + 32 * j + 16 * part, rows, 4, pairs);
                for (int m = 0; m < rows; m++) {
                    const __m256i offset = _mm256_set1_epi32(at.offsets16[m][16 * b + 2 * j + part]);
                    exact[m] = _mm256_add_epi32(
                        exact[m], _mm256_madd_epi16(_mm256_sub_epi16(pairs[m], offset), scale));
                }
            }
            for (int m = 0; m < rows; m++) {
                const __m256 xd = _mm256_set1_ps(at.scales[m][8 * b + j]);
                sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact[m]), xd, sum[m]);
            }
        }
        const __m256 d = _mm256_load_ps((const float *)(unpacked + 80));
        for (int m = 0; m < rows; m++) acc[m] = _mm256_fmadd_ps(sum[m], d, acc[m]);
    }
}

/* __m256i slots of one Q4_K or Q5_K block in the scratch: 64 words of codes (sub-block
   j, word t: slot 8 j + t), 8 of scales (scale_pairs' form), 8 of minimums (floats), d,
   dmin */
#define K32_SLOTS (64 + 8 + 8 + 2)

/* Q4_K's (fifth 0) or Q5_K's (fifth 1) codes, scales and minimums, as group_q4_k and
   group_q5_k build them */
static void unpacked_k32(const uint8_t *group, int64_t blocks, int fifth, __m256i *out) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const int64_t block_bytes = fifth ? 1440 : 1184, codes_at = fifth ? 416 : 160;
    for (int64_t b = 0; b < blocks; b++, out += K32_SLOTS) {
        const uint8_t *gb = group + block_bytes * b;
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            for (int t = 0; t < 8; t++) {
                const __m256i raw = load32(gb + codes_at + 32 * (8 * (j / 2) + t));
                __m256i codes = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, nibble);
                if (fifth) codes = _mm256_or_si256(codes, q5_k_fifth(load32(gb + 160 + 32 * t), j));
                _mm256_store_si256(out + 8 * j + t, codes);
            }
        for (int j = 0; j < 8; j++) {
            _mm256_store_si256(out + 64 + j, scale_pairs(gb + 32 + 8 * j, 0));
            const __m128i mins = _mm_loadl_epi64((const __m128i *)(gb + 96 + 8 * j));
            _mm256_store_ps((float *)(out + 72 + j), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins)));
        }
        _mm256_store_ps((float *)(out + 80), halves(gb));
        _mm256_store_ps((float *)(out + 81), halves(gb + 16));
    }
}

/* group_q4_k's (fifth 0) or group_q5_k's sums over an unpacked_k32 scratch, for ``rows``
   rows of x */
static inline __attribute__((always_inline)) void over_unpacked_k32(const __m256i *unpacked,
                                                                    int64_t blocks, int fifth,
                                                                    const rounded_x *x,
                                                                    int rows, __m256 *acc) {
    const row_starts at = starts_of(x, rows);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, unpacked += K32_SLOTS) {
        __m256 sum[MAX_X_ROWS], mins[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = mins[m] = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) {
            const __m256i *words = unpacked + 8 * j;
            const __m256i scale = _mm256_load_si256(unpacked + 64 + j);
            const __m256 min = _mm256_load_ps((const float *)(unpacked + 72 + j));
            /* pair sums of at most 8 * 2 * 15 * 127 (Q4_K), or 4 * 2 * 31 * 127 a half */
            __m256i low[MAX_X_ROWS], high[MAX_X_ROWS];
            pair_sums_rows(words, at.codes, 256 * b + 32 * j, rows, fifth ? 4 : 8, low);
            if (fifth) pair_sums_rows(words + 4, at.codes, 256 * b + 32 * j + 16, rows, 4, high);
            for (int m = 0; m < rows; m++) {
                const __m256i exact =
                    fifth ? _mm256_add_epi32(_mm256_madd_epi16(low[m], scale), _mm256_madd_epi16(high[m], scale))
                          : _mm256_madd_epi16(low[m], scale);
                const float xd = at.scales[m][8 * b + j];
                sum[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(xd), sum[m]);
                mins[m] = _mm256_fmadd_ps(min, _mm256_set1_ps(at.scaled_sums[m][8 * b + j]), mins[m]);
            }
        }
        const __m256 d = _mm256_load_ps((const float *)(unpacked + 80));
        const __m256 dmin = _mm256_load_ps((const float *)(unpacked + 81));
        for (int m = 0; m < rows; m++)
            acc[m] = _mm256_fnmadd_ps(mins[m], dmin, _mm256_fmadd_ps(sum[m], d, acc[m]));
    }
}

/* __m256i slots of one Q4_0 block in the scratch: 8 words of codes (nibble_words'), d */
#define Q4_0_SLOTS (8 + 1)

static void unpacked_q4_0(const uint8_t *group, int64_t blocks, __m256i *out) {
    for (int64_t b = 0; b < blocks; b++, out += Q4_0_SLOTS) {
        const uint8_t *gb = group + 144 * b;
        __m256i codes[8];
        nibble_words(gb + 16, codes);
        for (int t = 0; t < 8; t++) _mm256_store_si256(out + t, codes[t]);
        _mm256_store_ps((float *)(out + 8), halves(gb));
    }
}

/* group_q4_0's sums over an unpacked_q4_0 scratch, for ``rows`` rows of x */
static inline __attribute__((always_inline)) void over_unpacked_q4_0(const __m256i *unpacked,
                                                                     int64_t blocks,
                                                                     const rounded_x *x,
                                                                     int rows, __m256 *acc) {
    const row_starts at = starts_of(x, rows);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, unpacked += Q4_0_SLOTS) {
        const __m256 d = _mm256_load_ps((const float *)(unpacked + 8));
        /* eight pair sums of at most 2 * 15 * 127 fit an int16; codes 0..15 stand for
           -8..7 */
        __m256i pairs[MAX_X_ROWS];
        pair_sums_rows(unpacked, at.codes, 32 * b, rows, 8, pairs);
        for (int m = 0; m < rows; m++) {
            const __m256i sum = _mm256_add_epi32(pairs_to_int32(pairs[m]),
                                                 _mm256_set1_epi32(at.minus8[m][b]));
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(at.scales[m][b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[m]);
        }
    }
}

/* __m256i slots of one Q8_0 block in the scratch: 8 words of |code|, 8 of the codes
   (whose signs move onto x, as group_q8_0 has it), d */
#define Q8_0_SLOTS (8 + 8 + 1)

static void unpacked_q8_0(const uint8_t *group, int64_t blocks, __m256i *out) {
    for (int64_t b = 0; b < blocks; b++, out += Q8_0_SLOTS) {
        const uint8_t *gb = group + 272 * b;
        for (int t = 0; t < 8; t++) {
            const __m256i w = load32(gb + 16 + 32 * t);
            _mm256_store_si256(out + t, _mm256_sign_epi8(w, w));
            _mm256_store_si256(out + 8 + t, w);
        }
        _mm256_store_ps((float *)(out + 16), halves(gb));
    }
}

/* group_q8_0's sums over an unpacked_q8_0 scratch, for ``rows`` rows of x */
static inline __attribute__((always_inline)) void over_unpacked_q8_0(const __m256i *unpacked,
                                                                     int64_t blocks,
                                                                     const rounded_x *x,
                                                                     int rows, __m256 *acc) {
    const row_starts at = starts_of(x, rows);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, unpacked += Q8_0_SLOTS) {
        __m256i sum[MAX_X_ROWS];
        for (int m = 0; m < rows; m++) sum[m] = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) {
            const __m256i magnitude = _mm256_load_si256(unpacked + t);
            const __m256i w = _mm256_load_si256(unpacked + 8 + t);
            for (int m = 0; m < rows; m++) {
                /* a pair sum of at most 2 * 128 * 127 */
                const __m256i v = _mm256_sign_epi8(broadcast4(at.codes[m] + 32 * b + 4 * t), w);
                sum[m] = dot_u8s8(sum[m], magnitude, v);
                KEEP_IN_REGISTER(sum[m]);
            }
        }
        const __m256 d = _mm256_load_ps((const float *)(unpacked + 16));
        for (int m = 0; m < rows; m++) {
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(at.scales[m][b]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), scale, acc[m]);
        }
    }
}

#endif
