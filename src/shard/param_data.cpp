// See param_data.h.
#include "shard/param_data.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <mutex>

#include "fsdp/errors.h"

namespace fsdp {

void rebind_param_data(const at::Tensor& param, const at::Tensor& data) {
  c10::NoGradGuard no_grad;
  if (!param.is_meta()) {
    const_cast<at::Tensor&>(param).set_data(data);
    return;
  }
  // Same as set_data's own body, minus its compatibility check; keeps the version counter.
  param.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
}

namespace {

// A guard's storage holds no bytes; its DataPtr's context is the guard's ParamGuardInfo, which
// is how the fallback tells a guard from another tensor and names the module.
struct GuardContext {
  std::shared_ptr<ParamGuardInfo> info;
};

void delete_guard_context(void* ctx) { delete static_cast<GuardContext*>(ctx); }

const ParamGuardInfo* guard_info(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const c10::DataPtr& ptr = t.storage().data_ptr();
  if (ptr.get_deleter() != &delete_guard_context) return nullptr;
  return static_cast<GuardContext*>(ptr.get_context())->info.get();
}

const ParamGuardInfo* find_guard(const torch::jit::Stack& stack) {
  for (const auto& v : stack) {
    if (v.isTensor()) {
      if (const auto* info = guard_info(v.toTensor())) return info;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) {
        if (const auto* info = guard_info(t)) return info;
      }
    }
  }
  return nullptr;
}

[[noreturn]] void guarded_param_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const ParamGuardInfo* info = find_guard(*stack);
  const std::string type = info ? info->module_type : "a sharded module";
  const std::string unit = info && !info->unit.empty() ? "'" + info->unit + "' (" + type + ")" : type;
  std::string msg = "fsdp: " + std::string(op.schema().name()) + " was given a parameter of sharded module " + unit +
                    " while its parameters are not gathered: the module's forward ran outside fsdp::call. Run it as "
                    "fsdp::call(module, args...)";
  if (info && info->unit.empty()) {
    msg += "; the root never ran through fsdp::call either: a step starts with fsdp::call(root, inputs)";
  }
  msg +=
      "; a sharded block inside a torch::nn::Sequential, ModuleList or AnyModule, which call their children's "
      "forward themselves, must be wrapped with fsdp::Sharded (docs/WRAPPING.md); outside forward and backward, "
      "read parameters through the optimizer's shards or a checkpoint";
  throw UsageError(msg);
}

void register_guard_fallback() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Lives as long as the process: the registration is undone when it is destroyed.
    static auto* library =
        new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::DeferredInit, __FILE__, __LINE__);
    library->fallback(torch::CppFunction::makeFromBoxedFunction<&guarded_param_fallback>());
  });
}

}  // namespace

at::Tensor make_param_guard(const at::Tensor& like, std::shared_ptr<ParamGuardInfo> info) {
  register_guard_fallback();
  auto* ctx = new GuardContext{std::move(info)};
  c10::DataPtr ptr(nullptr, ctx, &delete_guard_context, like.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, std::move(ptr), /*allocator=*/nullptr, /*resizable=*/false);
  const auto keys = like.key_set() | c10::DispatchKeySet(c10::DispatchKey::DeferredInit);
  at::Tensor guard = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, like.dtype());
  guard.unsafeGetTensorImpl()->set_sizes_contiguous(like.sizes());
  return guard;
}

void point_param_at(const at::Tensor& param, const at::Tensor& data) {
  param.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
}

}  // namespace fsdp
