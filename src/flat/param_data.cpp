// See param_data.h.
#include "flat/param_data.h"

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

void materialize_whole(const at::Tensor& tensor, const std::string& name, const ParamInitFn& init, c10::Device device) {
  c10::NoGradGuard no_grad;
  at::Tensor values = at::empty(tensor.sizes(), at::TensorOptions().dtype(at::kFloat));
  at::Tensor flat = values.view({-1});
  init(name, tensor.sizes(), 0, flat);
  rebind_param_data(tensor, values.to(at::TensorOptions().dtype(tensor.scalar_type()).device(device)));
}

namespace {

// A guard's storage holds no bytes; its DataPtr's context says what the guard stands for, which
// is how the fallback tells a guard from another tensor and names the parameter and module.
struct GuardContext {
  std::shared_ptr<ParamGuardInfo> info;
  std::string param;  // its name in the unit
  bool gradient = false;
};

void delete_guard_context(void* ctx) { delete static_cast<GuardContext*>(ctx); }

const GuardContext* guard_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const c10::DataPtr& ptr = t.storage().data_ptr();
  if (ptr.get_deleter() != &delete_guard_context) return nullptr;
  return static_cast<GuardContext*>(ptr.get_context());
}

// The parameter's path from the root once the root is known ("layers.0.fc.weight"), else its
// name in its unit.
std::string param_path(const GuardContext& g) {
  const std::string& unit = g.info->unit;
  return unit.empty() || unit == "<root>" ? g.param : unit + "." + g.param;
}

std::string module_of(const GuardContext& g) {
  const std::string& type = g.info->module_type;
  return g.info->unit.empty() ? type : "'" + g.info->unit + "' (" + type + ")";
}

// The guards among an operator's arguments: the first gradient guard, the first parameter guard
// and whether that parameter's .grad is guarded (it was read after a backward).
struct GuardsSeen {
  const GuardContext* grad = nullptr;
  const GuardContext* param = nullptr;
  bool param_after_backward = false;
};

void see(const at::Tensor& t, GuardsSeen& seen) {
  const GuardContext* g = guard_of(t);
  if (g == nullptr) return;
  if (g->gradient) {
    if (seen.grad == nullptr) seen.grad = g;
  } else if (seen.param == nullptr) {
    seen.param = g;
    seen.param_after_backward = is_gradient_guard(t.unsafeGetTensorImpl()->grad());
  }
}

GuardsSeen guards_in(const torch::jit::Stack& stack) {
  GuardsSeen seen;
  for (const auto& v : stack) {
    if (v.isTensor()) {
      see(v.toTensor(), seen);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) see(t, seen);
    }
  }
  return seen;
}

// How to read a sharded module's weights outside its forward and backward.
constexpr const char* kReadAdvice =
    "To read the weights between steps, gather them: unit->unshard() on the FSDPModule fully_shard returned for "
    "this module (on every rank: it is a collective), read, then unit->reshard(); or save a checkpoint "
    "(fsdp::save) and read it into an unsharded copy of the model with fsdp::load_unsharded (fsdp/checkpoint.h)";

constexpr const char* kOptimizerAdvice =
    "Build a torch::optim optimizer over the shards with fsdp::TorchOptimizer::make<torch::optim::Adam>(root, "
    "options) (fsdp/torch_optim.h) or use fsdp::AdamW / fsdp::SGD, and clip with fsdp::clip_grad_norm(*root, "
    "max_norm), not torch::nn::utils::clip_grad_norm_ (docs/WRAPPING.md)";

std::string gradient_message(const std::string& op, const GuardContext& g) {
  return "fsdp: " + op + " was given the .grad of parameter '" + param_path(g) + "' of sharded module " + module_of(g) +
         ": a sharded model's gradients live in fsdp's gradient shards, not in its parameters' .grad, so a "
         "torch::optim optimizer or gradient clipping over module->parameters() would train nothing. " +
         kOptimizerAdvice;
}

std::string after_backward_message(const std::string& op, const GuardContext& g) {
  return "fsdp: " + op + " was given parameter '" + param_path(g) + "' of sharded module " + module_of(g) +
         " after backward, while its parameters are not gathered (each rank holds a shard of them, in fsdp's flat "
         "buffers). " +
         kReadAdvice + ". To step the model: " + kOptimizerAdvice + "; a forward runs as fsdp::call(module, args...)";
}

std::string parameter_message(const std::string& op, const GuardContext* g) {
  std::string msg = "fsdp: " + op + " was given " + (g ? "parameter '" + param_path(*g) + "'" : "a parameter") +
                    " of sharded module " + (g ? module_of(*g) : "?") +
                    " while its parameters are not gathered: the module's forward ran outside fsdp::call. Run it "
                    "as fsdp::call(module, args...)";
  if (g && g->info->unit.empty()) {
    msg += "; the root never ran through fsdp::call either: a step starts with fsdp::call(root, inputs)";
  }
  return msg +
         "; a sharded block inside a torch::nn::Sequential, ModuleList or AnyModule, which call their children's "
         "forward themselves, must be wrapped with fsdp::Sharded (docs/WRAPPING.md). " +
         kReadAdvice +
         "; build a torch::optim optimizer with fsdp::TorchOptimizer::make(root, options), not over "
         "module->parameters()";
}

// What clearing a gradient does (Module::zero_grad, Optimizer::zero_grad): nothing to clear.
bool is_noop_on_gradient(const std::string& op) {
  return op == "aten::detach" || op == "aten::detach_" || op == "aten::zero_";
}

void guarded_param_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const GuardsSeen seen = guards_in(*stack);
  const std::string name = op.schema().name();
  if (seen.grad != nullptr && seen.param == nullptr && is_noop_on_gradient(name)) {
    return;  // the stack holds `self`, which is also what these operators return
  }
  if (seen.grad != nullptr) throw UsageError(gradient_message(name, *seen.grad));
  if (seen.param != nullptr && seen.param_after_backward) throw UsageError(after_backward_message(name, *seen.param));
  throw UsageError(parameter_message(name, seen.param));
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

at::Tensor make_param_guard(const at::Tensor& like, std::shared_ptr<ParamGuardInfo> info, std::string param,
                            bool gradient) {
  register_guard_fallback();
  auto* ctx = new GuardContext{std::move(info), std::move(param), gradient};
  c10::DataPtr ptr(nullptr, ctx, &delete_guard_context, like.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, std::move(ptr), /*allocator=*/nullptr, /*resizable=*/false);
  const auto keys = like.key_set() | c10::DispatchKeySet(c10::DispatchKey::DeferredInit);
  at::Tensor guard = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, like.dtype());
  guard.unsafeGetTensorImpl()->set_sizes_contiguous(like.sizes());
  return guard;
}

bool is_gradient_guard(const at::Tensor& t) {
  const GuardContext* g = guard_of(t);
  return g != nullptr && g->gradient;
}

void point_param_at(const at::Tensor& param, const at::Tensor& data) {
  param.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
}

}  // namespace fsdp
