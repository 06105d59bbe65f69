// The CPU kernel of neuron_lmi::lora_delta (see lora_delta.py): y plus each line's LoRA update
// (x[l] a[s]^T) b[s] for its slot s (b holds B^T), computed per slot over that slot's lines together.
//
// The matrices are small (a slot's lines: a few tokens; rank room R <= a few dozen), where a GEMM
// library call costs more in set-up than in arithmetic: a bf16 at::mm pair of a decode's shapes
// took about 30 us on a 2-core Zen host, times slots x projections x layers per step. So the update
// is written out here: the slot's lines widened to fp32 once, u = x a^T as dot products over the
// input (a's rows widened one at a time), then u b as a sum of b's rows scaled by u, along the
// output, added into y in fp32 and rounded once. Threads split the slots' rank rows, then the output
// columns, in one parallel region each per call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

namespace {

inline void lora_widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void lora_widen(const c10::BFloat16* src, float* dst, int64_t n) {  // bf16 is fp32's top half
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &wide, sizeof value);
    dst[i] = value;
  }
}

inline float lora_dot(const float* p, const float* q, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += p[i] * q[i];
  return sum;
}

// The slots' updates into ``out`` (contiguous [lines, per_line, d_out], already holding y): for each
// group (a slot and its lines, of ``per_line`` tokens each), ``a`` [room, d_in] and ``b`` [room,
// d_out] (B^T, so the second product is a sum of scaled rows along the output, with no reduction
// per column). Two parallel regions per call, whatever the slots: (group, rank row) pairs, then
// blocks of output columns for every group (a region per slot cost more in start-up than it saved).
template <typename T>
void lora_add_groups(const T* x, T* out, const std::vector<std::pair<int64_t, std::vector<int64_t>>>& groups,
                     int64_t per_line, const T* a, const T* b, int64_t room, int64_t d_in, int64_t d_out) {
  const int64_t n_groups = static_cast<int64_t>(groups.size());
  std::vector<std::vector<float>> xf(groups.size()), u(groups.size());
  for (int64_t g = 0; g < n_groups; ++g) {
    const auto& members = groups[g].second;
    const int64_t m = static_cast<int64_t>(members.size()) * per_line;
    xf[g].resize(static_cast<size_t>(m * d_in));
    u[g].resize(static_cast<size_t>(m * room));
    for (size_t j = 0; j < members.size(); ++j) {
      lora_widen(x + members[j] * per_line * d_in, xf[g].data() + j * per_line * d_in, per_line * d_in);
    }
  }
  at::parallel_for(0, n_groups * room, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(d_in));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / room, r = item % room;
      const int64_t m = static_cast<int64_t>(groups[g].second.size()) * per_line;
      lora_widen(a + (groups[g].first * room + r) * d_in, row.data(), d_in);
      for (int64_t i = 0; i < m; ++i) u[g][i * room + r] = lora_dot(xf[g].data() + i * d_in, row.data(), d_in);
    }
  });
  at::parallel_for(0, d_out, 256, [&](int64_t o0, int64_t o1) {
    const int64_t w = o1 - o0;
    std::vector<float> block(static_cast<size_t>(room * w));  // a slot's b columns o0..o1, widened once
    std::vector<float> acc(static_cast<size_t>(w));
    for (int64_t g = 0; g < n_groups; ++g) {
      const T* bs = b + groups[g].first * room * d_out;
      for (int64_t r = 0; r < room; ++r) lora_widen(bs + r * d_out + o0, block.data() + r * w, w);
      const auto& members = groups[g].second;
      const int64_t m = static_cast<int64_t>(members.size()) * per_line;
      for (int64_t i = 0; i < m; ++i) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t r = 0; r < room; ++r) {
          const float c = u[g][i * room + r];
          const float* src = block.data() + r * w;
#pragma omp simd
          for (int64_t j = 0; j < w; ++j) acc[j] += c * src[j];
        }
        T* dst = out + (members[i / per_line] * per_line + i % per_line) * d_out + o0;
        for (int64_t j = 0; j < w; ++j) dst[j] = static_cast<T>(static_cast<float>(dst[j]) + acc[j]);
      }
    }
  });
}

at::Tensor lora_delta(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a,
                      const at::Tensor& b) {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong, "lora_delta: slots are int64 [lines]");
  TORCH_CHECK(x.dim() >= 2 && y.dim() == x.dim() && y.size(0) == x.size(0) && slots.size(0) == x.size(0),
              "lora_delta: y [lines, ..., out], x [lines, ..., in] and slots [lines] disagree in lines");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == b.size(1) &&
                  a.size(2) == x.size(-1) && b.size(2) == y.size(-1),
              "lora_delta: a [slots, R, in] and b [slots, R, out] do not fit x and y");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  b.scalar_type() == y.scalar_type(),
              "lora_delta: y, x, a and b must share one dtype");
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16,
              "lora_delta: fp32 or bf16 (the CPU engine's dtypes)");
  at::Tensor out = y.contiguous().clone();
  const int64_t lines = x.size(0);
  if (lines == 0) return out;
  const int64_t d_in = x.size(-1), d_out = y.size(-1), room = a.size(1);
  const at::Tensor x3 = x.reshape({lines, -1, d_in}).contiguous();
  const int64_t per_line = x3.size(1);
  const at::Tensor s = slots.contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  std::map<int64_t, std::vector<int64_t>> by_slot;
  for (int64_t l = 0; l < lines; ++l) {
    if (sp[l] < 0) continue;
    TORCH_CHECK(sp[l] < a.size(0), "lora_delta: line ", l, " names slot ", sp[l], " of ", a.size(0));
    by_slot[sp[l]].push_back(l);
  }
  if (by_slot.empty()) return out;
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  const std::vector<std::pair<int64_t, std::vector<int64_t>>> groups(by_slot.begin(), by_slot.end());
  if (y.scalar_type() == at::kFloat) {
    lora_add_groups<float>(x3.data_ptr<float>(), out.data_ptr<float>(), groups, per_line, ac.data_ptr<float>(),
                           bc.data_ptr<float>(), room, d_in, d_out);
  } else {
    using bf16 = c10::BFloat16;
    lora_add_groups<bf16>(x3.data_ptr<bf16>(), out.data_ptr<bf16>(), groups, per_line, ac.data_ptr<bf16>(),
                          bc.data_ptr<bf16>(), room, d_in, d_out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(neuron_lmi, CPU, m) { m.impl("lora_delta", &lora_delta); }
