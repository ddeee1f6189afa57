// GGUF blocks on ggml's own CPU kernels (the type traits llama.cpp runs), as torch functions, and the
// row-by-row attention the GGUF backend runs beside them.
//
// matmul: y[m, n] = dot(W[n], x[m]) with each activation row quantised on its own into the weight
// type's vec_dot_type (from_float), then one dot product per (weight row, activation row): ggml's
// vec_dot, or for Q4_K, Q6_K, Q5_0 and Q8_0 on AVX2 a kernel that decodes each weight block once for up to
// kRows activation rows and gives each row the very arithmetic of ggml's AVX2 vec_dot (the same
// integer lanes, the same float operations in the same order), so bit-identical to it; or, for Q4_K
// rows repacked by eight (`repack`, repacked.h), one kernel whose arithmetic per pair is fixed at
// every row count. A row's result therefore depends on that row alone, whatever the call's row
// count: row-invariant by construction. Output rows are split over torch's own thread pool (at::parallel_for), so the
// configured thread count holds and nothing oversubscribes it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "ggml.h"
#include "ggml-cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AUTOTUNE_AVX2 1
#endif

namespace {

std::atomic<bool> rows_kernels_on{true};  // off: every matmul by vec_dot (a side-by-side measurement's baseline)
constexpr int64_t kRowBlock = 16;  // weight rows a task takes (held in L1/L2 across the activations)
constexpr size_t kActTileBytes = 64 * 1024;  // quantised activation rows a rows-kernel pass takes (in L2)
constexpr int kRows = 4;  // activation rows that share one decoded weight block (8 measured slower)
// a segment type with this bit set: Q4_K repacked eight rows at a time (repacked.h; `repack`),
// uint8 [N / 8, pack_bytes(type, K)]
constexpr int64_t kRepacked = int64_t{1} << 16;

struct Init {
    Init() { ggml_cpu_init(); }
};
const Init init_once;

const ggml_type_traits_cpu* cpu_traits(int64_t type) {
    TORCH_CHECK(type >= 0 && type < GGML_TYPE_COUNT, "ggml type ", type, " out of range");
    const auto* t = ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
    TORCH_CHECK((t != nullptr && t->vec_dot != nullptr) || type == GGML_TYPE_F32,
                "ggml type ", ggml_type_name(static_cast<ggml_type>(type)), " has no CPU dot product");
    return t;
}

// Several activation rows against one weight row: out[r * out_stride] = dot(w, x + r * x_stride) for r < rows.
using RowsDot = void (*)(int64_t k, const uint8_t* w, const uint8_t* x, size_t x_stride, int64_t rows, float* out,
                         int64_t out_stride);

struct Block {
    const uint8_t* rows;  // first weight row of the block
    size_t row_bytes;
    int64_t n0, count;  // output column of its first row, rows in it
    ggml_vec_dot_t dot;
    RowsDot rows_dot;  // null: one vec_dot per pair
    RowsDot packed;  // non-null: repacked by eight rows, `rows` holds count / 8 packs of row_bytes each
    const uint8_t* xq;  // the activations quantised into this segment's vec_dot_type
    size_t xq_stride;
};

#ifdef AUTOTUNE_AVX2
// ---------------------------------------------------------------- Q4_K / Q6_K against Q8_K, rows at once
//
// The blocks as ggml lays them out (ggml-common.h), checked against ggml_row_size at run time.
struct BlockQ4K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ6K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
struct BlockQ8K { float d; int8_t qs[256]; int16_t bsums[16]; };
struct BlockQ50 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ80 { uint16_t d; int8_t qs[32]; };
static_assert(sizeof(BlockQ4K) == 144 && sizeof(BlockQ6K) == 210 && sizeof(BlockQ8K) == 292, "ggml block sizes");
static_assert(sizeof(BlockQ50) == 22 && sizeof(BlockQ80) == 34, "ggml block sizes");

using RowsFn = void (*)(int64_t, const uint8_t*, const uint8_t*, size_t, float*, int64_t);

inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return ggml_fp16_to_fp32(h);
#endif
}

// the sum of 8 lanes, in a fixed order (ggml's hsum_float_8's, the halves added the other way round: the same bits)
inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// int16 lane pattern that broadcasts 16-bit element s of a register (pshufb indices 2s, 2s + 1)
inline __m256i broadcast16(int s) { return _mm256_set1_epi16(static_cast<int16_t>(((2 * s + 1) << 8) | (2 * s))); }

// Q4_K: per super-block, sum_j scale_j * dot(q4_j, q8_j) in eight int32 lanes (maddubs, then madd
// with the sub-block's scale), scaled by d into a float accumulator; the mins against the Q8_K
// block sums into a second one; both summed at the end.
template <int R>
void q4k_rows(int64_t k, const uint8_t* wrow, const uint8_t* xrows, size_t x_stride, float* out, int64_t out_stride) {
    const auto* w = reinterpret_cast<const BlockQ4K*>(wrow);
    const BlockQ8K* x[R];
    for (int r = 0; r < R; ++r) x[r] = reinterpret_cast<const BlockQ8K*>(xrows + r * x_stride);
    const int64_t nb = k / 256;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    __m256 acc[R];
    __m128 acc_m[R];
    for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); acc_m[r] = _mm_setzero_ps(); }
    for (int64_t i = 0; i < nb; ++i) {
        const float wd = half_to_float(w[i].d), wmin = half_to_float(w[i].dmin);
        uint32_t u[4];
        std::memcpy(u, w[i].scales, 12);
        u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
        const uint32_t aux = u[1] & kmask1;
        u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
        u[2] = aux;
        u[0] &= kmask1;
        const __m256i mins_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));
        const __m128i mins = _mm256_extracti128_si256(mins_scales, 1);
        const __m128i sc = _mm256_extracti128_si256(mins_scales, 0);
        const __m256i scales = _mm256_set_m128i(sc, sc);
        for (int r = 0; r < R; ++r) {
            const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][i].bsums));
            const __m128i pairs = _mm_hadd_epi16(_mm256_extracti128_si256(sums, 0), _mm256_extracti128_si256(sums, 1));
            const __m128i prod = _mm_madd_epi16(mins, pairs);
            acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(-x[r][i].d * wmin), _mm_cvtepi32_ps(prod), acc_m[r]);
        }
        // the block's 256 values in eight registers and its sub-block scales broadcast beside them, then
        // each row in turn against them (row by row keeps the register file free of spills)
        __m256i q[8];
        alignas(32) __m256i scale[8];
        for (int j = 0; j < 4; ++j) {
            const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i].qs + 32 * j));
            q[2 * j] = _mm256_and_si256(bits, m4);
            q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            scale[2 * j] = _mm256_shuffle_epi8(scales, broadcast16(2 * j));
            scale[2 * j + 1] = _mm256_shuffle_epi8(scales, broadcast16(2 * j + 1));
        }
        for (int r = 0; r < R; ++r) {
            const int8_t* q8 = x[r][i].qs;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) {
                const __m256i pl = _mm256_madd_epi16(
                    scale[2 * j], _mm256_maddubs_epi16(q[2 * j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 64 * j))));
                const __m256i ph = _mm256_madd_epi16(
                    scale[2 * j + 1],
                    _mm256_maddubs_epi16(q[2 * j + 1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 64 * j + 32))));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r][i].d * wd), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        __m128 m = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[r * out_stride] = hsum8(acc[r]) + _mm_cvtss_f32(m);
    }
}

// Q6_K: 6-bit values (low nibbles | two high bits << 4, offset 32) against Q8_K, sixteen int8
// sub-block scales; the offset comes off as 32 * scale * (block sums) in the same int32 lanes.
template <int R>
void q6k_rows(int64_t k, const uint8_t* wrow, const uint8_t* xrows, size_t x_stride, float* out, int64_t out_stride) {
    const auto* w = reinterpret_cast<const BlockQ6K*>(wrow);
    const BlockQ8K* x[R];
    for (int r = 0; r < R; ++r) x[r] = reinterpret_cast<const BlockQ8K*>(xrows + r * x_stride);
    const int64_t nb = k / 256;
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
        const float wd = half_to_float(w[i].d);
        const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[i].scales));
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        // the block's values in eight registers, their scales beside them, then each row in turn
        __m256i q[8];
        alignas(32) __m256i scale[8];
        for (int j = 0; j < 2; ++j) {
            const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i].ql + 64 * j));
            const __m256i b2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i].ql + 64 * j + 32));
            const __m256i bh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i].qh + 32 * j));
            q[4 * j] = _mm256_or_si256(_mm256_and_si256(b1, m15), _mm256_slli_epi16(_mm256_and_si256(bh, m3), 4));
            q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(b2, m15),
                                           _mm256_slli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(12)), 2));
            q[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m15),
                                           _mm256_and_si256(bh, _mm256_set1_epi8(48)));
            q[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m15),
                                           _mm256_srli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(-64)), 2));
            for (int c = 0; c < 4; ++c) {
                // scales 2(4j + c) and 2(4j + c) + 1, each over 16 values: eight int16 lanes apiece
                const int a = 2 * (4 * j + c);
                const __m128i pick = _mm_set_epi8(a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1,
                                                  a, a, a, a, a, a, a, a);
                scale[4 * j + c] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
            }
        }
        for (int r = 0; r < R; ++r) {
            const int8_t* q8 = x[r][i].qs;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 2; ++j) {
                __m256i p[4];
                for (int c = 0; c < 4; ++c)
                    p[c] = _mm256_madd_epi16(scale[4 * j + c],
                                             _mm256_maddubs_epi16(q[4 * j + c], _mm256_loadu_si256(
                                                 reinterpret_cast<const __m256i*>(q8 + 128 * j + 32 * c))));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
            }
            const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][i].bsums));
            const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sums, sc16), 5);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r][i].d * wd),
                                     _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, offset)), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum8(acc[r]);
}

// Q5_0 and Q8_0 against Q8_0 (32 values a block): per block, the weight's signed values against the
// row's in eight int32 lanes of four products each (ggml's mul_sum_i8_pairs_float: |w| times the
// row's values signed by w), converted to float and added into the accumulator times d_w * d_x, as
// ggml's AVX2 vec_dot does block by block. The weight block is decoded (and its signs taken) once
// for the R rows. The lanes' integer sums are exact whichever instructions form them (no int16
// pair saturates: |w| <= 128, |x| <= 127), so each row's float arithmetic is vec_dot's.
inline __m256i lane_sums(__m256i aw, __m256i sx) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx);
#else
    return _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(aw, sx));
#endif
}

// Q5_0: the low nibbles (values 0..15, first half of the block) and high nibbles (second half),
// each with its fifth bit from qh; a clear bit subtracts 16 (ggml: nibble | (~bit & 0xF0))
inline __m256i q5_0_values(const BlockQ50& b) {
    const __m128i tmp = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
    const __m256i nib = _mm256_and_si256(_mm256_set1_epi8(0xF), _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp));
    uint32_t bits;
    std::memcpy(&bits, b.qh, sizeof(bits));
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int32_t>(bits)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi64x(-1));
    return _mm256_or_si256(nib, _mm256_andnot_si256(set, _mm256_set1_epi8(static_cast<char>(0xF0))));
}

template <bool Five, int R>
void q8_0_rows(int64_t k, const uint8_t* wrow, const uint8_t* xrows, size_t x_stride, float* out, int64_t out_stride) {
    const BlockQ80* x[R];
    for (int r = 0; r < R; ++r) x[r] = reinterpret_cast<const BlockQ80*>(xrows + r * x_stride);
    const int64_t nb = k / 32;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i) {
        float wd;
        __m256i q;
        if constexpr (Five) {
            const auto& b = reinterpret_cast<const BlockQ50*>(wrow)[i];
            wd = half_to_float(b.d);
            q = q5_0_values(b);
        } else {
            const auto& b = reinterpret_cast<const BlockQ80*>(wrow)[i];
            wd = half_to_float(b.d);
            q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
        }
        const __m256i aw = _mm256_sign_epi8(q, q);
        for (int r = 0; r < R; ++r) {
            const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][i].qs)), q);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * half_to_float(x[r][i].d)), _mm256_cvtepi32_ps(lane_sums(aw, sx)),
                                     acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum8(acc[r]);
}

#include "repacked.h"

// kRows rows at a time, then the rest in one pass of their own count
template <template <int> class Kernel, int R = kRows>
void rest(int64_t k, const uint8_t* w, const uint8_t* x, size_t x_stride, int64_t rows, float* out,
          int64_t out_stride) {
    if constexpr (R > 0) {
        if (rows == R) Kernel<R>::run(k, w, x, x_stride, out, out_stride);
        else rest<Kernel, R - 1>(k, w, x, x_stride, rows, out, out_stride);
    }
}

template <template <int> class Kernel>
void by_rows(int64_t k, const uint8_t* w, const uint8_t* x, size_t x_stride, int64_t rows, float* out,
             int64_t out_stride) {
    int64_t r = 0;
    for (; r + kRows <= rows; r += kRows) Kernel<kRows>::run(k, w, x + r * x_stride, x_stride, out + r * out_stride, out_stride);
    if (r < rows) rest<Kernel>(k, w, x + r * x_stride, x_stride, rows - r, out + r * out_stride, out_stride);
}

template <int R> struct Q4K { static void run(int64_t k, const uint8_t* w, const uint8_t* x, size_t xs, float* o, int64_t os) { q4k_rows<R>(k, w, x, xs, o, os); } };
template <int R> struct Q6K { static void run(int64_t k, const uint8_t* w, const uint8_t* x, size_t xs, float* o, int64_t os) { q6k_rows<R>(k, w, x, xs, o, os); } };
template <int R> struct Q50 { static void run(int64_t k, const uint8_t* w, const uint8_t* x, size_t xs, float* o, int64_t os) { q8_0_rows<true, R>(k, w, x, xs, o, os); } };
template <int R> struct Q80 { static void run(int64_t k, const uint8_t* w, const uint8_t* x, size_t xs, float* o, int64_t os) { q8_0_rows<false, R>(k, w, x, xs, o, os); } };

RowsDot rows_kernel(ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q4_K: return by_rows<Q4K>;
        case GGML_TYPE_Q6_K: return by_rows<Q6K>;
        case GGML_TYPE_Q5_0: return by_rows<Q50>;
        case GGML_TYPE_Q8_0: return by_rows<Q80>;
        default: return nullptr;
    }
}
bool can_repack(int64_t type) { return type == GGML_TYPE_Q4_K; }
// bytes of eight repacked rows of k elements
size_t pack_bytes(int64_t type, int64_t k) {
    return type == GGML_TYPE_Q4_K ? static_cast<size_t>(k / 256) * sizeof(BlockQ4Kx8) : 0;
}
RowsDot pack_kernel(int64_t type) {
    if (type == GGML_TYPE_Q4_K) return x8_by_rows<q4k_x8_rows<4>, q4k_x8_rows<3>, q4k_x8_rows<2>, q4k_x8_rows<1>>;
    return nullptr;
}
void repack_pack(int64_t type, const uint8_t* rows, int64_t nb, uint8_t* out) {
    if (type == GGML_TYPE_Q4_K) repack_q4k_x8(reinterpret_cast<const BlockQ4K*>(rows), nb, reinterpret_cast<BlockQ4Kx8*>(out));
}
#else
RowsDot rows_kernel(ggml_type) { return nullptr; }
bool can_repack(int64_t) { return false; }
size_t pack_bytes(int64_t, int64_t) { return 0; }
RowsDot pack_kernel(int64_t) { return nullptr; }
void repack_pack(int64_t, const uint8_t*, int64_t, uint8_t*) {}
#endif

}  // namespace

// x [M, K] float32; weights: uint8 [N_i, row_bytes_i], each of ggml type types[i] -> y [M, sum N_i]
// (a type with kRepacked set: Q4_K repacked by `repack`, uint8 [N_i / 8, pack_bytes], N_i = 8 x its rows)
// by_vec_dot: every pair through ggml's vec_dot (the reference the rows kernels are tested against)
torch::Tensor matmul(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                     const std::vector<int64_t>& types, bool by_vec_dot = false) {
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
    TORCH_CHECK(weights.size() == types.size() && !weights.empty(), "one ggml type per weight segment");
    const torch::Tensor x = x_in.contiguous();
    const int64_t M = x.size(0), K = x.size(1);
    int64_t N = 0;
    std::vector<int64_t> base(types.size()), out_rows(types.size());
    for (size_t i = 0; i < weights.size(); ++i) {
        const auto& w = weights[i];
        const bool packed = (types[i] & kRepacked) != 0;
        base[i] = types[i] & ~kRepacked;
        TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "weights must be contiguous uint8 rows");
        const size_t rb = ggml_row_size(static_cast<ggml_type>(base[i]), K);
        if (packed) {
            TORCH_CHECK(can_repack(base[i]) && !by_vec_dot, "repacked ", ggml_type_name(static_cast<ggml_type>(base[i])),
                        " rows cannot run here", by_vec_dot ? " by vec_dot" : "");
            TORCH_CHECK(static_cast<size_t>(w.size(1)) == pack_bytes(base[i], K), "eight repacked rows of ", K,
                        " elements are ", pack_bytes(base[i], K), " bytes, not ", w.size(1));
        } else {
            TORCH_CHECK(static_cast<size_t>(w.size(1)) == rb, "a ", ggml_type_name(static_cast<ggml_type>(base[i])), " row of ", K,
                        " elements is ", rb, " bytes, not ", w.size(1));
        }
        out_rows[i] = w.size(0) * (packed ? 8 : 1);
        N += out_rows[i];
    }
    torch::Tensor y = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;

    // each activation row quantised once per vec_dot_type, from that row alone
    std::map<int, torch::Tensor> quantised;
    const float* xp = x.data_ptr<float>();
    for (int64_t type : base) {
        const ggml_type vt = cpu_traits(type)->vec_dot_type;
        if (quantised.count(vt)) continue;
        const size_t rb = ggml_row_size(vt, K);
        torch::Tensor buf = torch::empty({M, static_cast<int64_t>(rb)}, torch::kUInt8);
        uint8_t* bp = buf.data_ptr<uint8_t>();
        const ggml_from_float_t from_float = ggml_get_type_traits_cpu(vt)->from_float;
        TORCH_CHECK(vt == GGML_TYPE_F32 || from_float != nullptr, "ggml type ", ggml_type_name(vt), " has no from_float");
        at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
            for (int64_t m = b; m < e; ++m) {
                if (vt == GGML_TYPE_F32) std::memcpy(bp + m * rb, xp + m * K, rb);
                else from_float(xp + m * K, bp + m * rb, K);
            }
        });
        quantised[vt] = buf;
    }

    std::vector<Block> blocks;
    int64_t n0 = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
        const auto* t = cpu_traits(base[i]);
        const torch::Tensor& xq = quantised[t->vec_dot_type];
        const size_t rb = weights[i].size(1);
        const bool packed = (types[i] & kRepacked) != 0;
        const uint8_t* base_ptr = weights[i].data_ptr<uint8_t>();
        for (int64_t r = 0; r < out_rows[i]; r += kRowBlock) {
            const int64_t count = std::min(kRowBlock, out_rows[i] - r);
            const RowsDot rows_dot = packed || by_vec_dot || !rows_kernels_on || M == 1
                                         ? nullptr : rows_kernel(static_cast<ggml_type>(base[i]));
            blocks.push_back({base_ptr + (packed ? r / 8 : r) * rb, rb, n0 + r, count, t->vec_dot, rows_dot,
                              packed ? pack_kernel(base[i]) : nullptr,
                              xq.data_ptr<uint8_t>(), static_cast<size_t>(xq.size(1))});
        }
        n0 += out_rows[i];
    }

    float* yp = y.data_ptr<float>();
    const int k = static_cast<int>(K);
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b, int64_t e) {
        for (int64_t bi = b; bi < e; ++bi) {
            const Block& blk = blocks[bi];
            if (blk.packed || blk.rows_dot != nullptr) {
                // a tile of activation rows (held in L2) against the block's weight rows (held in L1)
                const int64_t tile = std::max<int64_t>(kRows, static_cast<int64_t>(kActTileBytes / blk.xq_stride) / kRows * kRows);
                for (int64_t m0 = 0; m0 < M; m0 += tile) {
                    const int64_t rows = std::min(tile, M - m0);
                    if (blk.packed) {
                        for (int64_t r = 0; r < blk.count; r += 8)
                            blk.packed(K, blk.rows + (r / 8) * blk.row_bytes, blk.xq + m0 * blk.xq_stride, blk.xq_stride,
                                      rows, yp + m0 * N + blk.n0 + r, N);
                        continue;
                    }
                    for (int64_t r = 0; r < blk.count; ++r)
                        blk.rows_dot(K, blk.rows + r * blk.row_bytes, blk.xq + m0 * blk.xq_stride, blk.xq_stride,
                                     rows, yp + m0 * N + blk.n0 + r, N);
                }
                continue;
            }
            for (int64_t m = 0; m < M; ++m) {
                const uint8_t* xr = blk.xq + m * blk.xq_stride;
                float* out = yp + m * N + blk.n0;
                for (int64_t r = 0; r < blk.count; ++r) {
                    blk.dot(k, out + r, 0, blk.rows + r * blk.row_bytes, 0, xr, 0, 1);
                }
            }
        }
    });
    return y;
}

// the pages wholly inside [p, p + n) leave this process's memory (MADV_PAGEOUT: their contents stay, a file
// mapping's pages are read back from the file when next touched; anonymous memory without swap stays put)
void page_out(const uint8_t* p, size_t n) {
#ifdef MADV_PAGEOUT
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t start = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
    if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_PAGEOUT);
#else
    (void)p;
    (void)n;
#endif
}

// uint8 [N, row_bytes] of Q4_K -> uint8 [N / 8, pack_bytes]: eight rows at a time in repacked.h's
// layout, for `matmul` with the type kRepacked | type. Undefined (None) where this build has no kernel for it.
// release_source: the source's pages are then paged out (a memory-mapped file's blocks, which the step no
// longer reads, stop counting in the process's resident size).
torch::Tensor repack(const torch::Tensor& w_in, int64_t type, int64_t K, bool release_source) {
    TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == torch::kUInt8, "w must be [N, row_bytes] uint8");
    if (!can_repack(type) || w_in.size(0) % 8 != 0 || K % 256 != 0) return torch::Tensor();
    const size_t rb = ggml_row_size(static_cast<ggml_type>(type), K);
    TORCH_CHECK(static_cast<size_t>(w_in.size(1)) == rb, "row bytes do not match ",
                ggml_type_name(static_cast<ggml_type>(type)), " x ", K);
    const torch::Tensor w = w_in.contiguous();
    const int64_t packs = w.size(0) / 8, nb = K / 256;
    const size_t pb = pack_bytes(type, K);
    torch::Tensor out = torch::empty({packs, static_cast<int64_t>(pb)}, torch::kUInt8);
    const uint8_t* src = w.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    at::parallel_for(0, packs, 16, [&](int64_t b, int64_t e) {
        for (int64_t p = b; p < e; ++p) repack_pack(type, src + p * 8 * rb, nb, dst + p * pb);
    });
    if (release_source && w.is_same(w_in)) page_out(src, static_cast<size_t>(w.size(0)) * rb);
    return out;
}

// w [N, K] float32 -> uint8 [N, row_bytes] of ggml type `type`, by ggml's own quantiser (llama-quantize's, no imatrix)
torch::Tensor quantize(const torch::Tensor& w_in, int64_t type) {
    TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == torch::kFloat32, "w must be [N, K] float32");
    const ggml_type t = static_cast<ggml_type>(type);
    TORCH_CHECK(!ggml_quantize_requires_imatrix(t), ggml_type_name(t), " needs an importance matrix");
    const torch::Tensor w = w_in.contiguous();
    const int64_t N = w.size(0), K = w.size(1);
    TORCH_CHECK(K % ggml_blck_size(t) == 0, ggml_type_name(t), " needs rows of a multiple of ",
                ggml_blck_size(t), " elements, not ", K);
    const size_t rb = ggml_row_size(t, K);
    torch::Tensor out = torch::empty({N, static_cast<int64_t>(rb)}, torch::kUInt8);
    ggml_quantize_init(t);
    const float* src = w.data_ptr<float>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
        ggml_quantize_chunk(t, src + b * K, dst + b * rb, 0, e - b, K, nullptr);
    });
    return out;
}

// uint8 [N, row_bytes] of ggml type `type` -> float32 [N, K] (ggml's to_float)
torch::Tensor dequantize(const torch::Tensor& w_in, int64_t type, int64_t K) {
    TORCH_CHECK(w_in.dim() == 2 && w_in.scalar_type() == torch::kUInt8, "w must be [N, row_bytes] uint8");
    const ggml_type t = static_cast<ggml_type>(type);
    const auto* traits = ggml_get_type_traits(t);
    TORCH_CHECK(traits->to_float != nullptr, ggml_type_name(t), " has no to_float");
    const size_t rb = ggml_row_size(t, K);
    TORCH_CHECK(static_cast<size_t>(w_in.size(1)) == rb, "row bytes do not match ", ggml_type_name(t), " x ", K);
    const torch::Tensor w = w_in.contiguous();
    const int64_t N = w.size(0);
    torch::Tensor out = torch::empty({N, K}, torch::kFloat32);
    const uint8_t* src = w.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
        for (int64_t n = b; n < e; ++n) traits->to_float(src + n * rb, dst + n * K, K);
    });
    return out;
}

// ---------------------------------------------------------------- attention, one row at a time
//
// attend: row t of query head h attends to the key slots s < M with mask[t, s], visited in ascending
// slot order; its scores, softmax and weighted sum are computed in an order fixed by that list alone.
// A row's result therefore depends on its query and the keys and values it sees, never on the other
// rows of the call, the cache's capacity or where the call's rows sit: row-invariant by construction,
// so a prompt's rows, a plain step, a verify, a tree's gathered rows and a batch's rows agree bit for bit.

namespace {

#ifdef AUTOTUNE_AVX2

// exp(x) in 8 lanes (x <= 0 here): x = n ln2 + r, a degree-6 polynomial for exp(r) (Cephes' expf
// coefficients), 2^n through the exponent bits
inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// a . b over d elements (d a multiple of 16 on the vector path)
inline float dot(const float* a, const float* b, int64_t d) {
#ifdef AUTOTUNE_AVX2
    if (d % 16 == 0) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
        }
        return hsum8(_mm256_add_ps(acc0, acc1));
    }
#endif
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < d; ++i) acc[i % 8] = std::fma(a[i], b[i], acc[i % 8]);
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// the slots row `mr` (M bools) attends to, ascending
inline void visible(const bool* mr, int64_t M, std::vector<int64_t>& idx) {
    idx.clear();
    int64_t j = 0;
#ifdef AUTOTUNE_AVX2
    for (; j + 32 <= M; j += 32) {
        uint32_t bits = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpgt_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mr + j)), _mm256_setzero_si256())));
        while (bits) {
            idx.push_back(j + __builtin_ctz(bits));
            bits &= bits - 1;
        }
    }
#endif
    for (; j < M; ++j)
        if (mr[j]) idx.push_back(j);
}

// s[0, n) <- exp(s - max), in place -> their sum (added in order)
inline float softmax_weights(float* s, int64_t n) {
    float mx = s[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, s[i]);
    int64_t i = 0;
#ifdef AUTOTUNE_AVX2
    const __m256 vmx = _mm256_set1_ps(mx);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx)));
    if (i < n) {
        float tail[8];
        for (int u = 0; u < 8; ++u) tail[u] = i + u < n ? s[i + u] - mx : -100.f;
        _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
        for (int64_t u = i; u < n; ++u) s[u] = tail[u - i];
        i = n;
    }
#endif
    for (; i < n; ++i) s[i] = std::exp(s[i] - mx);
    float sum = 0.f;
    for (i = 0; i < n; ++i) sum += s[i];
    return sum;
}

// o[0, D) <- sum_i w[i] * V[idx[i]] / total, added in order of i
inline void weighted_sum(float* o, const float* w, const std::vector<int64_t>& idx, const float* vg, int64_t vs1,
                         int64_t D, float total) {
    const int64_t n = static_cast<int64_t>(idx.size());
    const float inv = 1.f / total;
#ifdef AUTOTUNE_AVX2
    if (D % 64 == 0) {
        for (int64_t c = 0; c < D; c += 64) {
            __m256 a[8];
            for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
            for (int64_t i = 0; i < n; ++i) {
                const float* vr = vg + idx[i] * vs1 + c;
                const __m256 p = _mm256_set1_ps(w[i]);
                for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * j), a[j]);
            }
            const __m256 vinv = _mm256_set1_ps(inv);
            for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o + c + 8 * j, _mm256_mul_ps(a[j], vinv));
        }
        return;
    }
#endif
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    for (int64_t i = 0; i < n; ++i) {
        const float* vr = vg + idx[i] * vs1;
        for (int64_t d = 0; d < D; ++d) o[d] = std::fma(w[i], vr[d], o[d]);
    }
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}

}  // namespace

// q [H, T, D]; k, v [Hkv, S, D] float32 with D contiguous (a cache layer's views); mask [T, M] bool, M <= S
// -> [H, T, D]. Query heads share key/value heads in groups of H / Hkv (grouped-query attention); a row
// that sees no slot gets zeros.
torch::Tensor attend(const torch::Tensor& q_in, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& mask_in, double scale) {
    TORCH_CHECK(q_in.dim() == 3 && k.dim() == 3 && v.dim() == 3 && mask_in.dim() == 2,
                "attend: q [H, T, D], k and v [Hkv, S, D], mask [T, M]");
    TORCH_CHECK(q_in.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                v.scalar_type() == torch::kFloat32, "attend: q, k and v must be float32");
    const torch::Tensor q = q_in.contiguous();
    const torch::Tensor mask = mask_in.to(torch::kBool).contiguous();
    const int64_t H = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0), M = mask.size(1);
    TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && v.size(0) == Hkv, "attend: ", H, " query heads over ", Hkv, " key heads");
    TORCH_CHECK(k.size(2) == D && v.size(2) == D && k.stride(2) == 1 && v.stride(2) == 1,
                "attend: keys and values of head size ", D, " with contiguous rows");
    TORCH_CHECK(mask.size(0) == T && M <= k.size(1) && M <= v.size(1), "attend: a [", T, ", <= ", k.size(1), "] mask");
    const int64_t rep = H / Hkv;
    torch::Tensor out = torch::empty({H, T, D}, q.options());
    if (H == 0 || T == 0 || D == 0) return out;
    const float* qp = q.data_ptr<float>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    const bool* mp = mask.data_ptr<bool>();
    float* op = out.data_ptr<float>();
    const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
    const float sc = static_cast<float>(scale);
    // a task: one row of one key/value head with its query heads
    at::parallel_for(0, Hkv * T, 1, [&](int64_t b, int64_t e) {
        std::vector<int64_t> idx;
        std::vector<float> s;
        for (int64_t task = b; task < e; ++task) {
            const int64_t g = task / T, t = task % T;
            visible(mp + t * M, M, idx);
            const int64_t n = static_cast<int64_t>(idx.size());
            if (n == 0) {
                for (int64_t r = 0; r < rep; ++r) std::fill_n(op + ((g * rep + r) * T + t) * D, D, 0.f);
                continue;
            }
            s.resize(static_cast<size_t>(rep * n));
            const float* kg = kp + g * ks0;
            for (int64_t i = 0; i < n; ++i) {
                const float* kr = kg + idx[i] * ks1;
                for (int64_t r = 0; r < rep; ++r) s[r * n + i] = dot(qp + ((g * rep + r) * T + t) * D, kr, D) * sc;
            }
            for (int64_t r = 0; r < rep; ++r) {
                float* w = s.data() + r * n;
                const float total = softmax_weights(w, n);
                weighted_sum(op + ((g * rep + r) * T + t) * D, w, idx, vp + g * vs0, vs1, D, total);
            }
        }
    });
    return out;
}

// x [T, K] float32, w [K] -> w * (x / sqrt(mean(x^2) + eps)) per row (Llama / Qwen RMSNorm): the squares
// summed in an order fixed by K alone, so every row is computed the same whatever the call's rows
torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "rms_norm: x must be [T, K] float32");
    const torch::Tensor x = x_in.contiguous();
    const torch::Tensor w = w_in.to(torch::kFloat32).contiguous();
    const int64_t T = x.size(0), K = x.size(1);
    TORCH_CHECK(w.numel() == K, "rms_norm: a weight of ", K, " elements");
    torch::Tensor y = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
            const float* xr = xp + t * K;
            float* yr = yp + t * K;
            const float r = 1.f / std::sqrt(dot(xr, xr, K) / static_cast<float>(K) + static_cast<float>(eps));
            for (int64_t i = 0; i < K; ++i) yr[i] = wp[i] * (xr[i] * r);
        }
    });
    return y;
}

// x [H, T, D] float32, cos / sin [T, D]: x * cos + rotate_half(x) * sin (rotate_half(x) = [-x2, x1]), each
// element as two products and a sum, as torch computes it elementwise
torch::Tensor rope(const torch::Tensor& x_in, const torch::Tensor& cos_in, const torch::Tensor& sin_in) {
    TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == torch::kFloat32, "rope: x must be [H, T, D] float32");
    const torch::Tensor x = x_in.contiguous();
    const torch::Tensor c = cos_in.to(torch::kFloat32).contiguous(), sn = sin_in.to(torch::kFloat32).contiguous();
    const int64_t H = x.size(0), T = x.size(1), D = x.size(2), half = D / 2;
    TORCH_CHECK(D % 2 == 0 && c.dim() == 2 && c.size(0) == T && c.size(1) == D && sn.sizes() == c.sizes(),
                "rope: cos and sin of [", T, ", ", D, "]");
    torch::Tensor y = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* cp = c.data_ptr<float>();
    const float* sp = sn.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, H * T, 64, [&](int64_t b, int64_t e) {
        for (int64_t ht = b; ht < e; ++ht) {
            const int64_t t = ht % T;
            const float* xr = xp + ht * D;
            const float* cr = cp + t * D;
            const float* sr = sp + t * D;
            float* yr = yp + ht * D;
            for (int64_t i = 0; i < half; ++i) {
                yr[i] = xr[i] * cr[i] + (-xr[i + half]) * sr[i];
                yr[i + half] = xr[i + half] * cr[i + half] + xr[i] * sr[i + half];
            }
        }
    });
    return y;
}

// gate_up [T, 2I] float32 (gate columns, then up) -> silu(gate) * up [T, I], silu(x) = x / (1 + exp(-x))
torch::Tensor swiglu(const torch::Tensor& gu_in) {
    TORCH_CHECK(gu_in.dim() == 2 && gu_in.scalar_type() == torch::kFloat32 && gu_in.size(1) % 2 == 0,
                "swiglu: gate_up must be [T, 2I] float32");
    const torch::Tensor gu = gu_in.contiguous();
    const int64_t T = gu.size(0), I = gu.size(1) / 2;
    torch::Tensor y = torch::empty({T, I}, gu.options());
    const float* gp = gu.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
            const float* g = gp + t * 2 * I;
            const float* u = g + I;
            float* o = yp + t * I;
            int64_t i = 0;
#ifdef AUTOTUNE_AVX2
            const __m256 one = _mm256_set1_ps(1.f), hi = _mm256_set1_ps(88.f);
            for (; i + 8 <= I; i += 8) {
                const __m256 x = _mm256_loadu_ps(g + i);
                const __m256 ex = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), hi));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, ex)), _mm256_loadu_ps(u + i)));
            }
#endif
            for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(std::min(-g[i], 88.f))) * u[i];
        }
    });
    return y;
}

namespace {
torch::Tensor project(const torch::Tensor& x, const std::vector<torch::Tensor>& w, const std::vector<int64_t>& types,
                      const c10::optional<torch::Tensor>& bias) {
    torch::Tensor y = matmul(x, w, types);
    return bias.has_value() ? y + *bias : y;
}
}  // namespace

// One Llama / Qwen2 decoder layer over rows h [T, E] float32, as the model's own forward composes it from
// the functions above (so bit-identical to it): RMSNorm, the fused q/k/v projection (+ bias), RoPE, K/V
// written to the cache layer's `keys` / `values` [Hkv, S, D] at `slots`, row attention under `mask`, the
// o projection and the residual; RMSNorm, the fused gate/up projection, SwiGLU, down and the residual.
torch::Tensor layer(const torch::Tensor& h, const torch::Tensor& norm1, double eps1,
                    const std::vector<torch::Tensor>& qkv, const std::vector<int64_t>& qkv_types,
                    const c10::optional<torch::Tensor>& qkv_bias,
                    const std::vector<torch::Tensor>& o, const std::vector<int64_t>& o_types,
                    const c10::optional<torch::Tensor>& o_bias,
                    const torch::Tensor& norm2, double eps2,
                    const std::vector<torch::Tensor>& gate_up, const std::vector<int64_t>& gate_up_types,
                    const std::vector<torch::Tensor>& down, const std::vector<int64_t>& down_types,
                    torch::Tensor keys, torch::Tensor values, const torch::Tensor& slots, const torch::Tensor& mask,
                    const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads, double scale) {
    const int64_t T = h.size(0), n_kv = keys.size(0), D = keys.size(2);
    const torch::Tensor y = project(rms_norm(h, norm1, eps1), qkv, qkv_types, qkv_bias);
    const auto parts = y.split({n_heads * D, n_kv * D, n_kv * D}, -1);
    const torch::Tensor q = rope(parts[0].view({T, n_heads, D}).transpose(0, 1), cos, sin);
    const torch::Tensor k = rope(parts[1].view({T, n_kv, D}).transpose(0, 1), cos, sin);
    keys.index_copy_(1, slots, k);
    values.index_copy_(1, slots, parts[2].view({T, n_kv, D}).transpose(0, 1));
    const torch::Tensor att = attend(q, keys, values, mask, scale).transpose(0, 1).reshape({T, n_heads * D});
    const torch::Tensor h2 = h + project(att, o, o_types, o_bias);
    const torch::Tensor m = swiglu(matmul(rms_norm(h2, norm2, eps2), gate_up, gate_up_types));
    return h2 + matmul(m, down, down_types);
}

bool has_dot(int64_t type) {
    if (type < 0 || type >= GGML_TYPE_COUNT) return false;
    const auto* t = ggml_get_type_traits_cpu(static_cast<ggml_type>(type));
    return t != nullptr && t->vec_dot != nullptr && ggml_get_type_traits_cpu(t->vec_dot_type)->from_float != nullptr;
}
std::string cpu_features() {
    std::string s;
    auto add = [&](const char* name, int on) { if (on) { if (!s.empty()) s += ","; s += name; } };
    add("avx", ggml_cpu_has_avx()); add("avx2", ggml_cpu_has_avx2()); add("avx_vnni", ggml_cpu_has_avx_vnni());
    add("fma", ggml_cpu_has_fma()); add("f16c", ggml_cpu_has_f16c());
    add("avx512", ggml_cpu_has_avx512()); add("avx512_vnni", ggml_cpu_has_avx512_vnni());
    add("avx512_bf16", ggml_cpu_has_avx512_bf16()); add("neon", ggml_cpu_has_neon());
    add("dotprod", ggml_cpu_has_dotprod()); add("sve", ggml_cpu_has_sve());
    return s;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("matmul", &matmul, "x [M,K] f32 @ ggml weight segments^T -> [M, sum N]",
          py::arg("x"), py::arg("weights"), py::arg("types"), py::arg("by_vec_dot") = false,
          py::call_guard<py::gil_scoped_release>());
    m.def("quantize", &quantize, py::arg("w"), py::arg("type"), py::call_guard<py::gil_scoped_release>());
    m.def("dequantize", &dequantize, py::arg("w"), py::arg("type"), py::arg("k"), py::call_guard<py::gil_scoped_release>());
    m.def("attend", &attend, "row-invariant attention: q [H,T,D], k/v [Hkv,S,D], mask [T,M] -> [H,T,D]",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"),
          py::call_guard<py::gil_scoped_release>());
    m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
    m.def("rope", &rope, py::arg("x"), py::arg("cos"), py::arg("sin"), py::call_guard<py::gil_scoped_release>());
    m.def("swiglu", &swiglu, py::arg("gate_up"), py::call_guard<py::gil_scoped_release>());
    m.def("layer", &layer, "one decoder layer over rows (runtime.transformer.CausalLM.fused_layer)",
          py::arg("h"), py::arg("norm1"), py::arg("eps1"), py::arg("qkv"), py::arg("qkv_types"), py::arg("qkv_bias"),
          py::arg("o"), py::arg("o_types"), py::arg("o_bias"), py::arg("norm2"), py::arg("eps2"),
          py::arg("gate_up"), py::arg("gate_up_types"), py::arg("down"), py::arg("down_types"),
          py::arg("keys"), py::arg("values"), py::arg("slots"), py::arg("mask"), py::arg("cos"), py::arg("sin"),
          py::arg("n_heads"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
    m.def("repack", &repack, "Q4_K rows [N, row_bytes] -> repacked by eight (None where this build cannot)",
          py::arg("w"), py::arg("type"), py::arg("k"), py::arg("release_source") = false,
          py::call_guard<py::gil_scoped_release>());
    m.def("can_repack", &can_repack);
    m.def("has_rows_kernel", [](int64_t type) {
        return type >= 0 && type < GGML_TYPE_COUNT && rows_kernel(static_cast<ggml_type>(type)) != nullptr;
    }, "whether calls of several rows of this block type decode each weight block once for several rows");
    m.def("repacked_type", [](int64_t type) { return type | kRepacked; });
    m.def("use_rows_kernels", [](bool on) { rows_kernels_on = on; },
          "whether matmuls of several rows take the rows kernels (Q4_K, Q6_K, Q5_0, Q8_0; default) or vec_dot per pair");
    m.def("has_dot", &has_dot);
    m.def("cpu_features", &cpu_features);
}
