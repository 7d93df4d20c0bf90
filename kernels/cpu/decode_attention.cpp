// Paged decode attention on the CPU: one query per row, K/V read straight from the paged pool
// through the block table, each cached byte read once, online softmax (FlashAttention, arXiv:2205.14135;
// Flash-Decoding's split over key ranges, then a reduction of the partials).
//
// Work unit: (row b, key chunk c), every KV head. Chunk c covers the absolute cache indices
// [c * chunk_keys, (c + 1) * chunk_keys) of the row, so how a row is split depends only on its own
// length, never on the batch: every row reduces in the same order whatever else the step holds. The queries
// of a short verification chunk come as rows of their own (query j: seq_len one longer than query j - 1)
// grouped by `row_group`, so their units run chunk by chunk across the group (a key chunk in cache for the next);
// on the vector path with fp32 / bf16 / fp16 pools the group's units of one chunk with the same first key run as
// one blocked unit (attend_unit_vec over the rows: every K/V row read once for all their query heads).
// The G query heads of a KV head share each decoded K/V row (GQA). With AVX-512 and head_dim 64 / 128 / 256
// the vector path runs (attend_unit_vec): a tile's keys scored 16 at a time with one transposing reduction,
// the G heads' value sums accumulated together, fp32 / bf16 / fp16 pools read in place (bf16 widened in
// registers), the next tile's K/V slots prefetched (into L2) while this one is computed, the online softmax of a
// tile held in registers (softmax_tile_vec); otherwise the portable path.
// Attention statistics (optional): each row's scaled scores kept, then exp(s - max) / sum per key, over G heads.
//
// Storage read in-register (decoded a head row of D channels at a time into an L1 buffer):
//   kind 0/1/2   fp32 / bf16 / fp16 pool tensor            [NB, bs, Hkv, D] (strided)
//   kind 3       fp8 pool tensor, per-KV-head float scale   (256-entry LUT of the fp8 codes)
//   kind 10      int8 codes, fp16 scale per token per head  (kvlab.cache.quant.int8)
//   kind 11      KIVI keys: packed codes, fp16 scale/zero per channel over `group` tokens
//   kind 12      KIVI values: packed codes, fp16 scale/zero per token over `group` channels
//   kind 13      fp8 codes (LUT), fp16 scale per token per head (kvlab.cache.quant.fp8, scaling=token)
// Packed kinds may keep open pages in full-precision residual rows (row_of[page] >= 0): element
// e = (pos * Hkv + h) * D + d of row r is res[lease[r * res_k + e / res_chunk] * res_chunk + e % res_chunk]
// (kvlab.cache.quant.page_store).
//
// Shapes: q [T, Hq, D] float32 (strided), out [T, Hq, D] float32 (strided), tables [B, width] int32.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

extern "C" {

struct Side {
    int32_t kind;
    int32_t bits;
    int32_t group;
    int32_t res_dtype;  // 0 fp32, 1 bf16, 2 fp16
    const void* data;
    const uint16_t* scale16;  // packed kinds: fp16 scales
    const uint16_t* zero16;   // KIVI: fp16 zero points
    const float* head_scale;  // kind 3: [Hkv]
    const float* lut;         // kinds 3, 13: [256] fp8 code -> float
    int64_t s_block, s_pos, s_head;  // pool tensor strides (elements; kinds 0-3)
    const void* res;          // residual storage (nullptr: none)
    const int64_t* row_of;    // [pages]
    const int64_t* lease;     // [rows, res_k]
    int64_t res_k;
    int64_t res_chunk;
    int32_t fp8;              // kinds 3, 13: 1 e4m3fn, 2 e5m2 (read in registers), 0 unknown (the LUT)
};

}  // extern "C"

namespace {

#ifndef KVLAB_TILE
#define KVLAB_TILE 32
#endif
constexpr int TILE = KVLAB_TILE;  // keys per online-softmax step (a multiple of 16)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float bf16_to_float(uint16_t x) {
    uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do { man <<= 1; ++e; } while (!(man & 0x400));
            u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | man << 13;
    } else {
        u = sign | (exp + 112) << 23 | man << 13;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
}

inline void bf16_row(const uint16_t* src, float* dst, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
#endif
    for (; i < n; ++i) {
        uint32_t u = uint32_t(src[i]) << 16;
        std::memcpy(dst + i, &u, 4);
    }
}

inline void half_row(const uint16_t* src, float* dst, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
    for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

inline float res_at(const Side& s, int64_t off) {
    switch (s.res_dtype) {
        case 0: return ((const float*)s.res)[off];
        case 1: return bf16_to_float(((const uint16_t*)s.res)[off]);
        default: return half_to_float(((const uint16_t*)s.res)[off]);
    }
}

// The residual row of an open page, head h at slot pos -> dst[D].
void residual_row(const Side& s, int64_t row, int pos, int h, int Hkv, int D, float* dst) {
    int64_t e0 = (int64_t(pos) * Hkv + h) * D;
    const int64_t ch = s.res_chunk;
    if (e0 / ch == (e0 + D - 1) / ch) {  // the head row lies in one chunk: contiguous
        int64_t off = s.lease[row * s.res_k + e0 / ch] * ch + e0 % ch;
        if (s.res_dtype == 0) std::memcpy(dst, (const float*)s.res + off, sizeof(float) * D);
        else if (s.res_dtype == 1) bf16_row((const uint16_t*)s.res + off, dst, D);
        else half_row((const uint16_t*)s.res + off, dst, D);
        return;
    }
    for (int d = 0; d < D; ++d) {
        int64_t e = e0 + d;
        dst[d] = res_at(s, s.lease[row * s.res_k + e / ch] * ch + e % ch);
    }
}

// Head row (page, pos, h) of one side, dequantised to float32. Returns a pointer to the row: into
// the pool itself for fp32 pools, else into `buf` (D floats); `tmp` holds 2 * D floats of scratch and a tag
// (int64 after them: the scale / zero row they hold, -1 for none; reused while consecutive keys share it).
inline __attribute__((always_inline)) const float* load_row(const Side& s, int64_t page, int pos, int h,
                                                           int page_size, int Hkv, int D, float* buf, float* tmp) {
    if (s.kind <= 3) {
        int64_t off = page * s.s_block + pos * s.s_pos + h * s.s_head;
        switch (s.kind) {
            case 0: return (const float*)s.data + off;
            case 1: bf16_row((const uint16_t*)s.data + off, buf, D); return buf;
            case 2: half_row((const uint16_t*)s.data + off, buf, D); return buf;
            default: {
                const uint8_t* c = (const uint8_t*)s.data + off;
                float sc = s.head_scale ? s.head_scale[h] : 1.0f;
                if (s.head_scale) for (int d = 0; d < D; ++d) buf[d] = s.lut[c[d]] * sc;
                else for (int d = 0; d < D; ++d) buf[d] = s.lut[c[d]];
                return buf;
            }
        }
    }
    if (s.res && s.row_of[page] >= 0) {
        residual_row(s, s.row_of[page], pos, h, Hkv, D, buf);
        return buf;
    }
    const int64_t slot = page * page_size + pos;
    switch (s.kind) {
        case 10: {
            const int8_t* c = (const int8_t*)s.data + (slot * Hkv + h) * D;
            float sc = half_to_float(s.scale16[slot * Hkv + h]);
            int d = 0;
#if defined(__AVX512F__)
            for (const __m512 sv = _mm512_set1_ps(sc); d + 16 <= D; d += 16)  // 16 codes widened in registers
                _mm512_storeu_ps(buf + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                            _mm_loadu_si128((const __m128i*)(c + d)))), sv));
#endif
            for (; d < D; ++d) buf[d] = float(c[d]) * sc;
            return buf;
        }
        case 13: {
            const uint8_t* c = (const uint8_t*)s.data + (slot * Hkv + h) * D;
            float sc = half_to_float(s.scale16[slot * Hkv + h]);
            for (int d = 0; d < D; ++d) buf[d] = s.lut[c[d]] * sc;
            return buf;
        }
        default: break;
    }
    const int bits = s.bits, per = 8 / bits, mask = (1 << bits) - 1;
    const uint8_t* c = (const uint8_t*)s.data + (slot * Hkv + h) * (D / per);
    int64_t* tag = (int64_t*)(tmp + 2 * D);  // which scale / zero row tmp holds (keys: shared by `group` tokens)
    float* sc = tmp;
    float* zr = tmp + D;
    int64_t g0;
    int ng;
    if (s.kind == 11) {  // per channel over `group` tokens: scale/zero [pages, bs / G, Hkv, D]
        g0 = ((page * (page_size / s.group) + pos / s.group) * Hkv + h) * D;
        ng = D;
    } else {  // kind 12: per token over `group` channels: scale/zero [slots, Hkv, D / G]
        ng = D / s.group;
        g0 = (slot * Hkv + h) * ng;
    }
    if (*tag != g0) {
        half_row(s.scale16 + g0, sc, ng);
        half_row(s.zero16 + g0, zr, ng);
        *tag = g0;
    }
    const bool per_channel = s.kind == 11;
#if defined(__AVX512F__)
    if (bits == 4 && (D & 15) == 0 && (per_channel || (s.group & 15) == 0)) {
        for (int d = 0; d < D; d += 16) {  // 8 bytes -> 16 codes, low nibble first
            const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(c + d / 2)));
            const __m128i lo = _mm_and_si128(w, _mm_set1_epi16(15)), hi = _mm_srli_epi16(w, 4);
            const __m256i c16 = _mm256_set_m128i(_mm_unpackhi_epi16(lo, hi), _mm_unpacklo_epi16(lo, hi));
            const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(c16));
            const __m512 sv = per_channel ? _mm512_loadu_ps(sc + d) : _mm512_set1_ps(sc[d / s.group]);
            const __m512 zv = per_channel ? _mm512_loadu_ps(zr + d) : _mm512_set1_ps(zr[d / s.group]);
            _mm512_storeu_ps(buf + d, _mm512_add_ps(_mm512_mul_ps(code, sv), zv));  // code * s + z, as the reference
        }
        return buf;
    }
#endif
    for (int d = 0; d < D; ++d) {
        const int code = (c[d / per] >> ((d % per) * bits)) & mask;
        const int at = per_channel ? d : d / s.group;
        buf[d] = float(code) * sc[at] + zr[at];
    }
    return buf;
}

// Dot product in a fixed order: 16 lanes (two AVX-512 accumulators when D is a multiple of 16), then a fixed tree.
inline float dot(const float* a, const float* b, int D) {
#if defined(__AVX512F__)
    if ((D & 15) == 0) {
        __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
        int i = 0;
        for (; i + 32 <= D; i += 32) {
            x0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), x0);
            x1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), x1);
        }
        if (i < D) x0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), x0);
        return _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    }
#endif
    float lane[16] = {0};
    int i = 0;
    for (; i + 16 <= D; i += 16)
        for (int l = 0; l < 16; ++l) lane[l] += a[i + l] * b[i + l];
    for (int l = 0; i < D; ++i, ++l) lane[l] += a[i] * b[i];
    for (int w = 8; w; w >>= 1)
        for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
    return lane[0];
}

// x[i] <- exp(x[i] - m) for x[i] <= m (0 where x[i] - m < -87, -inf included): 2^k * p(r), r = t - k ln 2,
// |r| <= ln 2 / 2, a degree-6 polynomial (relative error ~2e-7); returns the sum of the new x[i], in a fixed order.
#if defined(__AVX512F__)
inline __m512 exp_neg(__m512 t) {
    const __m512 c = _mm512_max_ps(t, _mm512_set1_ps(-87.f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), c);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    const __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
    return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}
#endif

inline float exp_sub(float* x, int n, float m) {
#if defined(__AVX512F__)
    __m512 sum = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 in = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
        const __m512 y = exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, x + i), mv));
        _mm512_mask_storeu_ps(x + i, in, y);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(in, y));
    }
    return _mm512_reduce_add_ps(sum);
#else
    float sum = 0.f;
    for (int i = 0; i < n; ++i) {
        const float t = std::max(x[i] - m, -87.f);
        const float k = std::nearbyint(t * 1.44269504088896341f);
        const float r = (t - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
        float p = 1.f / 720.f;
        p = p * r + 1.f / 120.f;
        p = p * r + 1.f / 24.f;
        p = p * r + 1.f / 6.f;
        p = p * r + 0.5f;
        p = p * r + 1.f;
        p = p * r + 1.f;
        int32_t bits = (int32_t(k) + 127) << 23;
        float scale;
        std::memcpy(&scale, &bits, 4);
        x[i] = x[i] - m < -87.f ? 0.f : p * scale;
        sum += x[i];
    }
    return sum;
#endif
}

// max(m, x[0..n)) (x scaled by `scale` in place first).
inline float scale_max(float* x, int n, float scale, float m) {
    for (int i = 0; i < n; ++i) x[i] *= scale;
#if defined(__AVX512F__)
    __m512 mx = _mm512_set1_ps(m);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 in = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
        mx = _mm512_mask_max_ps(mx, in, mx, _mm512_maskz_loadu_ps(in, x + i));
    }
    return _mm512_reduce_max_ps(mx);
#else
    for (int i = 0; i < n; ++i) m = std::max(m, x[i]);
    return m;
#endif
}

#if defined(__AVX512F__)
// NC = D / 16 chunks held in registers: NC independent FMA chains over the tile's keys.
template <int NC>
inline void accumulate_nc(float* acc, const float* p, const float* const* rows, int n) {
    __m512 x[NC];
    for (int c = 0; c < NC; ++c) x[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int i = 0; i < n; ++i) {
        const __m512 w = _mm512_set1_ps(p[i]);
        for (int c = 0; c < NC; ++c) x[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(rows[i] + 16 * c), x[c]);
    }
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + 16 * c, x[c]);
}

// s[g * stride] = q[g] . k for the G heads, each k chunk loaded once (G independent chains).
template <int NC>
inline void dots_nc(const float* q, const float* k, int G, float* s, int stride) {
    __m512 kc[NC];
    for (int c = 0; c < NC; ++c) kc[c] = _mm512_loadu_ps(k + 16 * c);
    for (int g = 0; g < G; ++g) {
        const float* qg = q + size_t(g) * NC * 16;
        __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(qg), kc[0]);
        __m512 x1 = NC > 1 ? _mm512_mul_ps(_mm512_loadu_ps(qg + 16), kc[1]) : _mm512_setzero_ps();
        for (int c = 2; c + 1 < NC; c += 2) {
            x0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kc[c], x0);
            x1 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c + 16), kc[c + 1], x1);
        }
        if (NC > 2 && NC % 2) x0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * (NC - 1)), kc[NC - 1], x0);
        s[g * stride] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    }
}
#endif

// acc [D] += sum over i < n of p[i] * rows[i] [D], keys in order.
inline void accumulate(float* acc, const float* p, const float* const* rows, int n, int D) {
#if defined(__AVX512F__)
    switch (D) {
        case 64: return accumulate_nc<4>(acc, p, rows, n);
        case 128: return accumulate_nc<8>(acc, p, rows, n);
        case 256: return accumulate_nc<16>(acc, p, rows, n);
        default: break;
    }
    if ((D & 15) == 0) {
        for (int c = 0; c < D; c += 16) {
            __m512 x = _mm512_loadu_ps(acc + c);
            for (int i = 0; i < n; ++i) x = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), _mm512_loadu_ps(rows[i] + c), x);
            _mm512_storeu_ps(acc + c, x);
        }
        return;
    }
#endif
    for (int i = 0; i < n; ++i)
        for (int d = 0; d < D; ++d) acc[d] += p[i] * rows[i][d];
}

// s[g * stride] = q[g] [D] . k [D] for g < G.
inline void dots(const float* q, const float* k, int G, int D, float* s, int stride) {
#if defined(__AVX512F__)
    switch (D) {
        case 64: return dots_nc<4>(q, k, G, s, stride);
        case 128: return dots_nc<8>(q, k, G, s, stride);
        case 256: return dots_nc<16>(q, k, G, s, stride);
        default: break;
    }
#endif
    for (int g = 0; g < G; ++g) s[g * stride] = dot(q + size_t(g) * D, k, D);
}

struct Args {
    const float* q; int64_t q_st, q_sh;
    const Side* k; const Side* v;
    const int32_t* tables; int64_t table_stride;
    const int32_t* tokens; const int32_t* seq_lens; const int32_t* first_key;
    int Hkv, G, D, page;
    float scale, softcap;
    float* raw;              // null, or the scaled scores of every decode row: row b's [Hkv * G, seq_len - first_key]
    const int64_t* raw_off;  // [B] where row b's start in `raw`
};

// Where the scaled scores of row b, query head hg, key j go (null: no statistics).
inline float* raw_at(const Args& a, int b, int hg, int j) {
    if (!a.raw) return nullptr;
    return a.raw + a.raw_off[b] + int64_t(hg) * (a.seq_lens[b] - a.first_key[b]) + (j - a.first_key[b]);
}

// One tile's online-softmax step for one query head: scores sg[0..n) (raw q . k) become weights exp(s - m'),
// acc [D] and l are rescaled to the new running max m'. `raw` (when not null) receives the scaled (and
// soft-capped) scores, for the attention statistics. Returns false (and zero weights) when no key of the tile is
// visible and none was before.
inline bool softmax_tile(const Args& a, float* sg, int n, float* m, float* l, float* acc, int D, float* raw,
                         int raw_n) {
    if (a.softcap > 0.f)  // s = cap * tanh(s * scale / cap) (Gemma 2)
        for (int i = 0; i < n; ++i)
            sg[i] = sg[i] == NEG_INF ? NEG_INF : a.softcap * std::tanh(sg[i] * a.scale / a.softcap);
    const float mt = scale_max(sg, n, a.softcap > 0.f ? 1.f : a.scale, *m);
    if (raw) std::memcpy(raw, sg, sizeof(float) * raw_n);
    if (mt == NEG_INF) {
        std::memset(sg, 0, sizeof(float) * n);
        return false;
    }
    const float alpha = std::exp(*m - mt);
    if (alpha != 1.f) {
        for (int d = 0; d < D; ++d) acc[d] *= alpha;
        *l *= alpha;
    }
    *l += exp_sub(sg, n, mt);
    *m = mt;
    return true;
}

// Bytes of one key's slot (every KV head) in a side's main storage, and where it starts.
inline const char* slot_bytes(const Side& s, int64_t page, int pos, int page_size, int Hkv, int D, int64_t* n) {
    static const int esize[4] = {4, 2, 2, 1};
    if (s.kind <= 3) {
        *n = int64_t(Hkv) * s.s_head * esize[s.kind];
        return (const char*)s.data + (page * s.s_block + pos * s.s_pos) * esize[s.kind];
    }
    const int64_t per_slot = s.kind == 10 || s.kind == 13 ? int64_t(Hkv) * D : int64_t(Hkv) * D * s.bits / 8;
    *n = per_slot;
    return (const char*)s.data + (page * page_size + pos) * per_slot;
}

// A cache line prefetched into L2 (prefetcht2; KVLAB_PF_INSN overrides, KVLAB_NO_PF turns prefetching off). Into L1
// (prefetcht0) the tile's burst of lines waits on the core's few L1 miss buffers and the kernel stalls on its own
// prefetches (58% of the unit's samples at 16 x 4096 fp32, q_len 1); into L2 the same bits came 1.5-1.7x faster
// (fp32 / bf16, q_len 1 and 5). Not __builtin_prefetch (nor _mm_prefetch, built on it): GCC finds the
// functions that only prefetch free of side effects and drops every call to them (the kernel's first version
// issued no prefetch at all); a volatile asm stays.
#ifndef KVLAB_PF_INSN
#define KVLAB_PF_INSN "prefetcht2"
#endif
inline void prefetch_line(const char* p) {
#if defined(KVLAB_NO_PF)
    (void)p;
#elif defined(__x86_64__)
    asm volatile(KVLAB_PF_INSN " %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 0, 3);
#endif
}

// The scales / zero points a packed kind reads with a key's codes.
__attribute__((noinline)) void prefetch_scales(const Side& s, int64_t page, int pos, int page_size, int Hkv, int D) {
    const int64_t slot = page * page_size + pos;
    int64_t g0 = -1, ng = 0;
    if (s.kind == 10 || s.kind == 13) {  // fp16 scale per token per head
        g0 = slot * Hkv, ng = Hkv;
    } else if (s.kind == 11) {  // KIVI keys: per channel over `group` tokens, read at the group's first token
        if (pos % s.group == 0) g0 = (page * (page_size / s.group) + pos / s.group) * Hkv * D, ng = int64_t(Hkv) * D;
    } else {  // KIVI values: per token over `group` channels
        ng = int64_t(Hkv) * (D / s.group), g0 = slot * ng;
    }
    if (g0 < 0) return;
    for (int64_t o = 0; o < 2 * ng + 63; o += 64) {
        prefetch_line((const char*)(s.scale16 + g0) + std::min(o, 2 * ng - 1));
        if (s.zero16) prefetch_line((const char*)(s.zero16 + g0) + std::min(o, 2 * ng - 1));
    }
}

// A key's slot (every KV head) of one side: its codes, and for packed kinds their scales / zero points.
inline void prefetch_slot(const Side& s, int64_t page, int pos, int page_size, int Hkv, int D) {
    int64_t n;
    const char* p = slot_bytes(s, page, pos, page_size, Hkv, D, &n);
    for (int64_t o = 0; o < n; o += 64) prefetch_line(p + o);
    if (s.kind >= 10 && s.scale16) prefetch_scales(s, page, pos, page_size, Hkv, D);
}

// One unit: keys [lo, hi) of row b, every KV head -> m [Hkv, G], l [Hkv, G], acc [Hkv, G, D] (unnormalised).
// Keys are walked in order, a tile at a time, reading each key's slot (all its heads) while the next
// tile's slots are prefetched.
void attend_unit_generic(const Args& a, int b, int lo, int hi, float* m, float* l, float* acc) {
    const int G = a.G, D = a.D, Hkv = a.Hkv, HG = Hkv * G;
    const size_t tmp_len = 2 * size_t(D) + 2;  // scale / zero rows of one KV head and their tag
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(HG) * D + 2 * Hkv * tmp_len + size_t(2 * TILE) * Hkv * D + D + size_t(HG) * TILE);
    float* qg = scratch.data();                       // [Hkv * G, D]
    float* ktmp = qg + size_t(HG) * D;                // [Hkv, tmp_len] per KV head: keys' scale rows serve G tokens
    float* vtmp = ktmp + Hkv * tmp_len;               // [Hkv, tmp_len]
    float* kbuf = vtmp + Hkv * tmp_len;               // [TILE, Hkv, D] decoded K rows
    float* vbuf = kbuf + size_t(TILE) * Hkv * D;      // [TILE, Hkv, D]
    float* zeros = vbuf + size_t(TILE) * Hkv * D;     // [D] the row a released key points at (its weight is 0)
    float* s = zeros + D;                             // [Hkv * G, TILE] scores, then weights
    for (int h = 0; h < 2 * Hkv; ++h) *(int64_t*)(ktmp + h * tmp_len + 2 * D) = -1;  // no scale row held yet
    std::memset(zeros, 0, sizeof(float) * D);
    const float* vrow[TILE];
    int64_t pages[TILE];
    int pos_of[TILE];
    const int t = a.tokens[b];
    for (int hg = 0; hg < HG; ++hg) {
        std::memcpy(qg + size_t(hg) * D, a.q + t * a.q_st + int64_t(hg) * a.q_sh, sizeof(float) * D);
        m[hg] = NEG_INF;
        l[hg] = 0.f;
    }
    std::memset(acc, 0, sizeof(float) * HG * D);
    const int32_t* table = a.tables + b * a.table_stride;
    int col = lo / a.page, pos = lo % a.page;  // table column and slot of the next key (counted: no division)
    for (int j0 = lo; j0 < hi; j0 += TILE) {
        const int n = std::min(TILE, hi - j0);
        for (int i = 0; i < n; ++i) {
            pos_of[i] = pos;
            pages[i] = table[col];
            if (++pos == a.page) { pos = 0; ++col; }
            if (pages[i] >= 0) prefetch_slot(*a.v, pages[i], pos_of[i], a.page, Hkv, D);  // read after the keys
        }
        for (int i = 0; i < n; ++i) {  // scores, key-major: each key's slot (every KV head) read in order
            if (pages[i] < 0) {  // released page: never attended to
                for (int hg = 0; hg < HG; ++hg) s[hg * TILE + i] = NEG_INF;
                continue;
            }
            for (int h = 0; h < Hkv; ++h) {
                const float* kr = load_row(*a.k, pages[i], pos_of[i], h, a.page, Hkv, D,
                                           kbuf + (size_t(i) * Hkv + h) * D, ktmp + h * tmp_len);
                dots(qg + size_t(h * G) * D, kr, G, D, s + size_t(h * G) * TILE + i, TILE);
            }
        }
        for (int h = 0; h < Hkv; ++h) {
            for (int i = 0; i < n; ++i)  // each V row decoded once for the G heads
                vrow[i] = pages[i] < 0 ? zeros
                                       : load_row(*a.v, pages[i], pos_of[i], h, a.page, Hkv, D,
                                                  vbuf + (size_t(i) * Hkv + h) * D, vtmp + h * tmp_len);
            for (int g = 0; g < G; ++g) {  // online softmax: rescale once per tile
                const int hg = h * G + g;
                float* sg = s + size_t(hg) * TILE;
                float* ag = acc + size_t(hg) * D;
                if (!softmax_tile(a, sg, n, m + hg, l + hg, ag, D, raw_at(a, b, hg, j0), n)) continue;
                accumulate(ag, sg, vrow, n, D);
            }
        }
    }
}

#if defined(__AVX512F__)
// ---- The vector path: AVX-512, head_dim 64 / 128 / 256 ----
// Scores: 16 keys at a time, each key's 16-lane partial products (one FMA chain over its chunks), then one
// transposing reduction of the 16 partials (no key pays a horizontal sum of its own). Values: the G query heads
// of a KV head accumulate every V row together (G x 4 independent FMA chains per 64 channels, each V chunk
// loaded once for them). Element-wise pools are read in place and widened in registers; bf16 without a shuffle:
// a 32-bit lane of 32 loaded channels holds channel 2j (low half) and 2j + 1 (high half), so `lane << 16` and
// `lane & 0xffff0000` are the even and the odd channels. Such rows are read in that "lane order": q is permuted
// to it for scoring, and a bf16 V side's accumulators are permuted back when the unit ends. Every sum still runs
// in a fixed order that depends on nothing but the row's own keys.

// How a row's chunks are loaded. F32 / BF16 / F16: the pool's values (decoded kinds: F32 rows in a buffer).
// I8 / E4M3 / E5M2: one-byte codes widened in registers; the row's scale is applied outside the chunk (a key's to
// its score, a value's to its weight): int8 codes as integers, fp8 codes as float16 (e5m2 is a float16's top byte;
// e4m3's 7 bits below the sign, shifted into a float16's, give the value times 2^-8: subnormals included, which
// the scale's factor 2^8 restores exactly; e4m3fn's NaN codes, never written by the quantiser, read as 480 * 2^8).
enum Src { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, E4M3 = 4, E5M2 = 5 };

template <int S>
constexpr int src_bytes() { return S == F32 ? 4 : S == BF16 || S == F16 ? 2 : 1; }

template <int S>
inline __m512 chunk(const void* row, int c) {  // 16 channels of a row, in its lane order
    if constexpr (S == F32) {
        return _mm512_loadu_ps((const float*)row + 16 * c);
    } else if constexpr (S == F16) {
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)row + 16 * c)));
    } else if constexpr (S == I8) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)row + 16 * c))));
    } else if constexpr (S == E4M3 || S == E5M2) {
        const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)((const uint8_t*)row + 16 * c)));
        const __m256i h = S == E5M2 ? _mm256_slli_epi16(x, 8)
                                    : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7),
                                                      _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
        return _mm512_cvtph_ps(h);
    } else {
        const __m512i w = _mm512_loadu_si512((const uint16_t*)row + 32 * (c >> 1));
        return _mm512_castsi512_ps(c & 1 ? _mm512_and_si512(w, _mm512_set1_epi32(int(0xffff0000u)))
                                         : _mm512_slli_epi32(w, 16));
    }
}

// Lane i of the result = the sum of the 16 lanes of p[i] (a fixed tree: halves, quarters, pairs, then one permute).
inline __m512 transpose_sum16(const __m512* p) {
    __m512 t[8], u[4], v[2];
    for (int j = 0; j < 8; ++j)  // t[j]: 128-bit lanes 0-1 key 2j, 2-3 key 2j + 1
        t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * j], p[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(p[2 * j], p[2 * j + 1], 0xee));
    for (int j = 0; j < 4; ++j)  // u[j]: 128-bit lane k holds key 4j + k
        u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0xdd));
    for (int j = 0; j < 2; ++j)  // v[j]: lane k holds keys 8j + k (elements 0, 2) and 8j + 4 + k (1, 3)
        v[j] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * j], u[2 * j + 1]), _mm512_unpackhi_ps(u[2 * j], u[2 * j + 1]));
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x44), _mm512_shuffle_ps(v[0], v[1], 0xee));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}

// s[g * TILE + i] = q[g] . rows[i] for g < G, i < n (rows past n: any readable row); q [G, D] in the rows' lane order.
template <int S, int NC>
void score_tile(const float* q, int G, const void* const* rows, int n, float* s) {
    for (int g = 0; g < G; ++g) {
        __m512 qv[NC];
        for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q + size_t(g) * NC * 16 + 16 * c);
        for (int i0 = 0; i0 < n; i0 += 16) {
            __m512 p[16];
            for (int i = 0; i < 16; ++i) {
                const void* r = rows[i0 + i];
                __m512 x = _mm512_mul_ps(qv[0], chunk<S>(r, 0));
#pragma GCC unroll 16
                for (int c = 1; c < NC; ++c) x = _mm512_fmadd_ps(qv[c], chunk<S>(r, c), x);
                p[i] = x;
            }
            _mm512_storeu_ps(s + g * TILE + i0, transpose_sum16(p));
        }
    }
}

// acc[g] [chunks 0..CB) += sum over i < n of w[g * TILE + i] * rows[i] for g < GB, keys in order.
template <int S, int GB, int CB>
inline void accumulate_block(float* acc, int D, const float* w, const void* const* rows, int n) {
    __m512 x[GB][CB];
    for (int g = 0; g < GB; ++g)
        for (int c = 0; c < CB; ++c) x[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
    for (int i = 0; i < n; ++i) {
        __m512 v[CB];
        for (int c = 0; c < CB; ++c) v[c] = chunk<S>(rows[i], c);
        for (int g = 0; g < GB; ++g) {
            const __m512 wg = _mm512_set1_ps(w[g * TILE + i]);
            for (int c = 0; c < CB; ++c) x[g][c] = _mm512_fmadd_ps(wg, v[c], x[g][c]);
        }
    }
    for (int g = 0; g < GB; ++g)
        for (int c = 0; c < CB; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, x[g][c]);
}

// acc [G, D] (V's lane order) += w [G, TILE] x rows [n, D]: blocks of 4 heads x 64 channels.
template <int S>
void accumulate_tile(float* acc, int G, int D, const float* w, const void* const* rows, int n) {
    constexpr int esize = src_bytes<S>();
    const void* r[TILE];
    for (int c0 = 0; c0 < D / 16; c0 += 4) {
        for (int i = 0; i < n; ++i) r[i] = (const char*)rows[i] + 16 * c0 * esize;
        for (int g0 = 0; g0 < G; g0 += 4) {
            float* ag = acc + size_t(g0) * D + 16 * c0;
            const float* wg = w + g0 * TILE;
            switch (std::min(4, G - g0)) {
                case 1: accumulate_block<S, 1, 4>(ag, D, wg, r, n); break;
                case 2: accumulate_block<S, 2, 4>(ag, D, wg, r, n); break;
                case 3: accumulate_block<S, 3, 4>(ag, D, wg, r, n); break;
                default: accumulate_block<S, 4, 4>(ag, D, wg, r, n); break;
            }
        }
    }
}

template <int S>
void score_any(const float* q, int G, int D, const void* const* rows, int n, float* s) {
    switch (D) {
        case 64: return score_tile<S, 4>(q, G, rows, n, s);
        case 128: return score_tile<S, 8>(q, G, rows, n, s);
        default: return score_tile<S, 16>(q, G, rows, n, s);
    }
}

inline void score(int src, const float* q, int G, int D, const void* const* rows, int n, float* s) {
    switch (src) {
        case F32: return score_any<F32>(q, G, D, rows, n, s);
        case BF16: return score_any<BF16>(q, G, D, rows, n, s);
        case F16: return score_any<F16>(q, G, D, rows, n, s);
        case I8: return score_any<I8>(q, G, D, rows, n, s);
        case E4M3: return score_any<E4M3>(q, G, D, rows, n, s);
        default: return score_any<E5M2>(q, G, D, rows, n, s);
    }
}

inline void accumulate_src(int src, float* acc, int G, int D, const float* w, const void* const* rows, int n) {
    switch (src) {
        case F32: return accumulate_tile<F32>(acc, G, D, w, rows, n);
        case BF16: return accumulate_tile<BF16>(acc, G, D, w, rows, n);
        case F16: return accumulate_tile<F16>(acc, G, D, w, rows, n);
        case I8: return accumulate_tile<I8>(acc, G, D, w, rows, n);
        case E4M3: return accumulate_tile<E4M3>(acc, G, D, w, rows, n);
        default: return accumulate_tile<E5M2>(acc, G, D, w, rows, n);
    }
}

#if defined(__AVX512BF16__)
// s[g * TILE + i] = q[g] . rows[i] with VDPBF16PS (bf16 pairs multiplied exactly, summed in fp32; subnormals
// flushed): q [G, D] bf16 in channel order, rows bf16 (rows past n: any readable row); D a multiple of 32.
template <int NZ>
void score_tile_dp(const uint16_t* q, int G, const void* const* rows, int n, float* s) {
    for (int g = 0; g < G; ++g) {
        __m512bh qv[NZ];
        for (int z = 0; z < NZ; ++z) qv[z] = (__m512bh)_mm512_loadu_si512(q + size_t(g) * NZ * 32 + 32 * z);
        for (int i0 = 0; i0 < n; i0 += 16) {
            __m512 p[16];
            for (int i = 0; i < 16; ++i) {
                const uint16_t* r = (const uint16_t*)rows[i0 + i];
                __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(r));
#pragma GCC unroll 8
                for (int z = 1; z < NZ; ++z) x = _mm512_dpbf16_ps(x, qv[z], (__m512bh)_mm512_loadu_si512(r + 32 * z));
                p[i] = x;
            }
            _mm512_storeu_ps(s + g * TILE + i0, transpose_sum16(p));
        }
    }
}

inline void score_dp(const uint16_t* q, int G, int D, const void* const* rows, int n, float* s) {
    switch (D) {
        case 64: return score_tile_dp<2>(q, G, rows, n, s);
        case 128: return score_tile_dp<4>(q, G, rows, n, s);
        default: return score_tile_dp<8>(q, G, rows, n, s);
    }
}
#endif

// softmax_tile on the vector path, the tile's scores held in registers: sg [TILE] raw scores (lanes past n: any
// finite or not), `vis` bit i set for the keys the row sees (in range, causal, page not released; the rest score
// -inf). The same operations in the same order as softmax_tile after its masking loops, so the same bits, without
// their stores and the reloads behind them (a masked load cannot take its data from a store still in flight).
inline bool softmax_tile_vec(const Args& a, float* sg, int n, uint64_t vis, float* m, float* l, float* acc, int D,
                             float* raw, int raw_n) {
    static_assert(TILE % 16 == 0 && TILE <= 64, "a tile's visibility is a 64-bit mask");
    constexpr int NV = TILE / 16;
    if (a.softcap > 0.f)  // s = cap * tanh(s * scale / cap) (Gemma 2); invisible keys are masked below
        for (int i = 0; i < n; ++i) sg[i] = a.softcap * std::tanh(sg[i] * a.scale / a.softcap);
    const __m512 sc = _mm512_set1_ps(a.softcap > 0.f ? 1.f : a.scale), ninf = _mm512_set1_ps(NEG_INF);
    __m512 x[NV];  // [TILE] scaled scores, -inf where not visible
    __m512 mx = _mm512_set1_ps(*m);
    for (int v = 0; v < NV; ++v) {
        x[v] = _mm512_mask_mov_ps(ninf, __mmask16(vis >> (16 * v)), _mm512_mul_ps(_mm512_loadu_ps(sg + 16 * v), sc));
        mx = _mm512_max_ps(mx, x[v]);
    }
    const float mt = _mm512_reduce_max_ps(mx);
    if (raw)
        for (int v = 0; v < NV && 16 * v < raw_n; ++v)
            _mm512_mask_storeu_ps(raw + 16 * v, raw_n - 16 * v >= 16 ? __mmask16(0xffff)
                                                                    : __mmask16((1u << (raw_n - 16 * v)) - 1), x[v]);
    if (mt == NEG_INF) {
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(sg + 16 * v, _mm512_setzero_ps());
        return false;
    }
    if (mt != *m) {  // softmax_tile's alpha; when the max stays, exp(0) = 1 and it rescales nothing
        const float alpha = std::exp(*m - mt);
        if (alpha != 1.f) {
            const __m512 av = _mm512_set1_ps(alpha);
            for (int d = 0; d < D; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), av));
            *l *= alpha;
        }
    }
    const __m512 mv = _mm512_set1_ps(mt);
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < NV; ++v) {
        const __m512 y = exp_neg(_mm512_sub_ps(x[v], mv));  // invisible keys: 0
        _mm512_storeu_ps(sg + 16 * v, y);
        sum = _mm512_add_ps(sum, y);
    }
    *l += _mm512_reduce_add_ps(sum);
    *m = mt;
    return true;
}

// How a side is read in registers (its Src), or -1: decoded into a float32 buffer first (KIVI codes, fp8 of an
// unknown encoding).
inline int register_src(const Side& s) {
    if (s.kind <= 2) return s.kind;
    if (s.kind == 10) return I8;
    if (s.kind == 3 || s.kind == 13) return s.fp8 == 1 ? E4M3 : s.fp8 == 2 ? E5M2 : -1;
    return -1;
}

// The factor a register-read row's codes take: its token's scale (kinds 10, 13), the head's (kind 3), times 2^8
// for e4m3 codes read as float16 (see Src); 1 for element-wise float pools.
inline float row_scale(const Side& s, int src, int64_t page, int pos, int h, int page_size, int Hkv) {
    float f = src == E4M3 ? 256.f : 1.f;
    if (s.kind == 3) return s.head_scale ? f * s.head_scale[h] : f;
    if (s.kind == 10 || s.kind == 13) return f * half_to_float(s.scale16[(page * page_size + pos) * Hkv + h]);
    return f;
}

// Where head h of a register-read row starts.
inline const void* register_row(const Side& s, int64_t page, int pos, int h, int page_size, int Hkv, int D) {
    if (s.kind <= 3) {
        static const int esize[4] = {4, 2, 2, 1};
        return (const char*)s.data + (page * s.s_block + pos * s.s_pos + h * s.s_head) * esize[s.kind];
    }
    return (const int8_t*)s.data + ((page * page_size + pos) * Hkv + h) * D;  // kinds 10, 13: [slots, Hkv, D] bytes
}

// Whether every key of the tile is read from its codes (a packed page still open is read from its residual row,
// decoded: then the whole tile is).
inline bool codes_only(const Side& s, const int64_t* pages, int n) {
    if (s.kind <= 3 || !s.res) return true;
    for (int i = 0; i < n; ++i)
        if (pages[i] >= 0 && s.row_of[pages[i]] >= 0) return false;
    return true;
}

// Whether q (HG rows of D floats at q_sh apart) holds bf16 values only (the engine's bf16 queries, widened).
inline bool bf16_exact(const float* q, int64_t q_sh, int HG, int D) {
    for (int hg = 0; hg < HG; ++hg)
        for (int d = 0; d < D; ++d) {
            uint32_t u;
            std::memcpy(&u, q + hg * q_sh + d, 4);
            if (u & 0xffff) return false;
        }
    return true;
}

// lane order of a bf16 row <-> channel order, per 32 channels: lane j <-> channel 2j, lane 16 + j <-> 2j + 1.
inline void to_bf16_lanes(const float* x, float* y, int D) {
    for (int b = 0; b < D; b += 32)
        for (int j = 0; j < 16; ++j) { y[b + j] = x[b + 2 * j]; y[b + 16 + j] = x[b + 2 * j + 1]; }
}

inline void from_bf16_lanes(float* x, int D, float* tmp) {
    std::memcpy(tmp, x, sizeof(float) * D);
    for (int b = 0; b < D; b += 32)
        for (int j = 0; j < 16; ++j) { x[b + 2 * j] = tmp[b + j]; x[b + 2 * j + 1] = tmp[b + 16 + j]; }
}

// Where a key's slot (page, pos) of an element-wise side (kinds 0-2) starts, as bytes; head h is at + h * head_bytes.
inline const char* slot_at(const Side& s, int64_t page, int pos) {
    return (const char*)s.data + (page * s.s_block + pos * s.s_pos) * (s.kind == 0 ? 4 : 2);
}

#ifndef KVLAB_PREFETCH_AHEAD
#define KVLAB_PREFETCH_AHEAD 1  // tiles ahead whose K and V slots are prefetched
#endif

// One work unit over the rows rb[0..nr) of a group (the queries of one verification chunk, sharing the pages and
// the unit's first key lo; row r's keys end at his[r]): keys [lo, max his), every KV head, each K / V row read
// once for the nr x G query heads of its KV head. Row r's results go to m[r] [Hkv, G], l[r], acc[r] [Hkv, G, D].
// Every (row, head) is computed as when the row runs alone: the same tiles (from lo), the same per-head dot
// products and sums; keys of a tile past his[r] score -inf, which leaves the row's max, sum and accumulators
// exactly as they were (exp gives 0, sums add +0, FMAs add 0 * v).
void attend_unit_vec(const Args& a, const int* rb, int nr, int lo, const int* his, float* const* mo,
                     float* const* lo_, float* const* acco) {
    const int G = a.G, D = a.D, Hkv = a.Hkv, HG = Hkv * G, GG = nr * G, HGG = Hkv * GG;
    const int kreg = register_src(*a.k), vreg = register_src(*a.v);  // -1: decoded into a buffer (F32)
    const size_t tmp_len = 2 * size_t(D) + 2;
    int hi = lo;
    for (int r = 0; r < nr; ++r) hi = std::max(hi, his[r]);
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(HGG) * D + 2 * Hkv * tmp_len + size_t(2 * TILE) * Hkv * D + D + 2 * size_t(HGG) * TILE + D
                   + size_t(HGG) * D + 2 * size_t(HGG) + size_t(HGG) * D);
    float* qg = scratch.data();                       // [Hkv, nr * G, D] in K's lane order
    float* ktmp = qg + size_t(HGG) * D;               // [Hkv, tmp_len]
    float* vtmp = ktmp + Hkv * tmp_len;               // [Hkv, tmp_len]
    float* kbuf = vtmp + Hkv * tmp_len;               // [TILE, Hkv, D] decoded K rows (KIVI kinds, residual rows)
    float* vbuf = kbuf + size_t(TILE) * Hkv * D;      // [TILE, Hkv, D]
    float* zeros = vbuf + size_t(TILE) * Hkv * D;     // [D] the row a released key (or a padding lane) reads
    float* s = zeros + D;                             // [Hkv, nr * G, TILE] scores, then weights
    float* ws = s + size_t(HGG) * TILE;               // [nr * G, TILE] weights times the V rows' scales
    float* tmp = ws + size_t(HGG) * TILE;             // [D]
    uint16_t* qb = (uint16_t*)(tmp + D);              // [Hkv, nr * G, D] bf16 queries in channel order (VDPBF16PS)
    float* m = tmp + D + size_t(HGG) * D;             // [Hkv, nr * G] running max, denominator, accumulators
    float* l = m + HGG;
    float* acc = l + HGG;                             // [Hkv, nr * G, D]
    for (int h = 0; h < 2 * Hkv; ++h) *(int64_t*)(ktmp + h * tmp_len + 2 * D) = -1;
    std::memset(zeros, 0, sizeof(float) * D);
    const void* rows[TILE];
    float ksc[TILE] = {}, vsc[TILE] = {};
    int64_t pages[TILE];
    int pos_of[TILE];
#if defined(__AVX512BF16__)
    const bool dp = kreg == BF16 && D % 32 == 0 && bf16_exact(a.q + a.tokens[rb[0]] * a.q_st, a.q_sh, HG, D);
#else
    const bool dp = false;
#endif  // the caller groups rows only when bf16_exact agrees on all of them
    for (int r = 0; r < nr; ++r) {
        const float* q0 = a.q + a.tokens[rb[r]] * a.q_st;
        for (int hg = 0; hg < HG; ++hg) {
            const int hk = (hg / G) * GG + r * G + hg % G;
            const float* src = q0 + int64_t(hg) * a.q_sh;
            if (dp)
                for (int d = 0; d < D; ++d) { uint32_t u; std::memcpy(&u, src + d, 4); qb[size_t(hk) * D + d] = u >> 16; }
            if (kreg == BF16) to_bf16_lanes(src, qg + size_t(hk) * D, D);
            else std::memcpy(qg + size_t(hk) * D, src, sizeof(float) * D);
            m[hk] = NEG_INF;
            l[hk] = 0.f;
        }
    }
    std::memset(acc, 0, sizeof(float) * HGG * D);
    const int32_t* table = a.tables + rb[0] * a.table_stride;
    int col = lo / a.page, pos = lo % a.page;    // table column and slot of the next key
    int pcol = col, ppos = pos, prefetched = lo;  // and of the next key to prefetch
    auto prefetch_to = [&](int until) {
        for (; prefetched < std::min(until, hi); ++prefetched) {
            const int64_t pg = table[pcol];
            if (pg >= 0) {
                prefetch_slot(*a.k, pg, ppos, a.page, Hkv, D);
                prefetch_slot(*a.v, pg, ppos, a.page, Hkv, D);
            }
            if (++ppos == a.page) { ppos = 0; ++pcol; }
        }
    };
    for (int j0 = lo; j0 < hi; j0 += TILE) {
        const int n = std::min(TILE, hi - j0);
        // the keys up to KVLAB_PREFETCH_AHEAD tiles ahead are prefetched, the next tile's a part before each
        // head's scores and values (in one burst they fill the miss queue and the loads of this tile wait behind it)
        const int pf_base = j0 + KVLAB_PREFETCH_AHEAD * TILE;
        prefetch_to(pf_base);
        uint64_t live = 0;  // bit i: key i of the tile is in the row's range and its page not released
        for (int i = 0; i < n; ++i) {
            pos_of[i] = pos;
            pages[i] = table[col];
            live |= uint64_t(pages[i] >= 0) << i;
            if (++pos == a.page) { pos = 0; ++col; }
        }
        // this tile's sources: in registers where every key is read from its codes (or the pool's values)
        const int ks = kreg >= 0 && codes_only(*a.k, pages, n) ? kreg : -1;
        const int vs = vreg >= 0 && codes_only(*a.v, pages, n) ? vreg : -1;
        const bool k_scaled = ks >= I8, v_scaled = vs >= I8;
        for (int h = 0; h < Hkv; ++h) {
            const int n16 = (n + 15) & ~15;
            for (int i = 0; i < n16; ++i) {
                if (i >= n || pages[i] < 0) {
                    rows[i] = zeros;
                    ksc[i] = 0.f;
                } else if (ks >= 0) {
                    rows[i] = register_row(*a.k, pages[i], pos_of[i], h, a.page, Hkv, D);
                    if (k_scaled) ksc[i] = row_scale(*a.k, ks, pages[i], pos_of[i], h, a.page, Hkv);
                } else {
                    rows[i] = load_row(*a.k, pages[i], pos_of[i], h, a.page, Hkv, D,
                                       kbuf + (size_t(i) * Hkv + h) * D, ktmp + h * tmp_len);
                }
            }
            prefetch_to(pf_base + (2 * h + 1) * TILE / (2 * Hkv));
            float* sh = s + size_t(h * GG) * TILE;
#if defined(__AVX512BF16__)
            if (dp)  // padding lanes read `zeros` as bf16 pairs: any readable row will do (their scores are dropped)
                score_dp(qb + size_t(h * GG) * D, GG, D, rows, n, sh);
            else
#endif
                score(ks >= 0 ? ks : F32, qg + size_t(h * GG) * D, GG, D, rows, n, sh);  // decoded rows: F32
            if (k_scaled)  // a K row's scale onto its scores (lanes past n: ksc 0)
                for (int g = 0; g < GG; ++g)
                    for (int v = 0; v < TILE / 16; ++v)
                        _mm512_storeu_ps(sh + g * TILE + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(sh + g * TILE + 16 * v),
                                                                                _mm512_loadu_ps(ksc + 16 * v)));
            bool any = false;
            for (int r = 0; r < nr; ++r) {
                const int nv = std::max(0, std::min(n, his[r] - j0));  // keys of the tile row r sees (its causal limit)
                const uint64_t vis = live & (nv >= 64 ? ~uint64_t(0) : (uint64_t(1) << nv) - 1);
                for (int g = r * G; g < (r + 1) * G; ++g) {
                    const int hk = h * GG + g;
                    float* raw = nv > 0 ? raw_at(a, rb[r], h * G + g - r * G, j0) : nullptr;
                    any |= softmax_tile_vec(a, sh + g * TILE, n, vis, m + hk, l + hk, acc + size_t(hk) * D, D, raw, nv);
                }
            }
            prefetch_to(pf_base + (2 * h + 2) * TILE / (2 * Hkv));
            if (!any) continue;
            for (int i = 0; i < n; ++i) {  // each V row read once for the nr x G heads
                if (pages[i] < 0) {
                    rows[i] = zeros;
                    vsc[i] = 0.f;
                } else if (vs >= 0) {
                    rows[i] = register_row(*a.v, pages[i], pos_of[i], h, a.page, Hkv, D);
                    if (v_scaled) vsc[i] = row_scale(*a.v, vs, pages[i], pos_of[i], h, a.page, Hkv);
                } else {
                    rows[i] = load_row(*a.v, pages[i], pos_of[i], h, a.page, Hkv, D,
                                       vbuf + (size_t(i) * Hkv + h) * D, vtmp + h * tmp_len);
                }
            }
            const float* w = sh;
            if (v_scaled) {  // a V row's scale moves onto its weight
                for (int g = 0; g < GG; ++g)
                    for (int v = 0; v < TILE / 16; ++v)
                        _mm512_storeu_ps(ws + g * TILE + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(sh + g * TILE + 16 * v),
                                                                                _mm512_loadu_ps(vsc + 16 * v)));
                w = ws;
            }
            accumulate_src(vs >= 0 ? vs : F32, acc + size_t(h * GG) * D, GG, D, w, rows, n);
        }
    }
    for (int hk = 0; hk < HGG; ++hk) {
        if (vreg == BF16) from_bf16_lanes(acc + size_t(hk) * D, D, tmp);
        const int h = hk / GG, r = hk % GG / G, hg = h * G + hk % G;
        mo[r][hg] = m[hk];
        lo_[r][hg] = l[hk];
        std::memcpy(acco[r] + size_t(hg) * D, acc + size_t(hk) * D, sizeof(float) * D);
    }
}
#endif  // __AVX512F__

void attend_unit(const Args& a, int b, int lo, int hi, float* m, float* l, float* acc) {
#if defined(__AVX512F__)
    if (a.D == 64 || a.D == 128 || a.D == 256) return attend_unit_vec(a, &b, 1, lo, &hi, &m, &l, &acc);
#endif
    attend_unit_generic(a, b, lo, hi, m, l, acc);
}

// The order units run in: row by row, except that the rows of a group (consecutive equal row_group entries)
// take turns chunk by chunk, chunk c of every row of the group before chunk c + 1 of any.
std::vector<int> unit_order(const std::vector<int>& row_first, const std::vector<int>& unit_chunk,
                            const int32_t* row_group, int B) {
    std::vector<int> order;
    order.reserve(row_first[B]);
    for (int r0 = 0, r1; r0 < B; r0 = r1) {
        for (r1 = r0 + 1; row_group && r1 < B && row_group[r1] == row_group[r0]; ++r1) {}
        int lo = 1 << 30, hi = -1;  // the group's chunk range
        for (int r = r0; r < r1; ++r) {
            if (row_first[r + 1] == row_first[r]) continue;
            lo = std::min(lo, unit_chunk[row_first[r]]);
            hi = std::max(hi, unit_chunk[row_first[r + 1] - 1]);
        }
        for (int c = lo; c <= hi; ++c)
            for (int r = r0; r < r1; ++r) {
                const int n = row_first[r + 1] - row_first[r], at = n ? c - unit_chunk[row_first[r]] : -1;
                if (at >= 0 && at < n) order.push_back(row_first[r] + at);
            }
    }
    return order;
}

// Whether units u and w (consecutive in the order) run as one blocked unit (attend_unit_vec over both rows): rows
// of one group, the same chunk and first key, the same pages, fp32 / bf16 / fp16 pools (other kinds: one row a
// unit), the same choice of bf16 dot products. KVLAB_MQ_BLOCK=0: never (every unit one row, as before).
template <class Lo, class Hi>
bool blockable(const Args& a, int u, int w, const std::vector<int>& unit_row, const std::vector<int>& unit_chunk,
               const int32_t* row_group, Lo unit_lo, Hi unit_hi) {
    const int b = unit_row[u], c = unit_row[w];
    if (!row_group || row_group[b] != row_group[c] || unit_chunk[u] != unit_chunk[w]) return false;
    if (unit_lo(u) != unit_lo(w) || unit_lo(u) >= unit_hi(u) || unit_lo(w) >= unit_hi(w)) return false;
    const int c0 = unit_lo(u) / a.page, c1 = (std::max(unit_hi(u), unit_hi(w)) - 1) / a.page + 1;
    if (std::memcmp(a.tables + b * a.table_stride + c0, a.tables + c * a.table_stride + c0, sizeof(int32_t) * (c1 - c0)))
        return false;
#if defined(__AVX512BF16__)
    if (a.k->kind == 1 && a.D % 32 == 0 &&
        bf16_exact(a.q + a.tokens[b] * a.q_st, a.q_sh, a.Hkv * a.G, a.D) !=
            bf16_exact(a.q + a.tokens[c] * a.q_st, a.q_sh, a.Hkv * a.G, a.D))
        return false;
#endif
    return true;
}

// The order's units cut into work items: runs of blockable units, at most MAX_BLOCK rows each. Returns the items'
// first positions in `order` (and its end).
constexpr int MAX_BLOCK = 16;
template <class Lo, class Hi>
std::vector<int> work_items(const Args& a, const std::vector<int>& order, const std::vector<int>& unit_row,
                            const std::vector<int>& unit_chunk, const int32_t* row_group, Lo unit_lo, Hi unit_hi) {
    const char* env = std::getenv("KVLAB_MQ_BLOCK");
    bool on = !(env && env[0] == '0' && !env[1]) && a.k->kind <= 2 && a.v->kind <= 2;
#if defined(__AVX512F__)
    on = on && (a.D == 64 || a.D == 128 || a.D == 256);
#else
    on = false;
#endif
    std::vector<int> first;
    for (int i = 0; i < int(order.size()); ++i)
        if (!on || first.empty() || i - first.back() >= MAX_BLOCK ||
            !blockable(a, order[i - 1], order[i], unit_row, unit_chunk, row_group, unit_lo, unit_hi))
            first.push_back(i);
    first.push_back(int(order.size()));
    return first;
}

}  // namespace

extern "C" {

// Returns 0 on success. `stats` (null: none): the attention statistics of each decode row, the mass every key
// j in [first_key, seq_len) received summed over the G query heads of KV head h, written at
// stats[stats_off[b] + h * stats_h + j] (the caller zeroes the rest).
// `row_group` (null: every row its own): consecutive rows with the same value read the same pages (the queries
// of one verification chunk); their units run chunk by chunk across the group, so a key chunk read from memory
// for one row is in cache for the next. Only the execution order changes: each unit's result, where it is
// stored and the order a row's partials are reduced in stay the row's own.
int kvlab_decode_attention(
    const float* q, int64_t q_st, int64_t q_sh,
    float* out, int64_t o_st, int64_t o_sh,
    const Side* k, const Side* v,
    const int32_t* tables, int64_t table_stride,
    const int32_t* tokens, const int32_t* seq_lens, const int32_t* first_key,
    int B, int Hkv, int G, int D, int page, float scale, float softcap, int chunk_keys, int num_threads,
    float* stats, int64_t stats_h, const int64_t* stats_off, const int32_t* row_group) {
    if (chunk_keys < 1 || D < 1 || G < 1) return 1;
    const int HG = Hkv * G;
    std::vector<int64_t> raw_off(B + 1, 0);  // scaled scores of every row (statistics only)
    for (int b = 0; b < B; ++b) raw_off[b + 1] = raw_off[b] + int64_t(HG) * std::max(0, seq_lens[b] - first_key[b]);
    std::vector<float> raw(stats ? raw_off[B] : 0);
    Args a{q, q_st, q_sh, k, v, tables, table_stride, tokens, seq_lens, first_key, Hkv, G, D, page, scale, softcap,
           stats ? raw.data() : nullptr, raw_off.data()};
    // units: (b, chunk) pairs in row order, each for every KV head
    std::vector<int> unit_row, unit_chunk, row_first(B + 1, 0);
    for (int b = 0; b < B; ++b) {
        const int lo = first_key[b], hi = seq_lens[b];
        const int c0 = lo / chunk_keys, c1 = hi > lo ? (hi - 1) / chunk_keys + 1 : c0 + 1;
        for (int c = c0; c < c1; ++c) { unit_row.push_back(b); unit_chunk.push_back(c); }
        row_first[b + 1] = int(unit_row.size());
    }
    const int U = int(unit_row.size());
    const std::vector<int> order = unit_order(row_first, unit_chunk, row_group, B);
    std::vector<float> m(size_t(U) * HG), l(m.size()), acc(m.size() * D);
    std::vector<float> row_max(size_t(B) * HG), row_sum(row_max.size());  // each row's softmax max and denominator
    auto unit_lo = [&](int u) { return std::max(first_key[unit_row[u]], unit_chunk[u] * chunk_keys); };
    auto unit_hi = [&](int u) { return std::min(seq_lens[unit_row[u]], (unit_chunk[u] + 1) * chunk_keys); };
    const std::vector<int> item_first = work_items(a, order, unit_row, unit_chunk, row_group, unit_lo, unit_hi);
    const int W = int(item_first.size()) - 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int w = 0; w < W; ++w) {
        const int i0 = item_first[w], nr = item_first[w + 1] - i0;
        if (nr == 1) {
            const int u = order[i0];
            const size_t at = size_t(u) * HG;
            attend_unit(a, unit_row[u], unit_lo(u), unit_hi(u), &m[at], &l[at], &acc[at * D]);
            continue;
        }
#if defined(__AVX512F__)
        std::vector<int> rb(nr), his(nr);
        std::vector<float*> mp(nr), lp(nr), ap(nr);
        for (int r = 0; r < nr; ++r) {
            const int u = order[i0 + r];
            rb[r] = unit_row[u];
            his[r] = unit_hi(u);
            mp[r] = &m[size_t(u) * HG];
            lp[r] = &l[size_t(u) * HG];
            ap[r] = &acc[size_t(u) * HG * D];
        }
        attend_unit_vec(a, rb.data(), nr, unit_lo(order[i0]), his.data(), mp.data(), lp.data(), ap.data());
#endif
    }
    // reduce the partials of each (row, head) in chunk order
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t bh = 0; bh < int64_t(B) * HG; ++bh) {
        const int b = int(bh / HG), hg = int(bh % HG);
        float mx = NEG_INF;
        for (int u = row_first[b]; u < row_first[b + 1]; ++u) mx = std::max(mx, m[size_t(u) * HG + hg]);
        row_max[bh] = mx;
        float* o = out + int64_t(tokens[b]) * o_st + int64_t(hg) * o_sh;
        if (mx == NEG_INF) {  // no visible key
            for (int d = 0; d < D; ++d) o[d] = 0.f;
            continue;
        }
        float lsum = 0.f;
        std::vector<float> sum(D, 0.f);
        for (int u = row_first[b]; u < row_first[b + 1]; ++u) {
            const size_t at = size_t(u) * HG + hg;
            if (m[at] == NEG_INF) continue;
            const float w = std::exp(m[at] - mx);
            lsum += l[at] * w;
            const float* ac = &acc[at * D];
            for (int d = 0; d < D; ++d) sum[d] += ac[d] * w;
        }
        row_sum[bh] = lsum;
        const float inv = 1.f / lsum;
        for (int d = 0; d < D; ++d) o[d] = sum[d] * inv;
    }
    if (!stats) return 0;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t bh = 0; bh < int64_t(B) * Hkv; ++bh) {  // P[g, j] = exp(s - max) / sum, summed over g in order
        const int b = int(bh / Hkv), h = int(bh % Hkv), lo = first_key[b], n = seq_lens[b] - lo;
        float* st = stats + stats_off[b] + int64_t(h) * stats_h + lo;
        for (int j = 0; j < n; ++j) st[j] = 0.f;
        for (int g = 0; g < G; ++g) {
            const int64_t at = int64_t(b) * HG + h * G + g;
            if (row_max[at] == NEG_INF) continue;
            const float mx = row_max[at], inv = 1.f / row_sum[at];
            const float* r = raw.data() + raw_off[b] + int64_t(h * G + g) * n;
            for (int j = 0; j < n; ++j) st[j] += std::exp(r[j] - mx) * inv;
        }
    }
    return 0;
}

int kvlab_abi_version() { return 4; }

}  // extern "C"
