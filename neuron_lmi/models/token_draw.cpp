// The CPU kernel of neuron_lmi::draw_from_logits (see token_draw.py): one token per row of logits,
// drawn from softmax(row) by inverse CDF with the row's uniform number, without writing the
// probabilities. Per row: the maximum; the unnormalised weights exp(x - max) summed per block of
// kBlock tokens; the block the draw lands in; that block's weights again, scanned. Two reads of the
// row and one of a block, where softmax and a CDF write the whole row twice.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "vector_math.h"

namespace {

using neuron_lmi_math::exp_nonpositive;

constexpr int64_t kBlock = 256;

float block_weight(const float* x, int64_t n, float top) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += exp_nonpositive(x[j] - top);  // -inf (masked) gives 0
  return sum;
}

int64_t draw_row(const float* x, int64_t vocab, float u, std::vector<float>& sums) {
  float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
  for (int64_t j = 0; j < vocab; ++j) top = std::max(top, x[j]);
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = block_weight(x + b * kBlock, std::min(kBlock, vocab - b * kBlock), top);
    total += sums[b];
  }
  // (1 - u) is in (0, 1]: the target is above 0, so it never lands on a token of zero weight. Where
  // rounding leaves it past the last block or token, the last one with weight is taken.
  const float target = (1.f - u) * total;
  float before = 0.f;
  int64_t chosen = -1;
  for (int64_t b = 0; b < blocks; ++b) {
    if (sums[b] <= 0.f) continue;
    chosen = b;
    if (before + sums[b] >= target) break;
    before += sums[b];
  }
  if (chosen < 0) return 0;  // no weight at all (NaN logits): token 0, as argmax of NaN would
  const float* block = x + chosen * kBlock;
  const int64_t n = std::min(kBlock, vocab - chosen * kBlock);
  const float rest = target - before;
  float cumulative = 0.f;
  int64_t last = -1;
  for (int64_t j = 0; j < n; ++j) {
    const float w = exp_nonpositive(block[j] - top);
    if (w <= 0.f) continue;
    last = j;
    cumulative += w;
    if (cumulative >= rest) break;
  }
  return chosen * kBlock + last;
}

at::Tensor draw_from_logits(const at::Tensor& logits, const at::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "draw_from_logits: fp32 logits [B, V]");
  TORCH_CHECK(uniform.dim() == 1 && uniform.size(0) == logits.size(0) && uniform.scalar_type() == at::kFloat,
              "draw_from_logits: one fp32 uniform number per row");
  const at::Tensor x = logits.contiguous();
  const at::Tensor u = uniform.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab > 0, "draw_from_logits: empty vocabulary");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(static_cast<size_t>((vocab + kBlock - 1) / kBlock));
    for (int64_t r = begin; r < end; ++r) op[r] = draw_row(xp + r * vocab, vocab, up[r], sums);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(neuron_lmi, CPU, m) { m.impl("draw_from_logits", &draw_from_logits); }
