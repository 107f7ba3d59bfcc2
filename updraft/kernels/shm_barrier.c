/* Flags in shared memory for the ranks of one machine (parallel/shared_memory.py).

   Each rank owns one cache line in each row of flags: its sequence number at offset 0
   and its process id at offset 8. A rank that waits first spins, since on a virtual
   machine a core that goes idle is halted and waking it for every collective cost about
   a millisecond, many times the collective itself. A wait that lasts (an idle engine's
   workers wait for the next step) then sleeps in growing naps up to a millisecond, and
   checks that the ranks it waits for still exist: a rank that exited makes the wait
   return -(rank + 1) instead of spinning forever. A wait with a time limit (any wait
   inside a step: its ranks run the same work) returns -(count + rank + 1) once rank
   has not arrived within it, alive but stuck. */

#include <stdint.h>
#include <stdio.h>
#include <time.h>

/* Spins before the first nap: a few milliseconds here, longer than a rank waits for
   another within a step or for rank 0's host work between steps. With 200,000 (a
   tenth of that) a rank napped between steps and tensor-parallel decode ran 1.27x
   slower (benchmarks/RESULTS.md). */
#define SPINS 5000000

/* Whether process pid exists and is not a zombie. */
static int process_lives(int64_t pid) {
    char path[64], state = 0;
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *stat = fopen(path, "r");
    if (stat == NULL) return 0;
    int read = fscanf(stat, "%*d (%*[^)]) %c", &state);
    fclose(stat);
    return read == 1 && state != 'Z' && state != 'X';
}

/* flag = value, after every write this rank made before it (release) */
void shm_signal(uint64_t *flag, uint64_t value) { __atomic_store_n(flag, value, __ATOMIC_RELEASE); }

static int64_t now_ms(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

/* 0 once count flags, stride uint64s apart, are each >= value (acquire); -(r + 1) if
   rank r's process is gone first (its pid sits one uint64 after its flag);
   -(count + r + 1) if rank r has not arrived within timeout_ms (0: no limit). */
int64_t shm_wait(const uint64_t *flags, int64_t count, int64_t stride, uint64_t value,
                 int64_t timeout_ms) {
    int64_t deadline = -1; /* set at the first nap: spinning is the fast path */
    for (int64_t r = 0; r < count; r++) {
        const uint64_t *flag = flags + r * stride;
        long spins = 0, nap_ns = 20000;
        while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < value) {
            if (++spins < SPINS) continue;
            if (!process_lives((int64_t)flag[1])) return -(r + 1);
            if (timeout_ms > 0) {
                if (deadline < 0) deadline = now_ms() + timeout_ms;
                else if (now_ms() > deadline) return -(count + r + 1);
            }
            struct timespec nap = {0, nap_ns};
            nanosleep(&nap, NULL);
            if (nap_ns < 1000000) nap_ns *= 2;
        }
    }
    return 0;
}

/* The sum over ranks of n floats, x on this rank -> out on every rank, through the
   slots (slot r at slots + r * slot_bytes, its payload line bytes in; capacity bytes
   each), in chunks of the capacity: per chunk, wait until every rank has left the last
   exchange, write this rank's part, arrive, wait for all, sum the slots in rank order
   (the same bits on every rank), leave. The same protocol, header included, as the
   exchanges of shared_memory.py. Returns the last exchange's sequence number, or
   shm_wait's negative code. */
int64_t shm_all_reduce(uint64_t *arrived, uint64_t *departed, char *slots, int64_t slot_bytes,
                       int64_t line, int64_t capacity, int rank, int world, const float *x,
                       float *out, int64_t n, int64_t sequence, int64_t timeout_ms) {
    const int64_t stride = line / (int64_t)sizeof(uint64_t);
    const int64_t per_chunk = capacity / (int64_t)sizeof(float);
    for (int64_t start = 0; start < n; start += per_chunk) {
        const int64_t count = n - start < per_chunk ? n - start : per_chunk;
        int64_t gone;
        sequence++;
        if ((gone = shm_wait(departed, world, stride, sequence - 1, timeout_ms)) < 0) return gone;
        *(int64_t *)(slots + rank * slot_bytes) = count * (int64_t)sizeof(float); /* header */
        float *mine = (float *)(slots + rank * slot_bytes + line);
        for (int64_t i = 0; i < count; i++) mine[i] = x[start + i];
        shm_signal(arrived + rank * stride, sequence);
        if ((gone = shm_wait(arrived, world, stride, sequence, timeout_ms)) < 0) return gone;
        for (int64_t i = 0; i < count; i++) out[start + i] = ((float *)(slots + line))[i];
        for (int r = 1; r < world; r++) {
            const float *theirs = (const float *)(slots + r * slot_bytes + line);
            for (int64_t i = 0; i < count; i++) out[start + i] += theirs[i];
        }
        shm_signal(departed + rank * stride, sequence);
    }
    return sequence;
}
