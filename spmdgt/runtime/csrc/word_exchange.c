/* The agreement exchange through shared memory: one 64-bit word a rank, OR-reduced.
 *
 * For ranks on one host (runtime/_shm.py maps the segment and decides when to use it). The
 * segment holds one 64-byte slot per rank, then a control word:
 *
 *   slot r:  uint32 seq      the number of rank r's last posted exchange (a futex word)
 *            uint32 sleepers how many ranks sleep on seq (the poster wakes only if any)
 *            uint64 word[2]  the words of exchanges by parity: exchange g writes word[g & 1]
 *   control: uint32 ended    set when a rank ends the exchange (a failure on one rank)
 *
 * Exchange g: rank r writes its word into word[g & 1], publishes seq = g (release), then waits
 * until every rank's seq has reached g and ORs their word[g & 1]. Two words by parity are
 * enough: a rank posting g + 2 must first have seen every seq at g + 1, which a rank publishes
 * only after it read every word of g. Waiting spins a little, then sleeps on the futex of the
 * rank it waits for; gt_wait returns 1 after budget_ns so the caller can check for a dead peer
 * and its own deadline, and 2 as soon as ended is set.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint32_t seq;
    uint32_t sleepers;
    uint64_t word[2];
    uint8_t pad[40];
} slot_t;

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void wake(uint32_t *addr) {
    syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

int gt_slot_size(void) { return (int)sizeof(slot_t); }

void *gt_map(int fd, int64_t size) {
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

void gt_unmap(void *p, int64_t size) { munmap(p, (size_t)size); }

void gt_post(void *base, int rank, uint32_t gen, uint64_t word) {
    slot_t *s = (slot_t *)base + rank;
    __atomic_store_n(&s->word[gen & 1], word, __ATOMIC_RELAXED);
    __atomic_store_n(&s->seq, gen, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&s->sleepers, __ATOMIC_SEQ_CST))
        wake(&s->seq);
}

int gt_wait(void *base, int world, uint32_t gen, uint64_t *out, int64_t budget_ns, int spins) {
    slot_t *slots = (slot_t *)base;
    uint32_t *ended = (uint32_t *)(slots + world);
    int64_t deadline = -1;
    uint64_t acc = 0;
    for (int r = 0; r < world; r++) {
        slot_t *s = slots + r;
        int n = 0;
        for (;;) {
            uint32_t v = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
            if ((int32_t)(v - gen) >= 0)
                break;
            if (__atomic_load_n(ended, __ATOMIC_ACQUIRE))
                return 2;
            if (n < spins) {
                n++;
                relax();
                continue;
            }
            int64_t t = now_ns();
            if (deadline < 0)
                deadline = t + budget_ns;
            if (t >= deadline)
                return 1;
            int64_t left = deadline - t;
            struct timespec ts = {(time_t)(left / 1000000000), (long)(left % 1000000000)};
            __atomic_add_fetch(&s->sleepers, 1, __ATOMIC_SEQ_CST);
            v = __atomic_load_n(&s->seq, __ATOMIC_SEQ_CST);
            if ((int32_t)(v - gen) < 0 && !__atomic_load_n(ended, __ATOMIC_SEQ_CST))
                syscall(SYS_futex, &s->seq, FUTEX_WAIT, v, &ts, NULL, 0);
            __atomic_sub_fetch(&s->sleepers, 1, __ATOMIC_SEQ_CST);
        }
        acc |= __atomic_load_n(&s->word[gen & 1], __ATOMIC_RELAXED);
    }
    *out = acc;
    return 0;
}

int gt_exchange(void *base, int world, int rank, uint32_t gen, uint64_t word, uint64_t *out,
                int64_t budget_ns, int spins) {
    gt_post(base, rank, gen, word);
    return gt_wait(base, world, gen, out, budget_ns, spins);
}

void gt_end(void *base, int world) {
    slot_t *slots = (slot_t *)base;
    __atomic_store_n((uint32_t *)(slots + world), 1, __ATOMIC_SEQ_CST);
    for (int r = 0; r < world; r++)
        wake(&slots[r].seq);
}
