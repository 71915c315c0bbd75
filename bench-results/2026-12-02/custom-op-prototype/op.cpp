#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/op/op.hpp>
#include <tbb/parallel_for.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

// x f32 [M,K]; w int8 [N,K]; s f32 [N,K/32]; wsum i32 [N,K/32] -> y f32 [M,N]
class Q8MatMul : public ov::op::Op {
public:
    OPENVINO_OP("Q8MatMul", "fsproto");
    Q8MatMul() = default;
    Q8MatMul(const ov::OutputVector& args) : Op(args) { constructor_validate_and_infer_types(); }
    void validate_and_infer_types() override {
        auto xs = get_input_partial_shape(0);
        auto ws = get_input_partial_shape(1);
        auto out = xs; out[out.size() - 1] = ws[0];
        set_output_type(0, ov::element::f32, out);
    }
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& a) const override {
        return std::make_shared<Q8MatMul>(a);
    }
    bool visit_attributes(ov::AttributeVisitor&) override { return true; }
    bool has_evaluate() const override { return true; }
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
        const auto& x = inputs[0]; const auto& w = inputs[1]; const auto& s = inputs[2]; const auto& ws = inputs[3];
        size_t K = x.get_shape().back(), M = x.get_size() / K, N = w.get_shape()[0], B = K / 32;
        auto oshape = x.get_shape(); oshape.back() = N;
        outputs[0].set_shape(oshape);
        const float* xp = x.data<float>(); const int8_t* wp = w.data<int8_t>();
        const float* sp = s.data<float>(); const int32_t* wsp = ws.data<int32_t>();
        float* yp = outputs[0].data<float>();
        std::vector<int8_t> xq(M * K); std::vector<float> xd(M * B);
        for (size_t m = 0; m < M; m++) for (size_t b = 0; b < B; b++) {
            const float* v = xp + m * K + b * 32; float amax = 0;
            for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(v[i]));
            float d = amax / 127.f, id = d ? 1.f / d : 0.f; xd[m * B + b] = d;
            for (int i = 0; i < 32; i++) xq[m * K + b * 32 + i] = (int8_t)std::nearbyint(v[i] * id);
        }
        tbb::parallel_for(tbb::blocked_range<size_t>(0, N, 64), [&](const tbb::blocked_range<size_t>& r) {
            for (size_t n = r.begin(); n < r.end(); n++) {
                const int8_t* wr = wp + n * K; const float* sr = sp + n * B;
                for (size_t m = 0; m < M; m++) {
                    const int8_t* a = xq.data() + m * K; const float* ad = xd.data() + m * B;
                    __m256 acc = _mm256_setzero_ps();
                    for (size_t b = 0; b < B; b++) {
                        __m256i va = _mm256_loadu_si256((const __m256i*)(a + b * 32));
                        __m256i vw = _mm256_loadu_si256((const __m256i*)(wr + b * 32));
                        __m256i ua = _mm256_sign_epi8(va, va), sw = _mm256_sign_epi8(vw, va);
                        __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ua, sw);
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(sr[b] * ad[b]), acc);
                    }
                    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
                    h = _mm_hadd_ps(h, h); h = _mm_hadd_ps(h, h);
                    yp[m * N + n] = _mm_cvtss_f32(h);
                }
            }
        });
        return true;
    }
};

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<Q8MatMul>>()}));
