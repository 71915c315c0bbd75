// GGMLMatMul: an OpenVINO operation that multiplies activations by a matrix kept in a GGUF block type,
// so a token reads 4.5 bits a weight of a Q4_K matrix, not the 8 the CPU plugin widens it to.  On an
// x86-64 CPU with AVX2, Q4_0, Q4_1, Q4_K and Q6_K run our kernels (below) from the matrix laid out in
// tiles (the GGUF's bits, rearranged by engine/kernels/tiles.py): x quantized to int8 per block (256
// values for the K-quants, 32 for the others), multiplied with AVX-512 VNNI, AVX-VNNI or AVX2, or, in
// exact mode, x kept in float and the codes made floats (float_x).  Every
// other type, and every CPU without AVX2, runs ggml's own vec_dot (libggml-python's libggml-cpu) from
// the GGUF's own blocks, with x in the type's dot-product partner (Q8_K, Q8_0, Q8_1).  Either way the
// work is threaded over the matrix's rows.
//
//   inputs:  x f32 [..., columns]; the matrix u8 (a Constant): with our kernels (kernel 0, 2 or 3) its
//            tiles [tiles * blocks of a row, bytes of a tile's block], with ggml's (kernel 1) its
//            blocks [rows, bytes per row]
//   output:  f32 [..., rows]  (x @ W.T)
//   attributes: ggml_type (ggml.h's type id), rows, columns, kernel, float_x
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

// ---- our own kernels, for the CPUs with AVX2 (with int8 dot products where they have them) ----
// They read a matrix in tiles (engine/kernels/tiles.py lays them out): 16 matrix rows interleaved four
// columns at a time, so one vector holds 16 rows' next four codes and one dot-product instruction
// (AVX2: two) multiplies them by four values of x broadcast, and a block's scale applies to 16 rows at
// once after four to eight such steps.  A tile's codes are unpacked once for up to ROWS_AT_ONCE rows of x,
// and every output is summed in the same order whatever the number of rows: a row of x gets the
// same numbers alone or in a batch.

constexpr int TILE = 16;  // matrix rows a tile interleaves
constexpr int64_t Q4_K_TILE = 2368, Q6_K_TILE = 3360;  // bytes of a tile's super-block (tiles.py)
constexpr int64_t Q4_1_TILE = 320;                     // and of a tile's block of 32 (Q4_0, Q4_1)
constexpr int ROWS_AT_ONCE = 8;  // rows of x that share one unpacking of a tile's codes
// a kernel's table by the rows of x it takes at once, 1..ROWS_AT_ONCE: FEW's for up to 3, MANY's for more
#define ROWS_TABLE(FEW, MANY) {nullptr, FEW<1>, FEW<2>, FEW<3>, MANY<4>, MANY<5>, MANY<6>, MANY<7>, MANY<8>}
static_assert(ROWS_AT_ONCE == 8, "ROWS_TABLE lists 8 kernels");

// A row of x, per 256 values: 256 int8 codes, their scale, the sum of each 32 (Q4_K's minimums)
// and 32 times the sum of each 16 (Q6_K's codes are 32 above their values); and for AVX2's kernels,
// which take them two at a time, the sums of each 32 and of each 16 in int16
struct XBlock {
    int8_t qs[256];
    float d;
    float sum32[8];
    int32_t sum16[16];
    int16_t pairs32[8];
    int16_t pairs16[16];
};

// A row of x, per 32 values (for Q4_0 and Q4_1): 32 int8 codes, their scale, and the scale times their sum
struct X32 {
    int8_t qs[32];
    float d;
    float sum;
};

void quantize_row(const float* x, int64_t K, X32* out) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float* v = x + b * 32;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(v[i]));
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        X32& q = out[b];
        q.d = amax / 127.f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            const int code = static_cast<int>(std::nearbyint(v[i] * id));
            q.qs[i] = static_cast<int8_t>(code);
            sum += code;
        }
        q.sum = q.d * static_cast<float>(sum);
    }
}

void quantize_row(const float* x, int64_t K, XBlock* out) {
    for (int64_t b = 0; b < K / 256; b++) {
        const float* v = x + b * 256;
        float amax = 0.f;
        for (int i = 0; i < 256; i++) amax = std::max(amax, std::fabs(v[i]));
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        XBlock& q = out[b];
        q.d = amax / 127.f;
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) {
                const int code = static_cast<int>(std::nearbyint(v[g * 16 + i] * id));
                q.qs[g * 16 + i] = static_cast<int8_t>(code);
                sum += code;
            }
            q.sum16[g] = 32 * sum;
            q.pairs16[g] = static_cast<int16_t>(sum);  // within 16 x 127
            if (g % 2) {
                q.pairs32[g / 2] = static_cast<int16_t>((q.sum16[g - 1] + q.sum16[g]) / 32);  // within 32 x 127
                q.sum32[g / 2] = q.pairs32[g / 2];
            }
        }
    }
}

// The kernels ask for a tile's block about AHEAD bytes before they reach it, a share of its cache lines
// each step: with several rows of x the arithmetic fills the core, and the memory's latency
// would show without it
constexpr int64_t AHEAD = 4736;  // bytes: two of Q4_K's super-blocks
constexpr int64_t ahead(int64_t bytes) { return (AHEAD + bytes - 1) / bytes; }  // in a kernel's blocks
template <int64_t BYTES, int STEPS>
inline void prefetch(const uint8_t* block, int step) {
    constexpr int each = ((BYTES + 63) / 64 + STEPS - 1) / STEPS;  // lines a step (the last asks past the end)
    const char* at = reinterpret_cast<const char*>(block) + 64 * each * step;
    _Pragma("GCC unroll 16") for (int l = 0; l < each; l++) _mm_prefetch(at + 64 * l, _MM_HINT_T0);
}

// a tile's outputs for ``rows`` rows of x (ROWS_AT_ONCE at most)
using TileKernel = void (*)(const uint8_t* tile, int64_t blocks, const XBlock* x, int64_t x_stride, float* y,
                            int64_t y_stride);
using Tile32Kernel = void (*)(const uint8_t* tile, int64_t blocks, const X32* x, int64_t x_stride, float* y,
                              int64_t y_stride);
// and with x in float (exact mode), each row of x its K values
using FloatKernel = void (*)(const uint8_t* tile, int64_t blocks, const float* x, int64_t x_stride, float* y,
                             int64_t y_stride);
constexpr int CHAINS = 2;  // the float kernels' sums a row of x keeps, so that one waits less on another

// The vector operations the kernels use (V), at three instruction sets: zmm's vectors hold a tile's
// 16 rows (AVX-512 VNNI), ymm's 8 of them, so they take a tile in two halves (AVX-VNNI); avx2 has the
// same 8-row vectors but no int8 dot-product instruction, and sums pairs of products instead
// (``maddubs``); avx2_wide is avx2 on two vectors at once.  ``VNNI`` says which: ``dot``, or
// ``products``, ``add16`` and ``widen`` (tile_kernels.inc)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace zmm {
struct V {
    static constexpr int ROWS = 16;
    static constexpr bool VNNI = true;
    using I = __m512i;
    using F = __m512;
    static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
    static I bytes(char v) { return _mm512_set1_epi8(v); }
    static I zero() { return _mm512_setzero_si512(); }
    static I and_(I a, I b) { return _mm512_and_si512(a, b); }
    static I or_(I a, I b) { return _mm512_or_si512(a, b); }
    template <int n> static I right(I a) { return _mm512_srli_epi16(a, n); }
    template <int n> static I left(I a) { return _mm512_slli_epi16(a, n); }
    static I add(I a, I b) { return _mm512_add_epi32(a, b); }
    static I sub(I a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
    static I ints(int32_t v) { return _mm512_set1_epi32(v); }
    static I right32(I a, int n) { return _mm512_srli_epi32(a, n); }
    // acc + the dot products of each row's four codes with x's four values
    static I dot(I acc, I w, const int8_t* x) {
        int32_t four;
        std::memcpy(&four, x, 4);
        return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(four));
    }
    static F floats(I a) { return _mm512_cvtepi32_ps(a); }
    static F u8s(const uint8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    static F i8s(const uint8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    static F halves(const uint8_t* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
    static F fzero() { return _mm512_setzero_ps(); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F mul(F a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F fmadd(F a, float b, F c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
    static F fnmadd(F a, float b, F c) { return _mm512_fnmadd_ps(a, _mm512_set1_ps(b), c); }
    static F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
    static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
    static void store(float* y, F v) { _mm512_storeu_ps(y, v); }
};

#include "tile_kernels.inc"
}  // namespace zmm
#pragma GCC pop_options

// the 256-bit operations ymm and avx2 share
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
struct Ymm {
    static constexpr int ROWS = 8;
    using I = __m256i;
    using F = __m256;
    static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    static I bytes(char v) { return _mm256_set1_epi8(v); }
    static I zero() { return _mm256_setzero_si256(); }
    static I and_(I a, I b) { return _mm256_and_si256(a, b); }
    static I or_(I a, I b) { return _mm256_or_si256(a, b); }
    template <int n> static I right(I a) { return _mm256_srli_epi16(a, n); }
    template <int n> static I left(I a) { return _mm256_slli_epi16(a, n); }
    static I add(I a, I b) { return _mm256_add_epi32(a, b); }
    static I sub(I a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
    static I ints(int32_t v) { return _mm256_set1_epi32(v); }
    static I right32(I a, int n) { return _mm256_srli_epi32(a, n); }
    static I four(const int8_t* x) {  // x's four values in each row's lane
        int32_t four;
        std::memcpy(&four, x, 4);
        return _mm256_set1_epi32(four);
    }
    static F floats(I a) { return _mm256_cvtepi32_ps(a); }
    static I u8s_int(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
    static F u8s(const uint8_t* p) { return _mm256_cvtepi32_ps(u8s_int(p)); }
    // each row's byte of ``low`` and of ``high`` as the two int16 halves of its lane
    static I u8_pairs(const uint8_t* low, const uint8_t* high) {
        return _mm256_or_si256(u8s_int(low), _mm256_slli_epi32(u8s_int(high), 16));
    }
    static I i8s_int(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
    // each row's int8 of ``low`` and of ``high`` as the two int16 halves of its lane
    static I i8_pairs(const uint8_t* low, const uint8_t* high) {
        return _mm256_or_si256(_mm256_and_si256(i8s_int(low), _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(i8s_int(high), 16));
    }
    static I madd(I a, I b) { return _mm256_madd_epi16(a, b); }  // int16 pairs multiplied and summed, int32
    static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
    template <int n> static I left32(I a) { return _mm256_slli_epi32(a, n); }
    static F i8s(const uint8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    static F halves(const uint8_t* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
    static F fzero() { return _mm256_setzero_ps(); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F mul(F a, float b) { return _mm256_mul_ps(a, _mm256_set1_ps(b)); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F fmadd(F a, float b, F c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), c); }
    static F fnmadd(F a, float b, F c) { return _mm256_fnmadd_ps(a, _mm256_set1_ps(b), c); }
    static F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
    static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
    static void store(float* y, F v) { _mm256_storeu_ps(y, v); }
};

namespace avx2 {
struct V : Ymm {
    static constexpr bool VNNI = false;
    // each row's two pairs of products of codes and x's four values, in int16
    static I products(I w, const int8_t* x) { return times(w, four(x)); }
    static I times(I w, I x) { return _mm256_maddubs_epi16(w, x); }  // with x's four values broadcast
    static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
    static I widen(I a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }  // each row's pairs summed, int32
};

#include "tile_kernels.inc"
}  // namespace avx2
#pragma GCC pop_options

// AVX2 with a tile's 16 rows in two vectors: x's four values broadcast once for both, and a tile read in
// one pass, not two; more registers a row of x, so it spills where avx2 does not for many rows (the
// float kernels take it for up to 3 rows of x)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2_wide {
struct V {
    static constexpr int ROWS = 16;
    static constexpr bool VNNI = false;
    struct I { __m256i a, b; };
    struct F { __m256 a, b; };
    using Y = avx2::V;
    static I load(const uint8_t* p) { return {Y::load(p), Y::load(p + 32)}; }
    static I bytes(char v) { return {Y::bytes(v), Y::bytes(v)}; }
    static I zero() { return {Y::zero(), Y::zero()}; }
    static I and_(I x, I y) { return {Y::and_(x.a, y.a), Y::and_(x.b, y.b)}; }
    static I or_(I x, I y) { return {Y::or_(x.a, y.a), Y::or_(x.b, y.b)}; }
    template <int n> static I right(I x) { return {Y::right<n>(x.a), Y::right<n>(x.b)}; }
    template <int n> static I left(I x) { return {Y::left<n>(x.a), Y::left<n>(x.b)}; }
    static I add(I x, I y) { return {Y::add(x.a, y.a), Y::add(x.b, y.b)}; }
    static I sub(I x, int32_t y) { return {Y::sub(x.a, y), Y::sub(x.b, y)}; }
    static I ints(int32_t v) { return {Y::ints(v), Y::ints(v)}; }
    static I right32(I x, int n) { return {Y::right32(x.a, n), Y::right32(x.b, n)}; }
    static I products(I w, const int8_t* x) {  // x's four values broadcast once for both vectors
        const auto f = Y::four(x);
        return {_mm256_maddubs_epi16(w.a, f), _mm256_maddubs_epi16(w.b, f)};
    }
    static I add16(I x, I y) { return {Y::add16(x.a, y.a), Y::add16(x.b, y.b)}; }
    static I widen(I x) { return {Y::widen(x.a), Y::widen(x.b)}; }
    static F floats(I x) { return {Y::floats(x.a), Y::floats(x.b)}; }
    static F u8s(const uint8_t* p) { return {Y::u8s(p), Y::u8s(p + 8)}; }
    static F i8s(const uint8_t* p) { return {Y::i8s(p), Y::i8s(p + 8)}; }
    static F halves(const uint8_t* p) { return {Y::halves(p), Y::halves(p + 16)}; }
    static F fzero() { return {Y::fzero(), Y::fzero()}; }
    static F mul(F x, F y) { return {Y::mul(x.a, y.a), Y::mul(x.b, y.b)}; }
    static F mul(F x, float y) { return {Y::mul(x.a, y), Y::mul(x.b, y)}; }
    static F fmadd(F x, F y, F z) { return {Y::fmadd(x.a, y.a, z.a), Y::fmadd(x.b, y.b, z.b)}; }
    static F fmadd(F x, float y, F z) { return {Y::fmadd(x.a, y, z.a), Y::fmadd(x.b, y, z.b)}; }
    static F fnmadd(F x, float y, F z) { return {Y::fnmadd(x.a, y, z.a), Y::fnmadd(x.b, y, z.b)}; }
    static F fmsub(F x, F y, F z) { return {Y::fmsub(x.a, y.a, z.a), Y::fmsub(x.b, y.b, z.b)}; }
    static F fadd(F x, F y) { return {Y::fadd(x.a, y.a), Y::fadd(x.b, y.b)}; }
    static void store(float* y, F v) { Y::store(y, v.a); Y::store(y + 8, v.b); }
};

#include "tile_kernels.inc"
}  // namespace avx2_wide
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace ymm {
struct V : Ymm {
    static constexpr bool VNNI = true;
    static I dot(I acc, I w, const int8_t* x) { return _mm256_dpbusd_avx_epi32(acc, w, four(x)); }
};

#include "tile_kernels.inc"
}  // namespace ymm
#pragma GCC pop_options

// The instruction sets our kernels are built for, the best first
enum class Isa { NONE, AVX2, AVX_VNNI, AVX512_VNNI };

bool supported(Isa isa) {
    switch (isa) {
        case Isa::AVX512_VNNI:
            return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512bw");
        case Isa::AVX_VNNI:
            return __builtin_cpu_supports("avxvnni");
        case Isa::AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        default:
            return true;
    }
}

// whether this CPU has ``isa`` (asked once per instruction set)
bool has(Isa isa) {
    static const bool known[] = {true, supported(Isa::AVX2), supported(Isa::AVX_VNNI), supported(Isa::AVX512_VNNI)};
    return known[static_cast<int>(isa)];
}

// the best instruction set this CPU has
Isa best() {
    static const Isa isa = [] {
        for (Isa each : {Isa::AVX512_VNNI, Isa::AVX_VNNI, Isa::AVX2})
            if (has(each)) return each;
        return Isa::NONE;
    }();
    return isa;
}

// the rows of a tile one vector holds on this CPU: 16 with AVX-512 VNNI, 8 with AVX-VNNI or AVX2, 0
// without AVX2 (ggml's kernels then)
int tile_width() {
    const Isa isa = best();
    return isa == Isa::AVX512_VNNI ? 16 : isa == Isa::NONE ? 0 : 8;
}

// Our kernels for a type in an instruction set: a K-quant's (x per 256 values) or a legacy type's (x
// per 32), and the one for x in float, with the columns and bytes of a tile's block; none where there are none
struct Tiles {
    const TileKernel* k_quant = nullptr;
    const Tile32Kernel* legacy = nullptr;
    const FloatKernel* floats = nullptr;
    int64_t columns = 0, bytes = 0;
    explicit operator bool() const { return k_quant || legacy; }
};

// AVX2's Q4_K and Q6_K kernels: the scaled ones (tile_kernels.inc), whose sums stay integers over a
// super-block, for every count of rows of x; avx2's Q4_1 kernels, a little faster than avx2_wide's
constexpr TileKernel avx2_q4_K[ROWS_AT_ONCE + 1] = ROWS_TABLE(avx2::q4_K_scaled, avx2::q4_K_scaled);
constexpr TileKernel avx2_q6_K[ROWS_AT_ONCE + 1] = ROWS_TABLE(avx2::q6_K_scaled, avx2::q6_K_scaled);
// and with x in float: avx2_wide's for up to 3 rows of x, whose sums then stay in registers, avx2's for more
constexpr FloatKernel avx2_q4_K_f[ROWS_AT_ONCE + 1] = ROWS_TABLE(avx2_wide::q4_K_floats, avx2::q4_K_floats);
constexpr FloatKernel avx2_q6_K_f[ROWS_AT_ONCE + 1] = ROWS_TABLE(avx2_wide::q6_K_floats, avx2::q6_K_floats);
constexpr FloatKernel avx2_q4_1_f[ROWS_AT_ONCE + 1] = ROWS_TABLE(avx2_wide::q4_1_floats, avx2::q4_1_floats);

template <const TileKernel* q4_K, const TileKernel* q6_K, const Tile32Kernel* q4_1, const FloatKernel* q4_K_f,
          const FloatKernel* q6_K_f, const FloatKernel* q4_1_f>
Tiles tile_kernels(ggml_type type) {
    if (type == GGML_TYPE_Q4_K) return {q4_K, nullptr, q4_K_f, 256, Q4_K_TILE};
    if (type == GGML_TYPE_Q6_K) return {q6_K, nullptr, q6_K_f, 256, Q6_K_TILE};
    if (type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1) return {nullptr, q4_1, q4_1_f, 32, Q4_1_TILE};
    return {};
}

Tiles tile_kernels(ggml_type type, Isa isa) {
    if (!has(isa)) return {};
    switch (isa) {
        case Isa::AVX512_VNNI:
            return tile_kernels<zmm::q4_K, zmm::q6_K, zmm::q4_1, zmm::q4_K_f, zmm::q6_K_f, zmm::q4_1_f>(type);
        case Isa::AVX_VNNI:
            return tile_kernels<ymm::q4_K, ymm::q6_K, ymm::q4_1, ymm::q4_K_f, ymm::q6_K_f, ymm::q4_1_f>(type);
        case Isa::AVX2:
            return tile_kernels<avx2_q4_K, avx2_q6_K, avx2::q4_1, avx2_q4_K_f, avx2_q6_K_f, avx2_q4_1_f>(type);
        default:
            return {};
    }
}

void init_ggml() {
    static std::once_flag once;
    std::call_once(once, [] { ggml_cpu_init(); });
}

class GGMLMatMul : public ov::op::Op {
public:
    OPENVINO_OP("GGMLMatMul", "fleetshard");

    GGMLMatMul() = default;
    // kernel: OWN (ours, from the matrix's tiles, in the best instruction set this CPU has), GGML (ggml's
    // vec_dot, from its GGUF blocks), OWN_256 or OWN_AVX2 (ours with AVX-VNNI or with AVX2, where this
    // CPU has them: the tests run every instruction set the machine has); float_x: 1 keeps x in float
    // (exact mode: our kernels only), 0 quantizes it to int8
    static constexpr int64_t OWN = 0, GGML = 1, OWN_256 = 2, OWN_AVX2 = 3;

    GGMLMatMul(const ov::OutputVector& args, int64_t ggml_type, int64_t rows, int64_t columns, int64_t kernel,
               int64_t float_x)
        : Op(args), m_type(ggml_type), m_rows(rows), m_columns(columns), m_kernel(kernel), m_float_x(float_x) {
        constructor_validate_and_infer_types();
    }

    void validate_and_infer_types() override {
        init_ggml();
        const auto type = static_cast<ggml_type>(m_type);
        NODE_VALIDATION_CHECK(this, m_type >= 0 && m_type < GGML_TYPE_COUNT && ggml_get_type_traits_cpu(type)->vec_dot,
                              "GGMLMatMul: ggml has no CPU dot product for type ", m_type);
        NODE_VALIDATION_CHECK(this, m_columns > 0 && m_columns % ggml_blck_size(type) == 0,
                              "GGMLMatMul: ", m_columns, " columns are not whole blocks of ", ggml_type_name(type));
        NODE_VALIDATION_CHECK(this, m_kernel >= OWN && m_kernel <= OWN_AVX2,
                              "GGMLMatMul: no kernel ", m_kernel);
        NODE_VALIDATION_CHECK(this, m_kernel == GGML || own(type),
                              "GGMLMatMul: no kernel of ours for ", ggml_type_name(type), " on this CPU");
        NODE_VALIDATION_CHECK(this, m_float_x == 0 || (m_float_x == 1 && m_kernel != GGML),
                              "GGMLMatMul: x in float runs our kernels only (float_x ", m_float_x, ")");
        const bool tiled = m_kernel != GGML;
        const Tiles kernels = tiled ? own(type) : Tiles{};
        const int64_t count = tiled ? (m_rows + TILE - 1) / TILE * (m_columns / kernels.columns) : m_rows;
        const int64_t bytes = tiled ? kernels.bytes : static_cast<int64_t>(ggml_row_size(type, m_columns));
        const auto& blocks = get_input_partial_shape(1);
        NODE_VALIDATION_CHECK(this, m_rows > 0 && blocks.rank().is_static() && blocks.size() == 2 &&
                                        blocks[0].is_static() && blocks[1].is_static() &&
                                        blocks[0].get_length() == count && blocks[1].get_length() == bytes,
                              "GGMLMatMul: the blocks are not [", count, ", ", bytes, "] bytes");
        auto shape = get_input_partial_shape(0);
        NODE_VALIDATION_CHECK(this, shape.rank().is_static() && shape.size() >= 1, "GGMLMatMul: x has no rank");
        shape[shape.size() - 1] = m_rows;
        set_output_type(0, ov::element::f32, shape);
    }

    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
        return std::make_shared<GGMLMatMul>(args, m_type, m_rows, m_columns, m_kernel, m_float_x);
    }

    bool visit_attributes(ov::AttributeVisitor& visitor) override {
        visitor.on_attribute("ggml_type", m_type);
        visitor.on_attribute("rows", m_rows);
        visitor.on_attribute("columns", m_columns);
        visitor.on_attribute("kernel", m_kernel);
        visitor.on_attribute("float_x", m_float_x);
        return true;
    }

    bool has_evaluate() const override { return true; }

    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto type = static_cast<ggml_type>(m_type);
        const int64_t K = m_columns, N = m_rows;
        const auto& x = inputs[0];
        const int64_t M = static_cast<int64_t>(x.get_size()) / K;
        auto shape = x.get_shape();
        shape.back() = N;
        outputs[0].set_shape(shape);
        const float* xp = x.data<const float>();
        const auto* wp = static_cast<const uint8_t*>(inputs[1].data());
        float* yp = outputs[0].data<float>();
        if (m_kernel != GGML)
            tiled(type, xp, M, wp, yp);
        else
            ggml_rows(type, xp, M, wp, yp);
        return true;
    }

private:
    // our tile kernels for a type in the instruction set this node asks for (none where this CPU lacks it)
    Tiles own(ggml_type type) const {
        return tile_kernels(type, m_kernel == OWN_256 ? Isa::AVX_VNNI : m_kernel == OWN_AVX2 ? Isa::AVX2 : best());
    }

    void tiled(ggml_type type, const float* xp, int64_t M, const uint8_t* wp, float* yp) const {
        const Tiles kernels = own(type);
        const int64_t K = m_columns, blocks = K / kernels.columns, bytes = kernels.bytes * blocks;  // a tile's
        if (m_float_x)
            each_tile(M, yp, [&](int64_t t, int64_t m0, int64_t rows, float* y, int64_t y_stride) {
                kernels.floats[rows](wp + t * bytes, blocks, xp + m0 * K, K, y, y_stride);
            });
        else if (kernels.k_quant)
            quantized<XBlock>(kernels.k_quant, blocks, bytes, xp, M, wp, yp);
        else
            quantized<X32>(kernels.legacy, blocks, bytes, xp, M, wp, yp);
    }

    // ours with x in int8 per block
    template <class X, class Kernel>
    void quantized(const Kernel* kernels, int64_t blocks, int64_t bytes, const float* xp, int64_t M,
                   const uint8_t* wp, float* yp) const {
        const int64_t K = m_columns;
        thread_local std::vector<X> rows;  // kept between calls: no allocation a token
        rows.resize(blocks * M);
        X* const xrows = rows.data();  // the lambdas see this thread's buffer through it
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, M, 8), [&](const tbb::blocked_range<int64_t>& r) {
            for (int64_t m = r.begin(); m < r.end(); m++) quantize_row(xp + m * K, K, xrows + m * blocks);
        });
        each_tile(M, yp, [&](int64_t t, int64_t m0, int64_t rows, float* y, int64_t y_stride) {
            kernels[rows](wp + t * bytes, blocks, xrows + m0 * blocks, blocks, y, y_stride);
        });
    }

    // each tile of the matrix against ROWS_AT_ONCE rows of x at a time, threaded over the tiles:
    // run(tile, first row of x, rows of x, their outputs, the outputs' stride)
    template <class Run>
    void each_tile(int64_t M, float* yp, const Run& run) const {
        const int64_t N = m_rows;
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, (N + TILE - 1) / TILE), [&](const tbb::blocked_range<int64_t>& r) {
            alignas(64) float part[ROWS_AT_ONCE * TILE];  // a last tile's outputs, of which some rows are padding
            for (int64_t t = r.begin(); t < r.end(); t++) {
                const int64_t kept = std::min<int64_t>(TILE, N - t * TILE);
                for (int64_t m0 = 0; m0 < M; m0 += ROWS_AT_ONCE) {
                    const int64_t at_once = std::min<int64_t>(ROWS_AT_ONCE, M - m0);
                    float* y = yp + m0 * N + t * TILE;
                    if (kept == TILE) {
                        run(t, m0, at_once, y, N);
                        continue;
                    }
                    run(t, m0, at_once, part, TILE);
                    for (int64_t i = 0; i < at_once; i++) std::memcpy(y + i * N, part + i * TILE, kept * sizeof(float));
                }
            }
        });
    }

    // ggml's: the activations in the type's partner type, each row of the matrix against every row of
    // x while the row is in the cache; every output is one vec_dot of its own, so a row of x gets the
    // same numbers alone or in a batch (exact mode relies on it)
    void ggml_rows(ggml_type type, const float* xp, int64_t M, const uint8_t* wp, float* yp) const {
        const int64_t K = m_columns, N = m_rows;
        const auto* traits = ggml_get_type_traits_cpu(type);
        const auto partner = traits->vec_dot_type;  // F32's partner is itself
        const size_t x_bytes = ggml_row_size(partner, K), row_bytes = ggml_row_size(type, K);
        thread_local std::vector<uint8_t> quantized;
        const uint8_t* xq = reinterpret_cast<const uint8_t*>(xp);
        if (partner != GGML_TYPE_F32) {
            quantized.resize(x_bytes * M);
            uint8_t* const buffer = quantized.data();  // the lambda sees this thread's buffer through it
            const auto from_float = ggml_get_type_traits_cpu(partner)->from_float;
            tbb::parallel_for(tbb::blocked_range<int64_t>(0, M, 8), [&](const tbb::blocked_range<int64_t>& r) {
                for (int64_t m = r.begin(); m < r.end(); m++) from_float(xp + m * K, buffer + m * x_bytes, K);
            });
            xq = buffer;
        }
        const auto vec_dot = traits->vec_dot;
        const int64_t grain = std::max<int64_t>(16, N / 64);
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, grain), [&](const tbb::blocked_range<int64_t>& r) {
            for (int64_t n = r.begin(); n < r.end(); n++) {
                const uint8_t* row = wp + n * row_bytes;
                for (int64_t m = 0; m < M; m++)
                    vec_dot(static_cast<int>(K), yp + m * N + n, 0, row, 0, xq + m * x_bytes, 0, 1);
            }
        });
    }

private:
    int64_t m_type = 0;
    int64_t m_rows = 0;
    int64_t m_columns = 0;
    int64_t m_kernel = OWN;
    int64_t m_float_x = 0;
};

}  // namespace fleetshard

// for engine.kernels: whether swap-in lays a matrix out in tiles here (the rows a vector holds, 0: no)
extern "C" __attribute__((visibility("default"))) int fleetshard_tile_width() { return fleetshard::tile_width(); }

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<fleetshard::GGMLMatMul>>()}));
