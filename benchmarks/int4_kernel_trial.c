/* int4 weight products on the CPU: y[M, N] = x[M, K] . W^T (+ bias), W = scale * q + minimum per group of 32
 * columns (GGUF Q4_1's values). A trial, not used by taps_ray: benchmarks/bench_int4_kernel.py builds it and
 * times it against torch's kernel.
 *
 * Layout: codes [N, K / 2] bytes, group g of row n at bytes n * K / 2 + 16 g: the low nibble of byte j is code j,
 * the high nibble code j + 16. scale, minimum: [N, K / 32] float32. x and y float32 or bfloat16 (row-major).
 *
 * Every row of x takes the same sequence of operations whatever M is (rows never share an accumulator and the
 * order over K is fixed), so a row's result does not depend on how many rows share the product: a plain step
 * and the same row inside a tree verification round alike. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 32
#if defined(__AVX512F__)
#define ROWS 4 /* rows of x per pass over a pair of weight rows: 16 accumulators */
#elif defined(__AVX2__)
#define ROWS 2
#else
#define ROWS 1
#endif
#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's conversion */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#if defined(__AVX512F__)
/* The 32 weights of one group as two vectors: codes 0-15 and 16-31. */
INLINE void decode(const uint8_t *q, float s, float mn, __m512 *w0, __m512 *w1) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(0x0F);
    const __m512 sc = _mm512_set1_ps(s), mi = _mm512_set1_ps(mn);
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask))), sc, mi);
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask))), sc, mi);
}

/* out[w][r] = x[r, :] . (weight row w) for w < pair (1 or 2 rows, `stride` bytes of codes and K / 32 scales apart)
 * and r < rows (constants after inlining). */
INLINE void products(const float *x, int64_t K, int rows, int pair, const uint8_t *q, const float *s, const float *mn,
                     int64_t stride, float out[2][ROWS]) {
    const int64_t groups = K / GROUP;
    __m512 lo[2][ROWS], hi[2][ROWS];
    for (int w = 0; w < pair; w++)
        for (int r = 0; r < rows; r++) lo[w][r] = hi[w][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 w0[2], w1[2];
        for (int w = 0; w < pair; w++)
            decode(q + w * stride + 16 * g, s[w * groups + g], mn[w * groups + g], &w0[w], &w1[w]);
        const float *xg = x + GROUP * g;
        for (int r = 0; r < rows; r++) {
            const __m512 a = _mm512_loadu_ps(xg + r * K), b = _mm512_loadu_ps(xg + r * K + 16);
            for (int w = 0; w < pair; w++) {
                lo[w][r] = _mm512_fmadd_ps(w0[w], a, lo[w][r]);
                hi[w][r] = _mm512_fmadd_ps(w1[w], b, hi[w][r]);
            }
        }
    }
    for (int w = 0; w < pair; w++)
        for (int r = 0; r < rows; r++) out[w][r] = _mm512_reduce_add_ps(_mm512_add_ps(lo[w][r], hi[w][r]));
}
#elif defined(__AVX2__)
INLINE void products(const float *x, int64_t K, int rows, int pair, const uint8_t *q, const float *s, const float *mn,
                     int64_t stride, float out[2][ROWS]) {
    const int64_t groups = K / GROUP;
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m256 lo[2][ROWS], hi[2][ROWS];
    for (int w = 0; w < pair; w++)
        for (int r = 0; r < rows; r++) lo[w][r] = hi[w][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 wv[2][4];
        for (int w = 0; w < pair; w++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(q + w * stride + 16 * g));
            const __m128i low = _mm_and_si128(b, mask), high = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
            const __m256 sc = _mm256_set1_ps(s[w * groups + g]), mi = _mm256_set1_ps(mn[w * groups + g]);
            wv[w][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), sc, mi);
            wv[w][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), sc, mi);
            wv[w][2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), sc, mi);
            wv[w][3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), sc, mi);
        }
        const float *xg = x + GROUP * g;
        for (int r = 0; r < rows; r++) {
            const float *xr = xg + r * K;
            const __m256 a0 = _mm256_loadu_ps(xr), a1 = _mm256_loadu_ps(xr + 8);
            const __m256 b0 = _mm256_loadu_ps(xr + 16), b1 = _mm256_loadu_ps(xr + 24);
            for (int w = 0; w < pair; w++) {
                lo[w][r] = _mm256_fmadd_ps(wv[w][0], a0, lo[w][r]);
                hi[w][r] = _mm256_fmadd_ps(wv[w][2], b0, hi[w][r]);
                lo[w][r] = _mm256_fmadd_ps(wv[w][1], a1, lo[w][r]);
                hi[w][r] = _mm256_fmadd_ps(wv[w][3], b1, hi[w][r]);
            }
        }
    }
    for (int w = 0; w < pair; w++)
        for (int r = 0; r < rows; r++) {
            const __m256 v = _mm256_add_ps(lo[w][r], hi[w][r]);
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            out[w][r] = _mm_cvtss_f32(h);
        }
}
#else
INLINE void products(const float *x, int64_t K, int rows, int pair, const uint8_t *q, const float *s, const float *mn,
                     int64_t stride, float out[2][ROWS]) {
    const int64_t groups = K / GROUP;
    for (int w = 0; w < pair; w++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const float *xg = x + r * K + GROUP * g;
                const uint8_t *qg = q + w * stride + 16 * g;
                const float sc = s[w * groups + g], mi = mn[w * groups + g];
                for (int j = 0; j < 16; j++) {
                    acc += (sc * (float)(qg[j] & 0x0F) + mi) * xg[j];
                    acc += (sc * (float)(qg[j] >> 4) + mi) * xg[j + 16];
                }
            }
            out[w][r] = acc;
        }
}
#endif

/* products() with its row and pair counts as constants, so each case compiles to registers only. */
static void products_of(const float *x, int64_t K, int rows, int pair, const uint8_t *q, const float *s,
                        const float *mn, int64_t stride, float out[2][ROWS]) {
#define CASE(R)                                                                        \
    case R:                                                                            \
        if (pair == 2)                                                                 \
            products(x, K, (R) < ROWS ? (R) : ROWS, 2, q, s, mn, stride, out);         \
        else                                                                           \
            products(x, K, (R) < ROWS ? (R) : ROWS, 1, q, s, mn, stride, out);         \
        return;
    switch (rows) {
        CASE(1)
        CASE(2)
        CASE(3)
        default:
            CASE(4)
    }
#undef CASE
}

/* The kernel's vector width in bits (512, 256, or 0 for the portable loop): which build this is. */
int taps_int4_width(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}

/* y[M, N] = x[M, K] . W^T + bias (bias [N] float32, or NULL), rows split over the OpenMP threads by output feature.
 * x_bf16 / y_bf16: whether x / y are bfloat16 (else float32). K must be a multiple of 32. Returns 0, or -1 when
 * a buffer cannot be allocated. */
int taps_int4_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, const float *scale,
                     const float *minimum, const float *bias, int64_t N, void *y, int y_bf16) {
    const float *xf = (const float *)x;
    float *converted = NULL;
    if (x_bf16) {
        converted = (float *)malloc((size_t)(M * K) * sizeof(float));
        if (converted == NULL) return -1;
        const uint16_t *xh = (const uint16_t *)x;
        for (int64_t i = 0; i < M * K; i++) converted[i] = bf16_to_f32(xh[i]);
        xf = converted;
    }
    const int64_t groups = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n += 2) {
        const int pair = n + 1 < N ? 2 : 1;
        float out[2][ROWS];
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int rows = (int)(M - m0 < ROWS ? M - m0 : ROWS);
            products_of(xf + m0 * K, K, rows, pair, codes + n * (K / 2), scale + n * groups, minimum + n * groups,
                        K / 2, out);
            for (int w = 0; w < pair; w++)
                for (int r = 0; r < rows; r++) {
                    const float v = bias ? out[w][r] + bias[n + w] : out[w][r];
                    if (y_bf16)
                        ((uint16_t *)y)[(m0 + r) * N + n + w] = f32_to_bf16(v);
                    else
                        ((float *)y)[(m0 + r) * N + n + w] = v;
                }
        }
    }
    free(converted);
    return 0;
}
