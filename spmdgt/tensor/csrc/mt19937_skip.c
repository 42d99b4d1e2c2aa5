/* Move torch's CPU generator (mt19937) past `words` 32-bit outputs without producing them.
 *
 * `pod` is the byte state torch.Generator.get_state() returns (at::CPUGeneratorImplState):
 * int32 `left` at byte 8, uint64 `next` at 16, the 624 state words as uint64 at 24. torch's
 * engine twists the state when `left` falls to 0 and then returns state[next++]; so since the
 * last twist 625 - left words were used (624: a twist is due). Skipping is the twists alone,
 * without the tempering and the per-number kernel work a draw does: ~10x cheaper than the
 * cheapest torch draw (spmdgt/tensor/_mt19937.py). */
#include <stdint.h>

#define N 624
#define M 397

static inline uint32_t mix(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

int gt_mt19937_skip(unsigned char *pod, uint64_t words) {
    int32_t *left = (int32_t *)(pod + 8);
    uint64_t *next = (uint64_t *)(pod + 16);
    uint64_t *state = (uint64_t *)(pod + 24);
    if (*left < 1 || *left > N) return -1; /* not a state torch would accept */
    if (words == 0) return 0;
    uint64_t total = (uint64_t)(N + 1 - *left) + words;
    uint64_t twists = (total - 1) / N;
    uint32_t s[N];
    for (int i = 0; i < N; i++) s[i] = (uint32_t)state[i];
    for (uint64_t t = 0; t < twists; t++) {
        int i = 0;
        for (; i < N - M; i++) s[i] = s[i + M] ^ mix(s[i], s[i + 1]);
        for (; i < N - 1; i++) s[i] = s[i + M - N] ^ mix(s[i], s[i + 1]);
        s[N - 1] = s[M - 1] ^ mix(s[N - 1], s[0]);
    }
    for (int i = 0; i < N; i++) state[i] = s[i];
    uint64_t pos = total - twists * N; /* words used since the last twist: 1..624 */
    *left = (int32_t)(N + 1 - pos);
    *next = pos;
    return 0;
}
