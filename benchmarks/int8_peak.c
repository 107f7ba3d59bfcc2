/* The machine's int8 dot-product peak, for bench_ceiling: every thread runs independent
 * chains of the widest u8 x s8 multiply-add the build has (AVX512-VNNI or AVX-VNNI
 * vpdpbusd, else AVX2 vpmaddubsw + vpmaddwd), enough chains that the units bind, not
 * the instruction's latency. The sums come back, so that nothing can be left out, and
 * let the caller check the count of multiply-adds done. */
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KIND "AVX512-VNNI vpdpbusd"
#define CHAINS 12
typedef __m512i vec;
#define LANES 16
#define SET1(v) _mm512_set1_epi8(v)
#define ZERO() _mm512_setzero_si512()
/* the instruction itself (gcc 12 wraps the intrinsic in two register copies); each
 * MADD adds to ``acc`` in place */
#define MADD(acc, u, s, ones) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s))
#define STORE(p, v) _mm512_storeu_si512((void *)(p), v)
#elif defined(__AVXVNNI__)
#define KIND "AVX-VNNI vpdpbusd"
#define CHAINS 8
typedef __m256i vec;
#define LANES 8
#define SET1(v) _mm256_set1_epi8(v)
#define ZERO() _mm256_setzero_si256()
#define MADD(acc, u, s, ones) \
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s))
#define STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#elif defined(__AVX2__)
#define KIND "AVX2 vpmaddubsw+vpmaddwd"
#define CHAINS 8
typedef __m256i vec;
#define LANES 8
#define SET1(v) _mm256_set1_epi8(v)
#define ZERO() _mm256_setzero_si256()
#define MADD(acc, u, s, ones) \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones))
#define STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#endif

const char *int8_peak_kind(void) {
#ifdef KIND
    return KIND;
#else
    return "none";
#endif
}

/* Multiply-adds one thread does per iteration (0: no SIMD path in this build). */
int64_t int8_peak_per_iteration(void) {
#ifdef KIND
    return (int64_t)CHAINS * LANES * 4;
#else
    return 0;
#endif
}

/* ``iterations`` of every chain on ``threads`` threads, u = ``u`` (0..127) and s = ``s``
 * in every byte; returns the sum of every lane of every chain of every thread. */
int64_t int8_peak_run(int64_t iterations, int threads, int u, int s) {
    int64_t total = 0;
#ifdef KIND
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        vec a = SET1((char)u), b = SET1((char)s), acc[CHAINS];
        vec ones = SET1(0);
#if defined(__AVX2__) && !defined(__AVXVNNI__) && !defined(__AVX512VNNI__)
        ones = _mm256_set1_epi16(1);
#endif
        (void)ones;
/* equal chains would be merged into one: each is made opaque to the compiler */
#pragma GCC unroll 16
        for (int c = 0; c < CHAINS; c++) {
            acc[c] = ZERO();
            __asm__ volatile("" : "+v"(acc[c]));
        }
        for (int64_t i = 0; i < iterations; i++) {
            /* unrolled, so that every chain stays in a register; b made opaque before
             * each product, which would otherwise be computed once (AVX2's are
             * independent of the sums) */
#pragma GCC unroll 16
            for (int c = 0; c < CHAINS; c++) {
                __asm__ volatile("" : "+v"(b));
                MADD(acc[c], a, b, ones);
            }
        }
        int32_t lanes[LANES];
#pragma GCC unroll 16 /* a chain indexed at run time would live in memory */
        for (int c = 0; c < CHAINS; c++) {
            STORE(lanes, acc[c]);
            for (int l = 0; l < LANES; l++) total += lanes[l];
        }
    }
#else
    (void)iterations, (void)threads, (void)u, (void)s;
#endif
    return total;
}
