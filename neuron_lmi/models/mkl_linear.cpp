// neuron_lmi::mkl_linear's CPU kernel (see mkl_linear.py): x @ weight.T on an MKL pack of weight,
// made on the first call for the weight's storage and kept while that storage lives. Native because
// an AOTInductor package calls it through its proxy executor: a Python kernel costs about 30 us a
// call there (3.5 ms over SmolLM2's 121 GEMMs a step), this one about what ATen's own GEMM call does.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t kPackRows = 32;  // what the pack is made for; any row count runs on it

struct Pack {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // expired: the address may be another weight's
  std::vector<int64_t> shape, strides;  // a transposed view shares the address: not the same weight
  at::Tensor packed;
};

std::mutex packs_mutex;
std::unordered_map<const void*, Pack> packs;

at::Tensor pack_of(const at::Tensor& weight) {
  static auto reorder = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("mkl::_mkl_reorder_linear_weight", "")
                            .typed<at::Tensor(const at::Tensor&, int64_t)>();
  std::lock_guard<std::mutex> guard(packs_mutex);
  auto hit = packs.find(weight.data_ptr());
  if (hit != packs.end() && !hit->second.storage.expired() && hit->second.shape == weight.sizes().vec() &&
      hit->second.strides == weight.strides().vec()) {
    return hit->second.packed;
  }
  for (auto it = packs.begin(); it != packs.end();) {
    it = it->second.storage.expired() ? packs.erase(it) : std::next(it);
  }
  Pack pack{weight.storage().getWeakStorageImpl(), weight.sizes().vec(), weight.strides().vec(),
            reorder.call(weight.contiguous(), kPackRows)};
  at::Tensor packed = pack.packed;
  packs.insert_or_assign(weight.data_ptr(), std::move(pack));
  return packed;
}

at::Tensor mkl_linear(const at::Tensor& x, const at::Tensor& weight) {
  static auto linear = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkl::_mkl_linear", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const std::optional<at::Tensor>&, int64_t)>();
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "mkl_linear takes a 2-D fp32 weight");
  at::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
  // Told the actual row count, mkl::_mkl_linear runs the pack instead of falling back to F.linear.
  at::Tensor out = linear.call(rows, pack_of(weight), weight, std::nullopt, rows.size(0));
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = weight.size(0);
  return out.view(shape);
}

int64_t live_packs() {
  std::lock_guard<std::mutex> guard(packs_mutex);
  int64_t live = 0;
  for (const auto& entry : packs) live += entry.second.storage.expired() ? 0 : 1;
  return live;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuron_lmi, m) { m.def("mkl_linear_live_packs() -> int", &live_packs); }

TORCH_LIBRARY_IMPL(neuron_lmi, CPU, m) { m.impl("mkl_linear", &mkl_linear); }
