/* What 1 and 2 threads can read from memory, the floor under a batch-1 decode step:
 * each thread sums its half of a buffer (default 512 MiB) with AVX-512 loads, the
 * buffer in 4 KiB pages or advised into 2 MiB ones (MADV_HUGEPAGE, as
 * updraft/kernels/huge_pages.py advises the weights), with no software prefetch or
 * prefetching 2 or 4 KB ahead into L2. The variants alternate; each line is the best of
 * 15 reads. AVX-512 loads where the build has AVX-512 (F), AVX2 loads otherwise.
 *
 *     gcc -O2 -march=native -fopenmp benchmarks/read_bandwidth.c -o /tmp/read_bandwidth
 *     /tmp/read_bandwidth [MiB] [threads]
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define HUGE_PAGE (2u << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#ifdef __AVX512F__
typedef __m512i vec;
#define LOAD(p) _mm512_load_si512(p)
#define ADD(a, b) _mm512_add_epi64(a, b)
#define WIDTH 64
static long long reduce(vec v) { return _mm512_reduce_add_epi64(v); }
#else
typedef __m256i vec;
#define LOAD(p) _mm256_load_si256((const __m256i *)(p))
#define ADD(a, b) _mm256_add_epi64(a, b)
#define WIDTH 32
static long long reduce(vec v) {
    long long lanes[4];
    memcpy(lanes, &v, sizeof lanes);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}
#endif

/* four accumulators, each taking every fourth vector of a 4 * WIDTH-byte step */
static __attribute__((noinline)) vec read_range(const uint8_t *p, size_t n, int ahead) {
    vec a0, a1, a2, a3;
    memset(&a0, 0, sizeof a0);
    a1 = a2 = a3 = a0;
    for (size_t i = 0; i < n; i += 4 * WIDTH) {
        if (ahead)
            for (int j = 0; j < 4 * WIDTH; j += 64) _mm_prefetch((const char *)p + i + ahead + j, _MM_HINT_T1);
        a0 = ADD(a0, LOAD(p + i));
        a1 = ADD(a1, LOAD(p + i + WIDTH));
        a2 = ADD(a2, LOAD(p + i + 2 * WIDTH));
        a3 = ADD(a3, LOAD(p + i + 3 * WIDTH));
    }
    return ADD(ADD(a0, a1), ADD(a2, a3));
}

static uint8_t *buffer(size_t n, int huge) {
    uint8_t *p = mmap(NULL, n + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) exit(1);
    p = (uint8_t *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    madvise(p, n, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    memset(p, 1, n);
    return p;
}

int main(int argc, char **argv) {
    const size_t n = (size_t)(argc > 1 ? atol(argv[1]) : 512) << 20;
    const int threads = argc > 2 ? atoi(argv[2]) : 2;
    uint8_t *data[2] = {buffer(n, 0), buffer(n, 1)};
    const int aheads[3] = {0, 2048, 4096};
    double best[2][3];
    for (int h = 0; h < 2; h++)
        for (int a = 0; a < 3; a++) best[h][a] = 1e30;
    volatile long long sink = 0;
    for (int round = 0; round < 15; round++)
        for (int h = 0; h < 2; h++)
            for (int a = 0; a < 3; a++) {
                const double start = now();
#pragma omp parallel num_threads(threads)
                {
                    const size_t part = n / threads;
                    sink += reduce(read_range(data[h] + omp_get_thread_num() * part, part, aheads[a]));
                }
                const double seconds = now() - start;
                if (seconds < best[h][a]) best[h][a] = seconds;
            }
    for (int h = 0; h < 2; h++)
        for (int a = 0; a < 3; a++)
            printf("%d threads, %s pages, prefetch %4d B ahead: %5.1f GB/s\n", threads,
                   h ? "2 MiB" : "4 KiB", aheads[a], n / best[h][a] / 1e9);
    return 0;
}
