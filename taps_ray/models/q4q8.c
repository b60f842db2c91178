/* int4 weights times int8 activations on the CPU, GGUF's Q4_1 x Q8_1 arithmetic:
 *   y[m, n] = sum_g  dw[n, g] * dx[m, g] * (codes[n, g, :] . xq[m, g, :])  +  mw[n, g] * sx[m, g]  (+ bias[n])
 * with W[n, k] = dw * code + mw per group g of 32 columns (codes 0..15) and each activation row quantized per
 * group to int8: dx = max|x| / 127, xq = round(x / dx), sx = dx * sum(xq). Built at first use by
 * taps_ray/models/native.py.
 *
 * Packed weights, per tile of 16 output features and per group: 256 bytes of codes, then 16 fp16 scales and
 * 16 fp16 minima. In the codes, bytes 64 t + 4 i + j (t < 4, lane i < 16, j < 4) hold column 4 t + j of output
 * n0 + i in the low nibble and column 4 (t + 4) + j in the high one: one 64-byte load gives two vectors of
 * the 4 codes each lane's integer dot product takes per step.
 *
 * Each row of x takes the same operations in the same order whatever the row count, the other rows and the
 * thread count, so a row's result never depends on the rows that share its product. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 32
#define TILE 16
#define TILE_BYTES (GROUP * TILE / 2 + 2 * TILE * 2)
#define ROWS 4
#define INLINE static inline __attribute__((always_inline))

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            int e = -1;
            uint32_t m = man;
            do { e++; m <<= 1; } while ((m & 0x400u) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t float_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* One row's group of 32 values quantized: xq, and (dx, sx). Every build rounds alike (to nearest even). */
static void quantize_group_scalar(const float *x, int8_t *xq, float *dx, float *sx) {
    float amax = 0.0f;
    for (int j = 0; j < GROUP; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < GROUP; j++) {
        const int q = (int)nearbyintf(x[j] * inv);
        xq[j] = (int8_t)q;
        sum += q;
    }
    *dx = amax / 127.0f;
    *sx = *dx * (float)sum;
}

#if defined(__AVX512F__)
INLINE __m512 load16(const void *x, int bf16, int64_t at) {
    if (!bf16) return _mm512_loadu_ps((const float *)x + at);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static void quantize_group(const void *x, int bf16, int64_t at, int8_t *xq, float *dx, float *sx) {
    const __m512 a = load16(x, bf16, at), b = load16(x, bf16, at + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128((__m128i *)xq, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(xq + 16), _mm512_cvtsepi32_epi8(qb));
    *dx = amax / 127.0f;
    *sx = *dx * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}
#else
static void quantize_group(const void *x, int bf16, int64_t at, int8_t *xq, float *dx, float *sx) {
    float row[GROUP];
    if (bf16) {
        for (int j = 0; j < GROUP; j++) row[j] = bf16_to_float(((const uint16_t *)x)[at + j]);
    } else {
        memcpy(row, (const float *)x + at, sizeof(row));
    }
    quantize_group_scalar(row, xq, dx, sx);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* rows (<= ROWS) rows of xq times one tile: acc[r] holds the tile's 16 outputs of row r. */
INLINE void tile_rows(const uint8_t *tile, int64_t groups, const int8_t *xq, const float *dx, const float *sx,
                      int64_t K, int rows, __m512 acc[ROWS]) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = tile + g * TILE_BYTES;
        __m512i v[8];
        for (int t = 0; t < 4; t++) {
            const __m512i b = _mm512_loadu_si512((const void *)(p + 64 * t));
            v[t] = _mm512_and_si512(b, mask);
            v[t + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 4), mask);
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + GROUP * TILE / 2)));
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + GROUP * TILE / 2 + 2 * TILE)));
        for (int r = 0; r < rows; r++) {
            const int32_t *xr = (const int32_t *)(xq + r * K + g * GROUP);
            __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
            for (int s = 0; s < 8; s += 2) {
                d0 = _mm512_dpbusd_epi32(d0, v[s], _mm512_set1_epi32(xr[s]));
                d1 = _mm512_dpbusd_epi32(d1, v[s + 1], _mm512_set1_epi32(xr[s + 1]));
            }
            const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), dw);
            acc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(dx[r * groups + g]), acc[r]);
            acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * groups + g]), acc[r]);
        }
    }
}
/* v (+ bias[n0 .. n0 + 15]) stored at y[at ..] in float32 or bfloat16 (round to nearest even, as torch). */
INLINE void store16(__m512 v, const float *bias, int64_t n0, void *y, int y_bf16, int64_t at) {
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
    if (!y_bf16) {
        _mm512_storeu_ps((float *)y + at, v);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
    const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i out = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    out = _mm512_mask_mov_epi32(out, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), _mm512_cvtepi32_epi16(out));
}
#define KERNEL "avx512-vnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* As above on 256-bit vectors: each tile as two halves of 8 outputs; u8 x s8 pairs summed to int16 (at most
 * 8 steps x 2 x 15 x 127 = 30480: no saturation), then to int32. acc[r][h]: half h of row r. */
INLINE void tile_rows(const uint8_t *tile, int64_t groups, const int8_t *xq, const float *dx, const float *sx,
                      int64_t K, int rows, __m256 acc[ROWS][2]) {
    const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = tile + g * TILE_BYTES;
        for (int h = 0; h < 2; h++) {
            __m256i v[8];
            for (int t = 0; t < 4; t++) {
                const __m256i b = _mm256_loadu_si256((const __m256i *)(p + 64 * t + 32 * h));
                v[t] = _mm256_and_si256(b, mask);
                v[t + 4] = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + GROUP * TILE / 2 + 16 * h)));
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + GROUP * TILE / 2 + 2 * TILE + 16 * h)));
            for (int r = 0; r < rows; r++) {
                const int32_t *xr = (const int32_t *)(xq + r * K + g * GROUP);
                __m256i sum16 = _mm256_setzero_si256();
                for (int s = 0; s < 8; s++)
                    sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(v[s], _mm256_set1_epi32(xr[s])));
                const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, ones)), dw);
                acc[r][h] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dx[r * groups + g]), acc[r][h]);
                acc[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[r * groups + g]), acc[r][h]);
            }
        }
    }
}
INLINE void store8(__m256 v, const float *bias, int64_t n0, void *y, int y_bf16, int64_t at) {
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0));
    if (!y_bf16) {
        _mm256_storeu_ps((float *)y + at, v);
        return;
    }
    const __m256i bits = _mm256_castps_si256(v), high = _mm256_srli_epi32(bits, 16);
    const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    __m256i out = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    out = _mm256_blendv_epi8(out, _mm256_or_si256(high, _mm256_set1_epi32(0x40)),
                             _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)y + at), _mm256_castsi256_si128(packed));
}
#define KERNEL "avx2"
#else
#define KERNEL "portable"
#endif

/* Which build this is: "avx512-vnni", "avx2" or "portable". */
const char *taps_q4q8_kernel(void) { return KERNEL; }

/* The packed bytes of a weight [N, K] (N a multiple of 16, K of 32). */
int64_t taps_q4q8_packed_bytes(int64_t N, int64_t K) { return (N / TILE) * (K / GROUP) * TILE_BYTES; }

/* Pack codes [N, K] (uint8, 0..15) and the scales and minima [N, K / 32] (fp16 bits) into `out`. */
void taps_q4q8_pack(const uint8_t *codes, const uint16_t *scale_half, const uint16_t *minimum_half, int64_t N,
                    int64_t K, uint8_t *out) {
    const int64_t groups = K / GROUP;
    for (int64_t tile = 0; tile < N / TILE; tile++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *p = out + (tile * groups + g) * TILE_BYTES;
            for (int t = 0; t < 4; t++)
                for (int i = 0; i < TILE; i++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t *row = codes + (tile * TILE + i) * K + g * GROUP;
                        p[64 * t + 4 * i + j] = (uint8_t)((row[4 * t + j] & 0x0f) | ((row[4 * (t + 4) + j] & 0x0f) << 4));
                    }
            uint16_t *halves = (uint16_t *)(p + GROUP * TILE / 2);
            for (int i = 0; i < TILE; i++) {
                halves[i] = scale_half[(tile * TILE + i) * groups + g];
                halves[TILE + i] = minimum_half[(tile * TILE + i) * groups + g];
            }
        }
}

/* ---- Q8_0 x Q8_0: W[n, k] = dw[n, g] * code, codes -127..127 (GGUF's Q8_0 blocks; the embedded target's tied
 * LM head). Packed per tile of 16 outputs and per group: 512 bytes of codes (bytes 64 s + 4 i + j: column
 * 4 s + j of output n0 + i, s < 8), 16 fp16 scales and 16 int16 sums of the group's codes. The AVX-512 loop
 * multiplies unsigned activations (xq + 128) and corrects by 128 x the code sum; the AVX2 loop multiplies |code|
 * by xq with the code's sign: both integer sums are exact, so every build gives the same bits. */
#define TILE8_BYTES (GROUP * TILE + 2 * TILE * 2)

int64_t taps_q8q8_packed_bytes(int64_t N, int64_t K) { return (N / TILE) * (K / GROUP) * TILE8_BYTES; }

void taps_q8q8_pack(const int8_t *codes, const uint16_t *scale_half, int64_t N, int64_t K, uint8_t *out) {
    const int64_t groups = K / GROUP;
    for (int64_t tile = 0; tile < N / TILE; tile++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *p = out + (tile * groups + g) * TILE8_BYTES;
            uint16_t *halves = (uint16_t *)(p + GROUP * TILE);
            int16_t *sums = (int16_t *)(p + GROUP * TILE + 2 * TILE);
            for (int i = 0; i < TILE; i++) {
                const int8_t *row = codes + (tile * TILE + i) * K + g * GROUP;
                int sum = 0;
                for (int s = 0; s < 8; s++)
                    for (int j = 0; j < 4; j++) {
                        p[64 * s + 4 * i + j] = (uint8_t)row[4 * s + j];
                        sum += row[4 * s + j];
                    }
                halves[i] = scale_half[(tile * TILE + i) * groups + g];
                sums[i] = (int16_t)sum;
            }
        }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
INLINE void tile8_rows(const uint8_t *tile, int64_t groups, const int8_t *xq, const float *dx, int64_t K, int rows,
                       __m512 acc[ROWS]) {
    const __m512i flip = _mm512_set1_epi32((int)0x80808080u);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = tile + g * TILE8_BYTES;
        __m512i v[8];
        for (int s = 0; s < 8; s++) v[s] = _mm512_loadu_si512((const void *)(p + 64 * s));
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + GROUP * TILE)));
        const __m512i offset = _mm512_slli_epi32(
            _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(p + GROUP * TILE + 2 * TILE))), 7);
        for (int r = 0; r < rows; r++) {
            const int32_t *xr = (const int32_t *)(xq + r * K + g * GROUP);
            __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
            for (int s = 0; s < 8; s += 2) {
                d0 = _mm512_dpbusd_epi32(d0, _mm512_xor_si512(_mm512_set1_epi32(xr[s]), flip), v[s]);
                d1 = _mm512_dpbusd_epi32(d1, _mm512_xor_si512(_mm512_set1_epi32(xr[s + 1]), flip), v[s + 1]);
            }
            const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(d0, d1), offset);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), dw), _mm512_set1_ps(dx[r * groups + g]), acc[r]);
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
INLINE void tile8_rows(const uint8_t *tile, int64_t groups, const int8_t *xq, const float *dx, int64_t K, int rows,
                       __m256 acc[ROWS][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = tile + g * TILE8_BYTES;
        for (int h = 0; h < 2; h++) {
            __m256i v[8], mag[8];
            for (int s = 0; s < 8; s++) {
                v[s] = _mm256_loadu_si256((const __m256i *)(p + 64 * s + 32 * h));
                mag[s] = _mm256_abs_epi8(v[s]);
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + GROUP * TILE + 16 * h)));
            for (int r = 0; r < rows; r++) {
                const int32_t *xr = (const int32_t *)(xq + r * K + g * GROUP);
                __m256i dot = _mm256_setzero_si256();
                for (int s = 0; s < 8; s++) {
                    const __m256i pairs = _mm256_maddubs_epi16(mag[s], _mm256_sign_epi8(_mm256_set1_epi32(xr[s]), v[s]));
                    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
                }
                acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), dw), _mm256_set1_ps(dx[r * groups + g]),
                                            acc[r][h]);
            }
        }
    }
}
#endif

/* One row's group of the portable loop: codes . xq, Q4_1 (q8 = 0) or Q8_0 (q8 = 1), and its contribution. */
static float portable_group(const uint8_t *p, int q8, int i, const int8_t *xr, float dx, float sx, float acc) {
    int dot = 0;
    if (q8) {
        for (int s = 0; s < 8; s++)
            for (int j = 0; j < 4; j++) dot += (int8_t)p[64 * s + 4 * i + j] * xr[4 * s + j];
        return fmaf((float)dot * half_to_float(((const uint16_t *)(p + GROUP * TILE))[i]), dx, acc);
    }
    for (int t = 0; t < 4; t++)
        for (int j = 0; j < 4; j++) {
            const uint8_t b = p[64 * t + 4 * i + j];
            dot += (b & 0x0f) * xr[4 * t + j] + (b >> 4) * xr[4 * (t + 4) + j];
        }
    const uint16_t *halves = (const uint16_t *)(p + GROUP * TILE / 2);
    acc = fmaf((float)dot * half_to_float(halves[i]), dx, acc);
    return fmaf(half_to_float(halves[TILE + i]), sx, acc);
}

/* The tile loops of `rows` rows; DISPATCH_ROWS makes the row count a constant, so that the compiler unrolls the rows
 * and interleaves their independent dot-product chains (the AVX-512 loop: 10-20% less time at 2-16 rows; the
 * AVX2 loop, with half the vector registers, gains nothing). */
#define TILE_CALL(n, q8, w, groups, xr, dr, sr, K, acc) \
    do { if (q8) tile8_rows(w, groups, xr, dr, K, n, acc); else tile_rows(w, groups, xr, dr, sr, K, n, acc); } while (0)
_Static_assert(ROWS == 4, "DISPATCH_ROWS covers row counts 1 to 4");
#define DISPATCH_ROWS(rows, q8, w, groups, xr, dr, sr, K, acc) \
    do { switch (rows) { \
        case 4: TILE_CALL(4, q8, w, groups, xr, dr, sr, K, acc); break; \
        case 3: TILE_CALL(3, q8, w, groups, xr, dr, sr, K, acc); break; \
        case 2: TILE_CALL(2, q8, w, groups, xr, dr, sr, K, acc); break; \
        default: TILE_CALL(1, q8, w, groups, xr, dr, sr, K, acc); } } while (0)

/* y[M, N] = x[M, K] times a packed weight: Q4_1 codes (q8 = 0, taps_q4q8_pack) or Q8_0 (q8 = 1, taps_q8q8_pack),
 * + bias [N] float32, or NULL. x_bf16 / y_bf16: bfloat16 (else float32). work: M * K bytes + 2 * M * K / 32 floats
 * of scratch. threads: OpenMP threads over the tiles. */
static void matmul(int q8, const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *packed, const float *bias,
                   int64_t N, void *y, int y_bf16, void *work, int threads) {
    const int64_t groups = K / GROUP, tile_bytes = q8 ? TILE8_BYTES : TILE_BYTES;
    int8_t *xq = (int8_t *)work;
    float *dx = (float *)(xq + M * K + ((-(M * K)) & 15)), *sx = dx + M * groups;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++)
            quantize_group(x, x_bf16, m * K + g * GROUP, xq + m * K + g * GROUP, dx + m * groups + g, sx + m * groups + g);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t tile = 0; tile < N / TILE; tile++) {
        const uint8_t *weights = packed + tile * groups * tile_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int rows = (int)(M - m0 < ROWS ? M - m0 : ROWS);
            const int8_t *xr = xq + m0 * K;
            const float *dr = dx + m0 * groups, *sr = sx + m0 * groups;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
            __m512 acc[ROWS];
            DISPATCH_ROWS(rows, q8, weights, groups, xr, dr, sr, K, acc);
            for (int r = 0; r < rows; r++) store16(acc[r], bias, tile * TILE, y, y_bf16, (m0 + r) * N + tile * TILE);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
            __m256 acc[ROWS][2];
            TILE_CALL(rows, q8, weights, groups, xr, dr, sr, K, acc);
            for (int r = 0; r < rows; r++)
                for (int h = 0; h < 2; h++)
                    store8(acc[r][h], bias, tile * TILE + 8 * h, y, y_bf16, (m0 + r) * N + tile * TILE + 8 * h);
#else
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < TILE; i++) {
                    float acc = 0.0f;
                    for (int64_t g = 0; g < groups; g++)
                        acc = portable_group(weights + g * tile_bytes, q8, i, xr + r * K + g * GROUP, dr[r * groups + g],
                                             sr[r * groups + g], acc);
                    const int64_t n = tile * TILE + i;
                    const float v = bias ? acc + bias[n] : acc;
                    if (y_bf16)
                        ((uint16_t *)y)[(m0 + r) * N + n] = float_to_bf16(v);
                    else
                        ((float *)y)[(m0 + r) * N + n] = v;
                }
#endif
        }
    }
}

void taps_q4q8_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *packed, const float *bias,
                      int64_t N, void *y, int y_bf16, void *work, int threads) {
    matmul(0, x, x_bf16, M, K, packed, bias, N, y, y_bf16, work, threads);
}

void taps_q8q8_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *packed, const float *bias,
                      int64_t N, void *y, int y_bf16, void *work, int threads) {
    matmul(1, x, x_bf16, M, K, packed, bias, N, y, y_bf16, work, threads);
}
