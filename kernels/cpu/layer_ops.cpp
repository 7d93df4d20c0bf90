// The element-wise ops of a Llama decoder layer on the CPU, each one call where torch runs 4-8 ops, with
// torch's bits: RMSNorm (Zhang & Sennrich, arXiv:1910.07467, as transformers' LlamaRMSNorm computes it), the
// residual add before it, and rotary position embedding (RoFormer, arXiv:2104.09864, as transformers' apply_
// rotary_pos_emb computes it). At batch 1 a decode step of SmolLM2 spends more time dispatching these small ops
// (~3 us each, ~1,500 a step) than computing them; kvlab/engine/lean_forward.py calls these instead.
//
// Every value goes through the same roundings as torch's sequence of ops (kernels/cpu/layer_ops.py holds that
// sequence as the reference; tests/kernels/test_cpu_layer_ops.py compares them bit for bit):
//
//   rms_norm      x32 = float(x); var = sum(x32 * x32) / n; r = 1 / sqrt(var + eps); y = w * dtype(x32 * r)
//                 The sum is torch's CPU sum (aten/src/ATen/native/cpu/SumKernel.cpp, vectorized_inner_sum; its
//                 AVX2 build, 8-lane vectors, which torch dispatches on AVX-512 machines too): lanes of 8
//                 consecutive values, the row's vectors in 4 interleaved partial sums (vector i into partial
//                 i % 4, rows of 4 vectors cascaded in levels of 16 rows, then partial 0 += 1, 2, 3), a scalar
//                 tail (n % 8 values) summed first, then the 8 lanes added to it in lane order. n >= 8 (below,
//                 torch sums another way).
//   add_rms_norm  h = dtype(x + residual), then rms_norm(h): the residual stream and the normed rows
//   rope          y = dtype(dtype(x * cos) + dtype(roll(x, D / 2) * sin))  (sin with rotate_half's signs on it)
//
// dtype() rounds to bfloat16 (nearest even) for bf16 tensors and is the identity for fp32. The file is built
// with -ffp-contract=off (kernels/cpu/build.py): no product and sum may fuse into one FMA, as torch's separate
// ops never do.
//
// Kinds: 0 float32, 1 bfloat16 (x, weight, residual, cos / sin and outputs share one kind).

#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#ifndef __AVX512F__
#error "kvlab_layer_ops needs AVX-512 (built with -march=native): without it the lean forward runs torch's ops"
#endif

namespace {

inline float bf16_to_f(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f_to_bf16(float f) {  // round to nearest even, a NaN stays a quiet NaN (c10::BFloat16's rule)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return uint16_t((u >> 16) | 0x40);
    return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

inline float load(const void* p, int kind, int64_t i) {
    return kind == 0 ? static_cast<const float*>(p)[i] : bf16_to_f(static_cast<const uint16_t*>(p)[i]);
}

inline void put(void* p, int kind, int64_t i, float v) {
    if (kind == 0) static_cast<float*>(p)[i] = v;
    else static_cast<uint16_t*>(p)[i] = f_to_bf16(v);
}

inline float round_to(int kind, float v) { return kind == 0 ? v : bf16_to_f(f_to_bf16(v)); }

// torch's CPU sum of sq[0:n] (float32, n >= 8), in its order (see the header).
float torch_sum(const float* sq, int n) {
    constexpr int V = 8, ILP = 4, LEVELS = 4;
    const int vecs = n / V, rows = vecs / ILP;
    int log2 = 0;
    while ((int64_t(1) << log2) < rows) ++log2;  // CeilLog2(rows) (torch's is 1 for rows <= 2: the same power)
    const int power = log2 / LEVELS > 4 ? log2 / LEVELS : 4, step = 1 << power;
    const int64_t mask = step - 1;
    __m256 acc[LEVELS][ILP];
    for (auto& level : acc)
        for (auto& a : level) a = _mm256_setzero_ps();
    int i = 0;
    for (; i + step <= rows;) {
        for (int j = 0; j < step; ++j, ++i)
            for (int k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], _mm256_loadu_ps(sq + (i * ILP + k) * V));
        for (int j = 1; j < LEVELS; ++j) {
            for (int k = 0; k < ILP; ++k) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < rows; ++i)
        for (int k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], _mm256_loadu_ps(sq + (i * ILP + k) * V));
    for (int j = 1; j < LEVELS; ++j)
        for (int k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    __m256 part = acc[0][0];
    for (int v = rows * ILP; v < vecs; ++v) part = _mm256_add_ps(part, _mm256_loadu_ps(sq + v * V));
    for (int k = 1; k < ILP; ++k) part = _mm256_add_ps(part, acc[0][k]);
    float total = 0.0f;
    for (int t = vecs * V; t < n; ++t) total += sq[t];
    alignas(32) float lanes[V];
    _mm256_store_ps(lanes, part);
    for (int l = 0; l < V; ++l) total += lanes[l];
    return total;
}

// One row: x32 [n] float32 (x widened) -> y = w * dtype(x32 * r).
void norm_row(float* x32, const void* w, void* y, int kind, int n, float eps) {
    float stack[4096];
    float* sq = n <= 4096 ? stack : new float[n];
    for (int t = 0; t < n; ++t) sq[t] = x32[t] * x32[t];
    const float var = torch_sum(sq, n) / float(n);
    const float r = 1.0f / std::sqrt(var + eps);
    for (int t = 0; t < n; ++t) put(y, kind, t, load(w, kind, t) * round_to(kind, x32[t] * r));
    if (sq != stack) delete[] sq;
}

}  // namespace

extern "C" {

// y[t] = rms_norm(x[t]) for t < T; x rows at stride sx, y at sy (elements). With `residual` (not null):
// h[t] = dtype(x[t] + residual[t]) is written to h (stride sh) and normed instead. Returns 0, or 1 on bad args.
int kvlab_rms_norm(const void* x, int64_t sx, const void* residual, int64_t sr, void* h, int64_t sh,
                   const void* weight, void* y, int64_t sy, int kind, int T, int n, float eps) {
    if (kind < 0 || kind > 1 || T < 0 || n < 8 || (residual && !h)) return 1;
    const int es = kind == 0 ? 4 : 2;
    float stack[4096];
    float* x32 = n <= 4096 ? stack : new float[n];
    for (int t = 0; t < T; ++t) {
        const char* xr = static_cast<const char*>(x) + t * sx * es;
        if (residual) {
            const char* rr = static_cast<const char*>(residual) + t * sr * es;
            char* hr = static_cast<char*>(h) + t * sh * es;
            for (int i = 0; i < n; ++i) {
                const float v = round_to(kind, load(xr, kind, i) + load(rr, kind, i));
                put(hr, kind, i, v);
                x32[i] = v;
            }
        } else {
            for (int i = 0; i < n; ++i) x32[i] = load(xr, kind, i);
        }
        norm_row(x32, weight, static_cast<char*>(y) + t * sy * es, kind, n, eps);
    }
    if (x32 != stack) delete[] x32;
    return 0;
}

// y [T, H, D] (contiguous) = rope(x), x [T, H, D] at strides (sxt, sxh, 1), cos / sin [T, D] contiguous (sin with
// rotate_half's signs: cat(-sin1, sin2)). Returns 0, or 1 on bad args.
int kvlab_rope(const void* x, int64_t sxt, int64_t sxh, const void* cos, const void* sin, void* y, int kind,
               int T, int H, int D) {
    if (kind < 0 || kind > 1 || T < 0 || H < 0 || D < 2 || D % 2) return 1;
    const int es = kind == 0 ? 4 : 2, half = D / 2;
    for (int t = 0; t < T; ++t) {
        const char* c = static_cast<const char*>(cos) + int64_t(t) * D * es;
        const char* s = static_cast<const char*>(sin) + int64_t(t) * D * es;
        for (int hh = 0; hh < H; ++hh) {
            const char* xr = static_cast<const char*>(x) + (t * sxt + hh * sxh) * es;
            char* yr = static_cast<char*>(y) + (int64_t(t) * H + hh) * D * es;
            for (int d = 0; d < D; ++d) {
                const int rolled = d < half ? d + half : d - half;  // roll(x, D / 2)[d] = x[d - D / 2 mod D]
                const float a = round_to(kind, load(xr, kind, d) * load(c, kind, d));
                const float b = round_to(kind, load(xr, kind, rolled) * load(s, kind, d));
                put(yr, kind, d, a + b);
            }
        }
    }
    return 0;
}

int kvlab_layer_ops_abi_version() { return 1; }

}  // extern "C"
