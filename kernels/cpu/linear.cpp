// Small-batch linear layer on the CPU: y[b, o] = sum_k x[b, k] * W[o, k] (+ bias[o]), W in a packed layout.
//
// Decode at small batch streams every weight once a step. The weight is packed in blocks of OB = 64 output
// rows, each block k-major, so a block is one contiguous stream and a 16-lane vector holds 16 outputs:
//   fp32  P[N / 64][K][64]             P[j][k][i] = W[64 j + i, k]
//   bf16  P[N / 64][ceil(K / 2)][64][2] P[j][k2][i][t] = W[64 j + i, 2 k2 + t]   (pairs, as VDPBF16PS reads them)
// (N padded to a multiple of 64 and K to an even count with zeros; kernels/cpu/linear.py packs.) A tile of
// RB batch rows x 64 outputs keeps RB x 4 accumulators in registers and meets each weight vector once for
// its RB rows, the input broadcast (the outer-product form of oneDNN's and MKL's GEMM microkernels), so the
// batch shares every weight load and no horizontal sum is needed. OpenMP threads take contiguous ranges of
// blocks, the stream prefetched a few KiB ahead.
//
// Summation order, fixed by K alone and independent of the batch, the tile shape and the thread count (so
// the kernel is batch-invariant by construction): element (b, o) is one accumulator lane, run over
// k = 0, 1, ..., K - 1 in order with fused multiply-adds (fp32 x: an fp32 weight, or a bf16 weight widened
// exactly), or over the pairs (0, 1), (2, 3), ... with VDPBF16PS (bf16 x and bf16 W: the instruction's own
// pair order; it rounds to nearest even and flushes denormals, the same for every row); then + bias[o].
// A bf16 output is rounded to nearest even.
//
// Shapes: x [B, K] (row stride sx elements; fp32, or bf16 with a bf16 weight), P as above, bias [N] or null,
// y [B, N] (row stride sy). Kinds: 0 float32, 1 bfloat16.

#include <cstdint>
#include <cstring>

#include <immintrin.h>
#include <omp.h>

#ifndef __AVX512F__
#error "kvlab_linear needs AVX-512 (built with -march=native): without it the engine runs torch's F.linear"
#endif

namespace {

constexpr int OB = 64;     // outputs per packed block: 4 vectors of 16
constexpr int RB_MAX = 6;  // batch rows per tile: 6 x 4 = 24 accumulators + 4 weight vectors (of 32 registers)

struct Args {
    const void* x; int64_t sx; int xk;
    const void* p; int pk;
    const void* bias; int bk;
    void* y; int64_t sy; int yk;
    int B, N, K;
};

inline __m512 widen16(const void* p, int64_t i, int kind, __mmask16 m) {  // 16 values of p[i:] as fp32 (masked)
    if (kind == 0) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// acc + bias, stored as y's kind into y[b, o0 : o0 + 16] (masked at N).
inline void store(const Args& a, int b, int o0, __m512 acc) {
    const int left = a.N - o0;
    if (left <= 0) return;
    const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    if (a.bias) acc = _mm512_add_ps(acc, widen16(a.bias, o0, a.bk, m));
    if (a.yk == 0) {
        _mm512_mask_storeu_ps(static_cast<float*>(a.y) + int64_t(b) * a.sy + o0, m, acc);
    } else {  // round to nearest even (a NaN stays a NaN)
        const __m512i u = _mm512_castps_si512(acc);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q);
        r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.y) + int64_t(b) * a.sy + o0, m, _mm512_cvtepi32_epi16(r));
    }
}

constexpr int64_t AHEAD = 4096;  // prefetch distance in bytes along the packed stream (into the next block)

inline void prefetch_ahead(const void* w) {  // the 4 cache lines one k step reads, AHEAD bytes further on
    const char* at = static_cast<const char*>(w) + AHEAD;
    for (int l = 0; l < 4; ++l) _mm_prefetch(at + 64 * l, _MM_HINT_T0);
}

// Block j (outputs 64 j ...) x batch rows [b0, b0 + RB): fp32 x, fp32 or bf16-pair weights.
template <int RB>
void tile_fma(const Args& a, int j, int b0, bool prefetch) {
    __m512 acc[RB][4];
    for (int i = 0; i < RB; ++i)
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
    const float* x = static_cast<const float*>(a.x) + int64_t(b0) * a.sx;
    if (a.pk == 0) {
        const float* w = static_cast<const float*>(a.p) + int64_t(j) * a.K * OB;
        for (int k = 0; k < a.K; ++k, w += OB) {
            if (prefetch) prefetch_ahead(w);
            const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
            const __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);
            for (int i = 0; i < RB; ++i) {
                const __m512 xv = _mm512_set1_ps(x[i * a.sx + k]);
                acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
                acc[i][2] = _mm512_fmadd_ps(xv, w2, acc[i][2]);
                acc[i][3] = _mm512_fmadd_ps(xv, w3, acc[i][3]);
            }
        }
    } else {  // bf16 pairs: a 32-bit lane holds (W[o, 2 k2], W[o, 2 k2 + 1]); widen each half exactly
        const __m512i* w = reinterpret_cast<const __m512i*>(static_cast<const uint32_t*>(a.p) + int64_t(j) * ((a.K + 1) / 2) * OB);
        const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
        for (int k = 0; k < a.K; k += 2, w += 4) {
            if (prefetch) prefetch_ahead(w);
            __m512 we[4], wo[4];
            for (int v = 0; v < 4; ++v) {
                const __m512i p = _mm512_loadu_si512(w + v);
                we[v] = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
                wo[v] = _mm512_castsi512_ps(_mm512_and_si512(p, hi));
            }
            const bool pair = k + 1 < a.K;
            for (int i = 0; i < RB; ++i) {
                const __m512 x0 = _mm512_set1_ps(x[i * a.sx + k]);
                for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_fmadd_ps(x0, we[v], acc[i][v]);
                if (pair) {
                    const __m512 x1 = _mm512_set1_ps(x[i * a.sx + k + 1]);
                    for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_fmadd_ps(x1, wo[v], acc[i][v]);
                }
            }
        }
    }
    for (int i = 0; i < RB; ++i)
        for (int v = 0; v < 4; ++v) store(a, b0 + i, j * OB + 16 * v, acc[i][v]);
}

#ifdef __AVX512BF16__
// Block j x batch rows [b0, b0 + RB): bf16 x and bf16-pair weights, VDPBF16PS over the pairs.
template <int RB>
void tile_dot(const Args& a, int j, int b0, bool prefetch) {
    __m512 acc[RB][4];
    for (int i = 0; i < RB; ++i)
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_ps();
    const uint16_t* x = static_cast<const uint16_t*>(a.x) + int64_t(b0) * a.sx;
    const __m512i* w = reinterpret_cast<const __m512i*>(static_cast<const uint32_t*>(a.p) + int64_t(j) * ((a.K + 1) / 2) * OB);
    for (int k = 0; k < a.K; k += 2, w += 4) {
        if (prefetch) prefetch_ahead(w);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 1);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2), w3 = (__m512bh)_mm512_loadu_si512(w + 3);
        const bool pair = k + 1 < a.K;
        for (int i = 0; i < RB; ++i) {
            const uint32_t lo = x[i * a.sx + k], hi = pair ? x[i * a.sx + k + 1] : 0;
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(lo | (hi << 16)));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xv, w2);
            acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xv, w3);
        }
    }
    for (int i = 0; i < RB; ++i)
        for (int v = 0; v < 4; ++v) store(a, b0 + i, j * OB + 16 * v, acc[i][v]);
}
#endif

template <int RB>
void tile(const Args& a, int j, int b0) {
#ifdef __AVX512BF16__
    if (a.xk == 1) return tile_dot<RB>(a, j, b0, b0 == 0);
#endif
    tile_fma<RB>(a, j, b0, b0 == 0);
}

// Block j for every batch row: batch tiles of RB_MAX, then the remainder.
void block(const Args& a, int j) {
    int b = 0;
    for (; b + RB_MAX <= a.B; b += RB_MAX) tile<RB_MAX>(a, j, b);
    switch (a.B - b) {
        case 5: tile<5>(a, j, b); break;
        case 4: tile<4>(a, j, b); break;
        case 3: tile<3>(a, j, b); break;
        case 2: tile<2>(a, j, b); break;
        case 1: tile<1>(a, j, b); break;
        default: break;
    }
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 on bad arguments (a bf16 x needs a bf16 weight, and AVX512_BF16).
int kvlab_linear(const void* x, int64_t sx, int x_kind, const void* packed, int p_kind, const void* bias,
                 int b_kind, void* y, int64_t sy, int y_kind, int B, int N, int K, int num_threads) {
    if (B < 0 || N < 0 || K < 1 || x_kind < 0 || x_kind > 1 || p_kind < 0 || p_kind > 1 || y_kind < 0 || y_kind > 1)
        return 1;
#ifndef __AVX512BF16__
    if (x_kind == 1) return 1;
#endif
    if (x_kind == 1 && p_kind != 1) return 1;
    const Args a{x, sx, x_kind, packed, p_kind, bias, b_kind, y, sy, y_kind, B, N, K};
    const int blocks = (N + OB - 1) / OB;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int j = 0; j < blocks; ++j) block(a, j);
    return 0;
}

int kvlab_linear_has_bf16_dot() {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

int kvlab_linear_abi_version() { return 2; }

}  // extern "C"
