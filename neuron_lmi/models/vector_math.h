// Arithmetic shared by the neuron_lmi kernels (decode_attention.cpp, token_draw.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace neuron_lmi_math {

// exp(x) for x <= 0 in plain arithmetic, so that an ``omp simd`` loop vectorises it (std::exp does
// not): 2^n * 2^f as decode_attention.cpp's exp16, 2^n built in the exponent bits. No branch: below
// 2^-126.5 (-inf included) n is -127, whose exponent bits are all zero, so the result is exactly 0.
// (A select on x for that case kept GCC 12 from vectorising the loop with AVX2: scalar, 4x slower.)
inline float exp_nonpositive(float x) {
  const float t = std::max(x * 1.44269504088896341f, -127.f);
  const float n = std::nearbyint(t);
  const float f = (t - n) * 0.693147180559945309f;
  float p = 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace neuron_lmi_math
