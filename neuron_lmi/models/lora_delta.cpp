// The CPU kernel of neuron_lmi::lora_delta (see lora_delta.py): y plus each line's LoRA update
// (x[l] a[s]^T) b[s]^T for its slot s, one matmul pair per slot present over that slot's lines.
// Lines of one slot that sit next to each other (a run) are read and written in place; others are
// gathered and scattered. The Python kernel does the same op by op: here it is one call, so an
// adapted projection costs a few ATen calls per slot, not a Python loop per slot per layer.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <map>
#include <vector>

namespace {

at::Tensor lora_delta(const at::Tensor& y, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a,
                      const at::Tensor& b) {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong, "lora_delta: slots are int64 [lines]");
  TORCH_CHECK(x.dim() >= 2 && y.dim() == x.dim() && y.size(0) == x.size(0) && slots.size(0) == x.size(0),
              "lora_delta: y [lines, ..., out], x [lines, ..., in] and slots [lines] disagree in lines");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == b.size(2) &&
                  a.size(2) == x.size(-1) && b.size(1) == y.size(-1),
              "lora_delta: a [slots, R, in] and b [slots, out, R] do not fit x and y");
  at::Tensor out = y.contiguous().clone();
  const int64_t lines = x.size(0);
  if (lines == 0) return out;
  const int64_t d_in = x.size(-1), d_out = y.size(-1);
  const at::Tensor x3 = x.reshape({lines, -1, d_in});
  at::Tensor out3 = out.view({lines, -1, d_out});
  const int64_t per_line = x3.size(1);
  const at::Tensor s = slots.contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  std::map<int64_t, std::vector<int64_t>> by_slot;
  for (int64_t l = 0; l < lines; ++l) {
    if (sp[l] < 0) continue;
    TORCH_CHECK(sp[l] < a.size(0), "lora_delta: line ", l, " names slot ", sp[l], " of ", a.size(0));
    by_slot[sp[l]].push_back(l);
  }
  for (const auto& [slot, members] : by_slot) {
    const int64_t n = static_cast<int64_t>(members.size());
    const bool run = members.back() - members.front() + 1 == n;
    at::Tensor index;
    at::Tensor xs;
    if (run) {
      xs = x3.narrow(0, members.front(), n);
    } else {
      index = at::tensor(members, at::TensorOptions().dtype(at::kLong));
      xs = x3.index_select(0, index);
    }
    const at::Tensor delta =
        at::mm(at::mm(xs.reshape({n * per_line, d_in}), a[slot].t()), b[slot].t()).view({n, per_line, d_out});
    if (run) {
      out3.narrow(0, members.front(), n).add_(delta.to(out.scalar_type()));
    } else {
      out3.index_add_(0, index, delta.to(out.scalar_type()));
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(neuron_lmi, CPU, m) { m.impl("lora_delta", &lora_delta); }
