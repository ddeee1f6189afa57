// Q4_K repacked eight weight rows at a time, and its kernel for any number of activation rows (AVX2;
// with AVX-512 VNNI, dpbusd forms the same exact integer sums, so the same bits).
// Included by ggml_ops.cpp inside its anonymous namespace, after its ggml block structs.
//
// Layout (BlockQ4Kx8, one per super-block of eight rows): the rows' d and dmin (fp16), their eight
// 6-bit sub-block scales and mins unpacked to bytes, and their nibbles interleaved four bytes per row:
// for 64-value group j and 4-value group g, 32 bytes = rows 0..7 x 4 bytes, whose low nibbles are the
// row's values 64j + 4g + b (sub-block 2j) and high nibbles its values 64j + 32 + 4g + b (sub-block
// 2j + 1). One 32-byte load then feeds eight rows at once (an activation's four bytes broadcast).
//
// Arithmetic, per (weight row, activation row), fixed whatever the number of rows computed together,
// so a row's result depends on that row alone (row-invariant): per super-block, each sub-block's
// products summed exactly (add_products) and times its scale in int32; the mins against the Q8_K
// block sums in int32; then acc += (d * x.d) * sumi and acc_m += (dmin * x.d) * msum in float,
// and acc - acc_m at the end.
// Not ggml's vec_dot's float order (that sums eight lanes per row): close to it, not bit-identical.
struct BlockQ4Kx8 {
    uint16_t d[8], dmin[8];
    uint8_t scales[8][8];    // [sub-block][row]
    uint8_t mins[4][8][2];   // [sub-block pair p][row][2]: the mins of sub-blocks 2p and 2p + 1
    uint8_t qs[4][8][8][4];  // [j][g][row][byte]
};
static_assert(sizeof(BlockQ4Kx8) == 1184, "repacked Q4_K block size");

// eight Q4_K rows of nb super-blocks -> nb repacked blocks
inline void repack_q4k_x8(const BlockQ4K* rows, int64_t nb, BlockQ4Kx8* out) {
    for (int64_t i = 0; i < nb; ++i) {
        BlockQ4Kx8& o = out[i];
        for (int r = 0; r < 8; ++r) {
            const BlockQ4K& b = rows[r * nb + i];
            const uint8_t* s = b.scales;
            o.d[r] = b.d;
            o.dmin[r] = b.dmin;
            uint8_t sc[8], mn[8];  // ggml's get_scale_min_k4
            for (int j = 0; j < 4; ++j) { sc[j] = s[j] & 63; mn[j] = s[j + 4] & 63; }
            for (int j = 4; j < 8; ++j) {
                sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
                mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
            }
            for (int j = 0; j < 8; ++j) o.scales[j][r] = sc[j];
            for (int p = 0; p < 4; ++p) { o.mins[p][r][0] = mn[2 * p]; o.mins[p][r][1] = mn[2 * p + 1]; }
            for (int j = 0; j < 4; ++j)
                for (int g = 0; g < 8; ++g) std::memcpy(o.qs[j][g][r], b.qs + 32 * j + 4 * g, 4);
        }
    }
}

// A sub-block's products, eight weight rows (c) at a time, both exact: with AVX-512 VNNI row c's four
// products go straight into int32 lane c (dpbusd; at most 32 x 15 x 127 = 60,960 a sub-block); else
// into int16 lanes 2c, 2c + 1 (maddubs; at most 8 x 2 x 15 x 128 = 30,720), and times_scales' madd
// forms the int32 sum. Either way row c's int32 is sum x scale: the same integer, the same bits after.
// scale_lanes: the eight rows' scales (one byte a row) laid out as times_scales takes them.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i add_products(__m256i sum, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(sum, w, x); }
inline __m256i scale_lanes(__m128i scales) { return _mm256_cvtepu8_epi32(scales); }
inline __m256i times_scales(__m256i sum, __m256i lanes) { return _mm256_mullo_epi32(sum, lanes); }
#else
inline __m256i add_products(__m256i sum, __m256i w, __m256i x) { return _mm256_add_epi16(sum, _mm256_maddubs_epi16(w, x)); }
inline __m256i scale_lanes(__m128i scales) { return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(scales, scales)); }
inline __m256i times_scales(__m256i sum, __m256i lanes) { return _mm256_madd_epi16(sum, lanes); }
#endif

// R activation rows (Q8_K, x_stride bytes apart) against eight repacked weight rows:
// out[r * out_stride + c] for weight row c < 8
template <int R>
void q4k_x8_rows(int64_t k, const uint8_t* pack, const uint8_t* xrows, size_t x_stride, float* out,
                 int64_t out_stride) {
    const auto* w = reinterpret_cast<const BlockQ4Kx8*>(pack);
    const BlockQ8K* x[R];
    for (int r = 0; r < R; ++r) x[r] = reinterpret_cast<const BlockQ8K*>(xrows + r * x_stride);
    const int64_t nb = k / 256;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[R], acc_m[R];
    for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); acc_m[r] = _mm256_setzero_ps(); }
    for (int64_t i = 0; i < nb; ++i) {
        const BlockQ4Kx8& b = w[i];
        __m256i sumi[R];
        for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            __m256i lo_sum[R], hi_sum[R];  // each sub-block's products (add_products' lanes)
            for (int r = 0; r < R; ++r) { lo_sum[r] = _mm256_setzero_si256(); hi_sum[r] = _mm256_setzero_si256(); }
            for (int g = 0; g < 8; ++g) {
                const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs[j][g]));
                const __m256i lo = _mm256_and_si256(bits, m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                for (int r = 0; r < R; ++r) {
                    int32_t yl, yh;
                    std::memcpy(&yl, x[r][i].qs + 64 * j + 4 * g, 4);
                    std::memcpy(&yh, x[r][i].qs + 64 * j + 32 + 4 * g, 4);
                    lo_sum[r] = add_products(lo_sum[r], lo, _mm256_set1_epi32(yl));
                    hi_sum[r] = add_products(hi_sum[r], hi, _mm256_set1_epi32(yh));
                }
            }
            const __m256i scale_lo = scale_lanes(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.scales[2 * j])));
            const __m256i scale_hi = scale_lanes(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.scales[2 * j + 1])));
            for (int r = 0; r < R; ++r)
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(times_scales(lo_sum[r], scale_lo),
                                                                     times_scales(hi_sum[r], scale_hi)));
        }
        __m256i msum[R];  // per row: sum over sub-blocks of min * (the activation's sum over that sub-block)
        for (int r = 0; r < R; ++r) msum[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
            const __m256i mins = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.mins[p])));
            for (int r = 0; r < R; ++r) {
                const int16_t* bs = x[r][i].bsums;  // sums over 16 values: a sub-block is two of them
                const uint32_t pair = static_cast<uint16_t>(bs[4 * p] + bs[4 * p + 1]) |
                                      (static_cast<uint32_t>(static_cast<uint16_t>(bs[4 * p + 2] + bs[4 * p + 3])) << 16);
                msum[r] = _mm256_add_epi32(msum[r], _mm256_madd_epi16(mins, _mm256_set1_epi32(static_cast<int32_t>(pair))));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.d)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.dmin)));
        for (int r = 0; r < R; ++r) {
            const __m256 xd = _mm256_set1_ps(x[r][i].d);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, xd), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            acc_m[r] = _mm256_fmadd_ps(_mm256_mul_ps(dmin, xd), _mm256_cvtepi32_ps(msum[r]), acc_m[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * out_stride, _mm256_sub_ps(acc[r], acc_m[r]));
}

// any number of activation rows: four at a time, then the rest in one pass of their own count
template <void (*Kernel4)(int64_t, const uint8_t*, const uint8_t*, size_t, float*, int64_t),
          void (*Kernel3)(int64_t, const uint8_t*, const uint8_t*, size_t, float*, int64_t),
          void (*Kernel2)(int64_t, const uint8_t*, const uint8_t*, size_t, float*, int64_t),
          void (*Kernel1)(int64_t, const uint8_t*, const uint8_t*, size_t, float*, int64_t)>
void x8_by_rows(int64_t k, const uint8_t* pack, const uint8_t* x, size_t x_stride, int64_t rows, float* out,
                int64_t out_stride) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) Kernel4(k, pack, x + r * x_stride, x_stride, out + r * out_stride, out_stride);
    const uint8_t* xr = x + r * x_stride;
    float* o = out + r * out_stride;
    switch (rows - r) {
        case 3: Kernel3(k, pack, xr, x_stride, o, out_stride); break;
        case 2: Kernel2(k, pack, xr, x_stride, o, out_stride); break;
        case 1: Kernel1(k, pack, xr, x_stride, o, out_stride); break;
        default: break;
    }
}
