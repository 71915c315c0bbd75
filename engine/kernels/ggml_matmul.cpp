// GGMLMatMul: an OpenVINO operation that multiplies activations by a matrix kept in a GGUF block type,
// from the GGUF's own blocks, so a token reads 4.5 bits a weight of a Q4_K matrix, not the 8 the CPU
// plugin widens it to.  Q4_K and Q6_K run our kernels (below) on a CPU with int8 dot products: each row of
// x quantized to int8 per 256 values, multiplied with AVX-VNNI or AVX-512 VNNI, every block of a matrix
// row unpacked once for all rows of x.  Every other type, and every CPU without them, runs ggml's own
// vec_dot (libggml-python's libggml-cpu), with x in the type's dot-product partner (Q8_K, Q8_0, Q8_1).
// Either way the work is threaded over the matrix's rows.
//
//   inputs:  x f32 [..., columns]; blocks u8 [rows, bytes per row] (a Constant)
//   output:  f32 [..., rows]  (x @ W.T)
//   attributes: ggml_type (ggml.h's type id), columns, kernel (0: ours where there is one, 1: ggml's)
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/op/op.hpp>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <ggml-cpu.h>
#include <ggml.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

namespace fleetshard {

// ---- our own kernels, for the CPUs with int8 dot products (AVX-VNNI, or AVX-512 VNNI's 256-bit form) ----
// A block of a matrix row is unpacked once for every row of x, and every output is summed in the same
// order whatever the number of rows: a row of x gets the same numbers alone or in a batch.

// A row of x, per 256 values: its scale, 256 int8 codes and the sum of each 16 of them
struct Q8Row {
    float d;
    int8_t qs[256];
    int16_t bsums[16];
};

void quantize_row(const float* x, int64_t K, Q8Row* out) {
    for (int64_t b = 0; b < K / 256; b++) {
        const float* v = x + b * 256;
        float amax = 0.f;
        for (int i = 0; i < 256; i++) amax = std::max(amax, std::fabs(v[i]));
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        Q8Row& q = out[b];
        q.d = amax / 127.f;
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) {
                const int code = static_cast<int>(std::nearbyint(v[g * 16 + i] * id));
                q.qs[g * 16 + i] = static_cast<int8_t>(code);
                sum += code;
            }
            q.bsums[g] = static_cast<int16_t>(sum);
        }
    }
}

// the six-bit scales (bytes 0-7) and minimums (8-15) of a Q4_K or Q5_K super-block's 12 bytes
inline void k_scales(const uint8_t* packed, uint8_t out[16]) {
    uint32_t u[4];
    std::memcpy(u, packed, 12);
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
    const uint32_t low_mins = u[1] & six;
    u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);
    u[2] = low_mins;
    u[0] &= six;
    std::memcpy(out, u, 16);
}

constexpr int ROWS_AT_ONCE = 8;  // rows of x that share one unpacking of a block

// the sum of a vector's eight floats (a subset of every kernel's target, so it inlines into each)
__attribute__((target("avx2,fma,f16c"))) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#define FLEET_KERNELS(SUFFIX, TARGET, DPBUSD, DPWSSD)                                                             \
    /* Q4_K: f16 d and dmin, 12 bytes of six-bit scales and minimums, 128 bytes of nibbles */                     \
    __attribute__((target(TARGET))) void q4_K_##SUFFIX(const uint8_t* w, int64_t blocks, const Q8Row* x,         \
                                                       int64_t M, int64_t x_stride, float* y, int64_t y_stride) { \
        const __m256i low = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();                                \
        const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);                       \
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_AT_ONCE) {                                                         \
            const int64_t rows = std::min<int64_t>(ROWS_AT_ONCE, M - m0);                                          \
            __m256 sums[ROWS_AT_ONCE], mins[ROWS_AT_ONCE];                                                         \
            for (int i = 0; i < rows; i++) sums[i] = mins[i] = _mm256_setzero_ps();                                \
            for (int64_t b = 0; b < blocks; b++) {                                                                 \
                const uint8_t* blk = w + b * 144;                                                                  \
                const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk));                                \
                const float dmin = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2));                         \
                alignas(16) uint8_t sm[16];                                                                        \
                k_scales(blk + 4, sm);                                                                             \
                __m256i q[8], scale[8];                                                                            \
                _Pragma("GCC unroll 8") for (int p = 0; p < 4; p++) {                                                                      \
                    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * p)); \
                    q[2 * p] = _mm256_and_si256(bytes, low);                                                       \
                    q[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);                             \
                }                                                                                                  \
                alignas(32) int32_t sc32[8];                                                                       \
                _mm256_store_si256(reinterpret_cast<__m256i*>(sc32),                                               \
                                   _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm))));   \
                _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) scale[j] = _mm256_set1_epi32(sc32[j]);         \
                const __m256i min16 = _mm256_cvtepu8_epi16(                                                        \
                    _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8)), twice));           \
                for (int i = 0; i < rows; i++) {                                                                   \
                    const Q8Row& a = x[(m0 + i) * x_stride + b];                                                   \
                    __m256i acc[4] = {zero, zero, zero, zero}; /* four chains: the latency of one hides */        \
                    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                                                                  \
                        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs + 32 * j));    \
                        acc[j % 4] = DPWSSD(acc[j % 4], DPBUSD(zero, q[j], av), scale[j]);                         \
                    }                                                                                              \
                    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(acc[0], acc[1]),                       \
                                                           _mm256_add_epi32(acc[2], acc[3]));                      \
                    sums[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * a.d), sums[i]);        \
                    const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums));              \
                    mins[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, min16)),                     \
                                              _mm256_set1_ps(dmin * a.d), mins[i]);                                \
                }                                                                                                  \
            }                                                                                                      \
            for (int i = 0; i < rows; i++) y[(m0 + i) * y_stride] = hsum8(sums[i]) - hsum8(mins[i]); \
        }                                                                                                          \
    }                                                                                                              \
    /* Q6_K: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales, f16 d */                       \
    __attribute__((target(TARGET))) void q6_K_##SUFFIX(const uint8_t* w, int64_t blocks, const Q8Row* x,         \
                                                       int64_t M, int64_t x_stride, float* y, int64_t y_stride) { \
        const __m256i low = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(0x03), zero = _mm256_setzero_si256(); \
        /* the lanes of groups 2c and 2c+1 (four each) take their scales */                                       \
        const __m256i pairs[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3), \
                                  _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)}; \
        for (int64_t m0 = 0; m0 < M; m0 += ROWS_AT_ONCE) {                                                         \
            const int64_t rows = std::min<int64_t>(ROWS_AT_ONCE, M - m0);                                          \
            __m256 sums[ROWS_AT_ONCE];                                                                             \
            for (int i = 0; i < rows; i++) sums[i] = _mm256_setzero_ps();                                          \
            for (int64_t b = 0; b < blocks; b++) {                                                                 \
                const uint8_t* blk = w + b * 210;                                                                  \
                const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);                                    \
                const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 208));                          \
                __m256i q[8], scale[8];                                                                            \
                _Pragma("GCC unroll 8") for (int h = 0; h < 2; h++) {                                                                      \
                    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));        \
                    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));   \
                    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));  \
                    q[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, low),                                          \
                                               _mm256_slli_epi16(_mm256_and_si256(hb, pair), 4));                  \
                    q[4 * h + 1] = _mm256_or_si256(                                                                \
                        _mm256_and_si256(l1, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), pair), 4)); \
                    q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),                \
                                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), pair), 4)); \
                    q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),                \
                                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), pair), 4)); \
                }                                                                                                  \
                const __m256i sc_low = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))); \
                const __m256i sc_high =                                                                            \
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8)));              \
                _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++)                                              \
                    scale[c] = _mm256_permutevar8x32_epi32(c < 4 ? sc_low : sc_high, pairs[c % 4]);               \
                const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))); \
                for (int i = 0; i < rows; i++) {                                                                   \
                    const Q8Row& a = x[(m0 + i) * x_stride + b];                                                   \
                    __m256i acc[4] = {zero, zero, zero, zero};                                                     \
                    _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {                                                                  \
                        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs + 32 * c));    \
                        acc[c % 4] = DPWSSD(acc[c % 4], DPBUSD(zero, q[c], av), scale[c]);                         \
                    }                                                                                              \
                    /* the codes are 32 above the values: less 32 times each group's sum, times its scale */       \
                    const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums));              \
                    const __m256i total = _mm256_sub_epi32(                                                        \
                        _mm256_add_epi32(_mm256_add_epi32(acc[0], acc[1]), _mm256_add_epi32(acc[2], acc[3])),      \
                        _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));                                        \
                    sums[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * a.d), sums[i]);        \
                }                                                                                                  \
            }                                                                                                      \
            for (int i = 0; i < rows; i++) y[(m0 + i) * y_stride] = hsum8(sums[i]);                       \
        }                                                                                                          \
    }

// 256-bit, for the CPUs with AVX-VNNI alone (Intel's client cores)
FLEET_KERNELS(vnni, "avx2,fma,f16c,avxvnni", _mm256_dpbusd_avx_epi32, _mm256_dpwssd_avx_epi32)

// The same sums with 512-bit vectors, for CPUs with AVX-512 VNNI: half the instructions a row
#define ZMM_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"

__attribute__((target(ZMM_TARGET))) void q4_K_zmm(const uint8_t* w, int64_t blocks, const Q8Row* x, int64_t M,
                                                  int64_t x_stride, float* y, int64_t y_stride) {
    const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    // the lanes of sub-blocks 2p (0-7) and 2p+1 (8-15) take their scales
    const __m512i pairs[4] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                              _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
                              _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5),
                              _mm512_setr_epi32(6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7)};
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_AT_ONCE) {
        const int64_t rows = std::min<int64_t>(ROWS_AT_ONCE, M - m0);
        __m512 sums[ROWS_AT_ONCE];
        __m256 mins[ROWS_AT_ONCE];
        for (int i = 0; i < rows; i++) sums[i] = _mm512_setzero_ps(), mins[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t* blk = w + b * 144;
            const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk));
            const float dmin = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2));
            alignas(16) uint8_t sm[16];
            k_scales(blk + 4, sm);
            const __m512i sc32 = _mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm)));
            __m512i q[4], scale[4];
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {
                // the 32 bytes of pair p: low nibbles are sub-block 2p, high ones 2p+1 (x's 64p.. in order)
                const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * p));
                const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
                q[p] = _mm512_and_si512(both, low);
                scale[p] = _mm512_permutexvar_epi32(pairs[p], sc32);
            }
            const __m256i min16 = _mm256_cvtepu8_epi16(
                _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8)), twice));
            for (int i = 0; i < rows; i++) {
                const Q8Row& a = x[(m0 + i) * x_stride + b];
                __m512i acc[2] = {zero, zero};
                _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {
                    const __m512i av = _mm512_loadu_si512(a.qs + 64 * p);
                    acc[p % 2] = _mm512_dpwssd_epi32(acc[p % 2], _mm512_dpbusd_epi32(zero, q[p], av), scale[p]);
                }
                sums[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc[0], acc[1])),
                                          _mm512_set1_ps(d * a.d), sums[i]);
                const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums));
                mins[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, min16)), _mm256_set1_ps(dmin * a.d),
                                          mins[i]);
            }
        }
        for (int i = 0; i < rows; i++) y[(m0 + i) * y_stride] = _mm512_reduce_add_ps(sums[i]) - hsum8(mins[i]);
    }
}

__attribute__((target(ZMM_TARGET))) void q6_K_zmm(const uint8_t* w, int64_t blocks, const Q8Row* x, int64_t M,
                                                  int64_t x_stride, float* y, int64_t y_stride) {
    const __m512i low = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi8(0x03), zero = _mm512_setzero_si512();
    // the lanes of groups 4c..4c+3 (four each) take their scales
    const __m512i quads[4] = {_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                              _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
                              _mm512_setr_epi32(8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11),
                              _mm512_setr_epi32(12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15)};
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_AT_ONCE) {
        const int64_t rows = std::min<int64_t>(ROWS_AT_ONCE, M - m0);
        __m512 sums[ROWS_AT_ONCE];
        for (int i = 0; i < rows; i++) sums[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t* blk = w + b * 210;
            const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
            const float d = _cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 208));
            const __m512i sc32 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
            __m512i q[4], scale[4];
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
                // 64 bytes of low nibbles: their low halves are x's 128h.., their high halves 128h+64..
                const __m512i l = _mm512_loadu_si512(blk + 64 * h);
                const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
                const __m512i hi_lo = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
                const __m512i hi_hi = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(hb, 4)),
                                                         _mm256_srli_epi16(hb, 6), 1);
                q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, low),
                                           _mm512_slli_epi16(_mm512_and_si512(hi_lo, pair), 4));
                q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),
                                               _mm512_slli_epi16(_mm512_and_si512(hi_hi, pair), 4));
            }
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) scale[c] = _mm512_permutexvar_epi32(quads[c], sc32);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
            for (int i = 0; i < rows; i++) {
                const Q8Row& a = x[(m0 + i) * x_stride + b];
                __m512i acc[2] = {zero, zero};
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
                    const __m512i av = _mm512_loadu_si512(a.qs + 64 * c);
                    acc[c % 2] = _mm512_dpwssd_epi32(acc[c % 2], _mm512_dpbusd_epi32(zero, q[c], av), scale[c]);
                }
                // the codes are 32 above the values: less 32 times each group's sum, times its scale
                const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums));
                const __m512i offset = _mm512_castsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
                const __m512i total = _mm512_sub_epi32(_mm512_add_epi32(acc[0], acc[1]),
                                                       _mm512_inserti64x4(offset, _mm256_setzero_si256(), 1));
                sums[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(d * a.d), sums[i]);
            }
        }
        for (int i = 0; i < rows; i++) y[(m0 + i) * y_stride] = _mm512_reduce_add_ps(sums[i]);
    }
}

using RowsKernel = void (*)(const uint8_t*, int64_t, const Q8Row*, int64_t, int64_t, float*, int64_t);

// our kernel for a type on this CPU, or null (ggml's vec_dot then, row by row)
RowsKernel own_kernel(ggml_type type) {
    static const int isa = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") ? 2
                           : __builtin_cpu_supports("avxvnni")                                       ? 1
                                                                                                     : 0;
    if (type == GGML_TYPE_Q4_K) return isa == 2 ? q4_K_zmm : isa == 1 ? q4_K_vnni : nullptr;
    if (type == GGML_TYPE_Q6_K) return isa == 2 ? q6_K_zmm : isa == 1 ? q6_K_vnni : nullptr;
    return nullptr;
}

void init_ggml() {
    static std::once_flag once;
    std::call_once(once, [] { ggml_cpu_init(); });
}

class GGMLMatMul : public ov::op::Op {
public:
    OPENVINO_OP("GGMLMatMul", "fleetshard");

    GGMLMatMul() = default;
    // kernel: OWN (ours where this CPU and type have one, else ggml's) or GGML (ggml's vec_dot always)
    static constexpr int64_t OWN = 0, GGML = 1;

    GGMLMatMul(const ov::OutputVector& args, int64_t ggml_type, int64_t columns, int64_t kernel = OWN)
        : Op(args), m_type(ggml_type), m_columns(columns), m_kernel(kernel) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        init_ggml();
        const auto type = static_cast<ggml_type>(m_type);
        NODE_VALIDATION_CHECK(this, m_type >= 0 && m_type < GGML_TYPE_COUNT && ggml_get_type_traits_cpu(type)->vec_dot,
                              "GGMLMatMul: ggml has no CPU dot product for type ", m_type);
        NODE_VALIDATION_CHECK(this, m_columns > 0 && m_columns % ggml_blck_size(type) == 0,
                              "GGMLMatMul: ", m_columns, " columns are not whole blocks of ", ggml_type_name(type));
        const auto& blocks = get_input_partial_shape(1);
        NODE_VALIDATION_CHECK(this, blocks.rank().is_static() && blocks.size() == 2 && blocks[1].is_static() &&
                                        static_cast<size_t>(blocks[1].get_length()) == ggml_row_size(type, m_columns),
                              "GGMLMatMul: the blocks are not [rows, ", ggml_row_size(type, m_columns), "] bytes");
        auto shape = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, shape.rank().is_static() && shape.size() >= 1, "GGMLMatMul: x has no rank");
        shape[shape.size() - 1] = blocks[0];
        set_output_type(0, ov::element::f32, shape);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<GGMLMatMul>(args, m_type, m_columns, m_kernel);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("ggml_type", m_type);
        visitor.on_attribute("columns", m_columns);
        visitor.on_attribute("kernel", m_kernel);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto type = static_cast<ggml_type>(m_type);
        const auto* traits = ggml_get_type_traits_cpu(type);
        const auto partner = traits->vec_dot_type;
        const int64_t K = m_columns;
        const auto& x = inputs[0];
        const auto& w = inputs[1];
        const int64_t M = static_cast<int64_t>(x.get_size()) / K;
        const int64_t N = static_cast<int64_t>(w.get_shape()[0]);
        auto shape = x.get_shape();
        shape.back() = N;
        outputs[0].set_shape(shape);
        const float* xp = x.data<const float>();
        const auto* wp = static_cast<const uint8_t*>(w.data());
        float* yp = outputs[0].data<float>();
        const size_t row_bytes = ggml_row_size(type, K);

        const auto own = m_kernel == OWN ? own_kernel(type) : nullptr;
        if (own) {
            const int64_t blocks = K / 256;
            thread_local std::vector<Q8Row> rows;  // kept between calls: no allocation a token
            rows.resize(blocks * M);
            Q8Row* const xrows = rows.data();  // the lambdas see this thread's buffer through it
            tbb::parallel_for(tbb::blocked_range<int64_t>(0, M, 8), [&](const tbb::blocked_range<int64_t>& r) {
                for (int64_t m = r.begin(); m < r.end(); m++) quantize_row(xp + m * K, K, xrows + m * blocks);
            });
            const int64_t grain = std::max<int64_t>(16, N / 64);
            tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, grain), [&](const tbb::blocked_range<int64_t>& r) {
                for (int64_t n = r.begin(); n < r.end(); n++)
                    own(wp + n * row_bytes, blocks, xrows, M, blocks, yp + n, N);
            });
            return true;
        }
        // ggml's: the activations in the type's partner type, row by row (F32's partner is itself)
        const size_t x_bytes = ggml_row_size(partner, K);
        thread_local std::vector<uint8_t> quantized;
        const uint8_t* xq = reinterpret_cast<const uint8_t*>(xp);
        if (partner != GGML_TYPE_F32) {
            quantized.resize(x_bytes * M);
            uint8_t* const buffer = quantized.data();  // the lambda sees this thread's buffer through it
            const auto from_float = ggml_get_type_traits_cpu(partner)->from_float;
            tbb::parallel_for(tbb::blocked_range<int64_t>(0, M, 8), [&](const tbb::blocked_range<int64_t>& r) {
                for (int64_t m = r.begin(); m < r.end(); m++)
                    from_float(xp + m * K, buffer + m * x_bytes, K);
            });
            xq = buffer;
        }
        // each row of the matrix against every row of x, while the row is in the cache; every output is one
        // vec_dot of its own, so a row of x gets the same numbers alone or in a batch (exact mode relies on it)
        const auto vec_dot = traits->vec_dot;
        const int64_t grain = std::max<int64_t>(16, N / 64);
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, grain), [&](const tbb::blocked_range<int64_t>& r) {
            for (int64_t n = r.begin(); n < r.end(); n++) {
                const uint8_t* row = wp + n * row_bytes;
                for (int64_t m = 0; m < M; m++)
                    vec_dot(static_cast<int>(K), yp + m * N + n, 0, row, 0, xq + m * x_bytes, 0, 1);
            }
        });
        return true;
    }

private:
    int64_t m_type = 0;
    int64_t m_columns = 0;
    int64_t m_kernel = OWN;
};

}  // namespace fleetshard

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<fleetshard::GGMLMatMul>>()}));
