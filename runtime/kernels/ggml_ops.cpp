// GGUF blocks on ggml's own CPU kernels (the type traits llama.cpp runs), as torch functions.
//
// matmul: y[m, n] = dot(W[n], x[m]) with each activation row quantised on its own into the weight
// type's vec_dot_type (from_float), then one vec_dot per (weight row, activation row). A row's
// result therefore depends on that row alone, whatever the call's row count: row-invariant by
// construction. Output rows are split over torch's own thread pool (at::parallel_for), so the
// configured thread count holds and nothing oversubscribes it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "ggml.h"
#include "ggml-cpu.h"

namespace {

constexpr int64_t kRowBlock = 16;  // weight rows a task takes (held in L1/L2 across the activations)

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

struct Block {
    const uint8_t* rows;  // first weight row of the block
    size_t row_bytes;
    int64_t n0, count;  // output column of its first row, rows in it
    ggml_vec_dot_t dot;
    const uint8_t* xq;  // the activations quantised into this segment's vec_dot_type
    size_t xq_stride;
};

}  // namespace

// x [M, K] float32; weights: uint8 [N_i, row_bytes_i], each of ggml type types[i] -> y [M, sum N_i]
torch::Tensor matmul(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                     const std::vector<int64_t>& types) {
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
    TORCH_CHECK(weights.size() == types.size() && !weights.empty(), "one ggml type per weight segment");
    const torch::Tensor x = x_in.contiguous();
    const int64_t M = x.size(0), K = x.size(1);
    int64_t N = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
        const auto& w = weights[i];
        TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "weights must be contiguous uint8 rows");
        TORCH_CHECK(static_cast<size_t>(w.size(1)) == ggml_row_size(static_cast<ggml_type>(types[i]), K),
                    "a ", ggml_type_name(static_cast<ggml_type>(types[i])), " row of ", K, " elements is ",
                    ggml_row_size(static_cast<ggml_type>(types[i]), K), " bytes, not ", w.size(1));
        N += w.size(0);
    }
    torch::Tensor y = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;

    // each activation row quantised once per vec_dot_type, from that row alone
    std::map<int, torch::Tensor> quantised;
    const float* xp = x.data_ptr<float>();
    for (int64_t type : types) {
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
        const auto* t = cpu_traits(types[i]);
        const torch::Tensor& xq = quantised[t->vec_dot_type];
        const size_t rb = weights[i].size(1);
        const uint8_t* base = weights[i].data_ptr<uint8_t>();
        for (int64_t r = 0; r < weights[i].size(0); r += kRowBlock) {
            const int64_t count = std::min(kRowBlock, weights[i].size(0) - r);
            blocks.push_back({base + r * rb, rb, n0 + r, count, t->vec_dot, xq.data_ptr<uint8_t>(),
                              static_cast<size_t>(xq.size(1))});
        }
        n0 += weights[i].size(0);
    }

    float* yp = y.data_ptr<float>();
    const int k = static_cast<int>(K);
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b, int64_t e) {
        for (int64_t bi = b; bi < e; ++bi) {
            const Block& blk = blocks[bi];
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
          py::arg("x"), py::arg("weights"), py::arg("types"), py::call_guard<py::gil_scoped_release>());
    m.def("quantize", &quantize, py::arg("w"), py::arg("type"), py::call_guard<py::gil_scoped_release>());
    m.def("dequantize", &dequantize, py::arg("w"), py::arg("type"), py::arg("k"), py::call_guard<py::gil_scoped_release>());
    m.def("has_dot", &has_dot);
    m.def("cpu_features", &cpu_features);
}
