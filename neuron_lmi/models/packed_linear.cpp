// The CPU kernels of neuron_lmi::mkl_linear and neuron_lmi::onednn_linear (see packed_linear.py):
// x @ weight.T on a pack of weight in MKL's or oneDNN's blocked layout, made on the first call for
// the weight's storage and kept while that storage lives. Native because an AOTInductor package calls
// them through its proxy executor: a Python kernel costs about 30 us a call there (3.5 ms over
// SmolLM2's 121 GEMMs a step), these about what ATen's own GEMM call does.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kPackRows = 32;  // what a pack is made for; any row count runs on it

enum class Library { kMkl = 0, kOneDnn = 1 };

struct Pack {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // expired: the address may be another weight's
  std::vector<int64_t> shape, strides;  // a transposed view shares the address: not the same weight
  at::Tensor packed;
};

std::mutex packs_mutex;
std::map<std::pair<const void*, Library>, Pack> packs;

at::Tensor make_pack(const at::Tensor& weight, Library library) {
  if (library == Library::kMkl) {
    static auto reorder = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("mkl::_mkl_reorder_linear_weight", "")
                              .typed<at::Tensor(const at::Tensor&, int64_t)>();
    return reorder.call(weight.contiguous(), kPackRows);
  }
  static auto reorder = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                            .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
  return reorder.call(weight.contiguous(), kPackRows);
}

at::Tensor pack_of(const at::Tensor& weight, Library library) {
  std::lock_guard<std::mutex> guard(packs_mutex);
  auto hit = packs.find({weight.data_ptr(), library});
  if (hit != packs.end() && !hit->second.storage.expired() && hit->second.shape == weight.sizes().vec() &&
      hit->second.strides == weight.strides().vec()) {
    return hit->second.packed;
  }
  for (auto it = packs.begin(); it != packs.end();) {
    it = it->second.storage.expired() ? packs.erase(it) : std::next(it);
  }
  Pack pack{weight.storage().getWeakStorageImpl(), weight.sizes().vec(), weight.strides().vec(),
            make_pack(weight, library)};
  at::Tensor packed = pack.packed;
  packs.insert_or_assign({weight.data_ptr(), library}, std::move(pack));
  return packed;
}

at::Tensor output_view(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = weight.size(0);
  return out.view(shape);
}

at::Tensor mkl_linear(const at::Tensor& x, const at::Tensor& weight) {
  static auto linear = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkl::_mkl_linear", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const std::optional<at::Tensor>&, int64_t)>();
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "mkl_linear takes a 2-D fp32 weight");
  at::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
  // Told the actual row count, mkl::_mkl_linear runs the pack instead of falling back to F.linear.
  at::Tensor out = linear.call(rows, pack_of(weight, Library::kMkl), weight, std::nullopt, rows.size(0));
  return output_view(out, x, weight);
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight) {
  static auto linear = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                             c10::string_view, c10::List<std::optional<at::Scalar>>,
                                             std::optional<c10::string_view>)>();
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "onednn_linear takes a 2-D fp32 or bf16 weight");
  at::Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
  at::Tensor out = linear.call(rows, pack_of(weight, Library::kOneDnn), std::nullopt, "none",
                               c10::List<std::optional<at::Scalar>>(), std::nullopt);
  return output_view(out, x, weight);
}

int64_t live_packs() {
  std::lock_guard<std::mutex> guard(packs_mutex);
  int64_t live = 0;
  for (const auto& entry : packs) live += entry.second.storage.expired() ? 0 : 1;
  return live;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuron_lmi, m) { m.def("packed_linear_live_packs() -> int", &live_packs); }

TORCH_LIBRARY_IMPL(neuron_lmi, CPU, m) {
  m.impl("mkl_linear", &mkl_linear);
  m.impl("onednn_linear", &onednn_linear);
}
