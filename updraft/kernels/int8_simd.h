/* The pieces every type's kernel is made of. INT8_SIMD: this build has AVX2, F16C and
   FMA, and each type's group kernel is built; INT8_VNNI: it also has vpdpbusd (AVX512-VNNI
   with VL, or AVX-VNNI), which multiplies four bytes and adds them into an int32 in one
   instruction. Without INT8_SIMD only the portable kernel (gguf_int8.c, over each type's
   unpack_) is built. */
#ifndef UPDRAFT_INT8_SIMD_H
#define UPDRAFT_INT8_SIMD_H

#include <stdint.h>
#include <string.h>

/* copies ``size`` bytes between a file block and its place in a group-block, in the
   direction ``to_group`` picks, so that grouping and ungrouping can never disagree */
static inline void move_bytes(uint8_t *block, int block_at, uint8_t *group, int64_t group_at,
                              int size, int to_group) {
    if (to_group)
        memcpy(group + group_at, block + block_at, (size_t)size);
    else
        memcpy(block + block_at, group + group_at, (size_t)size);
}

/* byte j of row r's codes in a group-block whose codes start at ``at``, interleaved four
   bytes at a time (a 32-byte word holds bytes 4t..4t+3 of each of the eight rows) */
static inline uint8_t word_byte(const uint8_t *group, int at, int r, int j) {
    return group[at + 32 * (j / 4) + 4 * r + j % 4];
}

/* the fp16 at p, exactly, in plain C (the portable unpack_ functions' scales) */
static inline float half_value(const uint8_t *p) {
    const uint32_t h = (uint32_t)(p[0] | (p[1] << 8)), sign = (h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F)
        bits = sign | 0x7F800000 | (mantissa << 13);
    else if (exponent != 0)
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else if (mantissa == 0)
        bits = sign;
    else { /* a subnormal half is a normal float */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define INT8_SIMD 1
#include <immintrin.h>

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define INT8_VNNI 1
#else
#define INT8_VNNI 0
#endif

/* acc + the sums of four adjacent products of u's unsigned bytes and s's signed ones, per
   32-bit lane (vpdpbusd). Without VNNI: vpmaddubsw, whose pair sums saturate an int16,
   so a caller keeps each pair sum |u| * |s| * 2 under 32768. */
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* A thread reads its groups as one stream, which the hardware prefetcher follows too
   closely to keep the memory busy: each group-block asks for the lines of the one a
   few KB on into the L2. On the whole-model pass of a 100M Q4_0, Q4_K_M or Q8_0 file
   that took a fifth off (3 KB, the best of 1.5 to 12 KB ahead, about level beyond). */
#define AHEAD 3072
static inline __attribute__((always_inline)) void fetch_ahead(const uint8_t *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)(p + AHEAD + i), _MM_HINT_T1);
}

/* four bytes, in every lane */
static inline __m256i broadcast4(const int8_t *p) {
    int32_t word;
    memcpy(&word, p, 4);
    return _mm256_set1_epi32(word);
}

static inline __m256 halves(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* An empty asm that says it changes ``value``: the compiler must hold it in a register
   at that point. In the kernels' chains of int16 adds, gcc otherwise reassociates the
   sums, keeps every product of a block live at once and spills them to the stack (the
   AVX2 unpacked prefill ran at half its rate for that, int8_unpacked.h). */
#define KEEP_IN_REGISTER(value) __asm__("" : "+x"(value))
/* two at one point: row_k's pair of sums, whose adds gcc ordered differently (and a
   one-row Q5_K decode ran about 2% slower) as two statements */
#define KEEP_BOTH_IN_REGISTERS(a, b) __asm__("" : "+x"(a), "+x"(b))

/* vpmaddubsw's pair sums of ``count`` words (u[t]: four unsigned codes of each of the
   eight rows; v + 4 t: x's four matching codes, broadcast to every lane), added as int16
   with no int32 stage: the caller keeps their total in range (or, as Q6_K does, lets it
   wrap and come back); ``pinned``: the sum kept in its register after each add */
static inline __attribute__((always_inline)) __m256i sum_pairs(const __m256i *u,
                                                                const int8_t *v, int count,
                                                                int pinned) {
    __m256i pairs = _mm256_maddubs_epi16(u[0], broadcast4(v));
    for (int t = 1; t < count; t++) {
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[t], broadcast4(v + 4 * t)));
        if (pinned) KEEP_IN_REGISTER(pairs);
    }
    return pairs;
}

static inline __m256i pair_sums(const __m256i *u, const int8_t *v, int count) {
    return sum_pairs(u, v, count, 0);
}

/* pair_sums with the sum kept in its register after each add: dot_words' and
   dot_words_scaled's tiles (Q4_0's and Q4_K's among them) ran 5-10% faster pinned; Q6_K's
   and Q5_K's, which call pair_sums, ran slower */
static inline __m256i pinned_pair_sums(const __m256i *u, const int8_t *v, int count) {
    return sum_pairs(u, v, count, 1);
}

/* eight bytes (one per row), each as both int16 halves of its row's lane: multiplied
   in by vpmaddwd, a sub-block's pair sums come out scaled and summed */
static inline __m256i scale_pairs(const uint8_t *p, int is_signed) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    const __m128i twice = _mm_unpacklo_epi8(bytes, bytes);
    return is_signed ? _mm256_cvtepi8_epi16(twice) : _mm256_cvtepu8_epi16(twice);
}

/* pair sums widened to int32 lanes (vpmaddwd by ones) */
static inline __m256i pairs_to_int32(__m256i pairs) {
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

#if INT8_VNNI
/* vpdpbusd over ``count`` words, in four chains where there are eight (its latency is
   four or five cycles; one chain of eight was a tenth slower on Q4_K, and four chains of
   one were slower than one chain of four) */
static inline __m256i dot_chains(const __m256i *u, const int8_t *v, int count) {
    __m256i chain[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                        _mm256_setzero_si256()};
    const int chains = count >= 8 ? 4 : 1;
    for (int t = 0; t < count; t++)
        chain[t % chains] = dot_u8s8(chain[t % chains], u[t], broadcast4(v + 4 * t));
    if (chains == 1) return chain[0];
    return _mm256_add_epi32(_mm256_add_epi32(chain[0], chain[1]), _mm256_add_epi32(chain[2], chain[3]));
}
#endif

/* The products of ``count`` words of weight codes with x's codes (as pair_sums takes
   them), summed per row into an int32 lane. With VNNI each word is one vpdpbusd into
   int32. Otherwise vpmaddubsw's pair sums are added as int16 and widened once (vpmaddwd),
   half the instructions of widening each word: the caller keeps count * 2 * max u * 127
   under 32768. */
static inline __m256i dot_words(const __m256i *u, const int8_t *v, int count) {
#if INT8_VNNI
    return dot_chains(u, v, count);
#else
    return pairs_to_int32(pinned_pair_sums(u, v, count));
#endif
}

/* A sub-block's eight scales (a byte per row), in the form dot_words_scaled multiplies
   by: with VNNI an int32 per lane, otherwise scale_pairs' */
static inline __m256i sub_scales(const uint8_t *p) {
#if INT8_VNNI
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    return scale_pairs(p, 0);
#endif
}

/* dot_words times a sub-block's scales (sub_scales'), per lane: its exact integer sum.
   With VNNI a vpmulld after the dot; otherwise vpmaddwd widens and scales at once. */
static inline __m256i dot_words_scaled(const __m256i *u, const int8_t *v, int count,
                                       __m256i scale) {
#if INT8_VNNI
    return _mm256_mullo_epi32(dot_chains(u, v, count), scale);
#else
    return _mm256_madd_epi16(pinned_pair_sums(u, v, count), scale);
#endif
}

#else
#define INT8_SIMD 0
#define INT8_VNNI 0
#endif

#endif
