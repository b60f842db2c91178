/* One-token attention of a batch of requests, each on its own KV cache (the static engine's KVCache: keys and
 * values [L, g, C, d] float32, entries 0 .. past - 1 valid). For request b and layer `layer`:
 *   cache[b][layer, :, past[b]] = k[b], v[b]                                   (the new entry)
 *   out[b, i] = softmax(scale * q[b, i] . K[b][:past[b] + 1]) . V[b][:past[b] + 1]   for query head i of kv head i / (h / g)
 * with q, out [B, h, d] and k, v [B, g, d] float32, contiguous. Built at first use by taps_ray/models/native.py.
 *
 * Each (request, head) takes the same operations in the same order whatever the other requests, their count and
 * the thread count (one thread computes it; sums over d run in 8 fixed lanes), so a request decoded in a batch gets
 * the bits it gets alone. */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

#define LANES 8

static float dot(const float *a, const float *b, int64_t d) {
    float lane[LANES] = {0};
    int64_t t = 0;
    for (; t + LANES <= d; t += LANES)
        for (int j = 0; j < LANES; j++) lane[j] += a[t + j] * b[t + j];
    float sum = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    for (; t < d; t++) sum += a[t] * b[t];
    return sum;
}

static void attend_head(const float *q, const float *keys, const float *values, int64_t n, int64_t d, float scale,
                        float *scores, float *out) {
    float top = -INFINITY;
    for (int64_t l = 0; l < n; l++) {
        scores[l] = scale * dot(q, keys + l * d, d);
        top = scores[l] > top ? scores[l] : top;
    }
    float total = 0.0f;
    for (int64_t l = 0; l < n; l++) {
        scores[l] = expf(scores[l] - top);
        total += scores[l];
    }
    for (int64_t t = 0; t < d; t++) out[t] = 0.0f;
    for (int64_t l = 0; l < n; l++) {
        const float p = scores[l], *row = values + l * d;
        for (int64_t t = 0; t < d; t++) out[t] += p * row[t];
    }
    const float inverse = 1.0f / total;
    for (int64_t t = 0; t < d; t++) out[t] *= inverse;
}

/* keys/values: per request the address of its cache's layer-0 keys/values; capacity: its C; past: its valid
 * entries before this token. Returns 0, or -1 when scratch memory could not be allocated. */
int taps_decode_attention(int64_t B, const int64_t *keys, const int64_t *values, const int64_t *capacity,
                          const int64_t *past, int64_t layer, int64_t h, int64_t g, int64_t d, const float *q,
                          const float *k, const float *v, float scale, float *out, int threads) {
    const int64_t group = h / g;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t C = capacity[b], at = past[b];
        float *kc = (float *)(intptr_t)keys[b] + layer * g * C * d, *vc = (float *)(intptr_t)values[b] + layer * g * C * d;
        for (int64_t j = 0; j < g; j++)
            for (int64_t t = 0; t < d; t++) {
                kc[(j * C + at) * d + t] = k[(b * g + j) * d + t];
                vc[(j * C + at) * d + t] = v[(b * g + j) * d + t];
            }
        longest = at + 1 > longest ? at + 1 : longest;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (B * h > 8 && threads > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)longest);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < B * h; task++) {
            if (scores == NULL) continue;
            const int64_t b = task / h, i = task % h, j = i / group, C = capacity[b];
            const float *kc = (const float *)(intptr_t)keys[b] + (layer * g + j) * C * d;
            const float *vc = (const float *)(intptr_t)values[b] + (layer * g + j) * C * d;
            attend_head(q + task * d, kc, vc, past[b] + 1, d, scale, scores, out + task * d);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
