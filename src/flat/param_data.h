// Re-pointing a parameter's data at another tensor while keeping the parameter's identity, and the
// guard that stands in for a parameter's data while its flat param is sharded.
#pragma once

#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "fsdp/param_init.h"

namespace fsdp {

// C++'s `param.data = data`: the parameter keeps its TensorImpl (so every module handle to it
// sees the change), its autograd metadata and hooks. Unlike Tensor::set_data this also moves a
// parameter off the meta device, which deferred init needs: set_data refuses meta -> CPU because
// the two are not "shallow-copy compatible", though the metadata copy itself is well defined.
void rebind_param_data(const at::Tensor& param, const at::Tensor& data);

// Deferred init of a whole tensor (a meta parameter of an unsharded model, a meta buffer): its
// values from `init` under `name` (fp32, then its own dtype, on `device`), rebound in place.
void materialize_whole(const at::Tensor& tensor, const std::string& name, const ParamInitFn& init,
                       c10::Device device = c10::Device(c10::kCPU));

// Note [Guarded parameters]
// While a flat param is sharded its parameters' data is a guard: a tensor with the parameter's
// sizes, dtype and device but no bytes, whose dispatch keys include DispatchKey::DeferredInit (a
// key LibTorch reserves for deferred initialisation, which nothing else in a LibTorch program
// sets). fsdp registers a fallback for that key, so any operator given a guarded parameter (a
// forward run outside fsdp::call, a stock container calling a sharded child, printing a
// parameter) reaches the fallback before any kernel, and it throws UsageError naming the module.
// Metadata (sizes, dtype, device, requires_grad) reads no data and stays available.
//
// Note [Guarded gradients]
// A sharded model's gradients live in fsdp's gradient shards; a parameter's .grad is a view of
// the unit's gradient buffer only during its backward. From the end of a backward until the
// root's next forward every trainable parameter's .grad is a guard of the same kind, so that a
// torch::optim optimizer or torch::nn::utils::clip_grad_norm_ over module->parameters(), which
// would otherwise see no gradient and silently do nothing, fails on its first read of a gradient
// with UsageError pointing to fsdp::TorchOptimizer::make and fsdp::clip_grad_norm. detach,
// detach_ and zero_ of a guarded gradient (what Module::zero_grad and Optimizer::zero_grad do)
// are no-ops: the gradient they would clear is not there. fsdp's pre_backward points .grad back
// at the gradient buffer before AccumulateGrad adds into it.
struct ParamGuardInfo {
  std::string unit;         // the unit's name once the root is known ("" before its lazy init)
  std::string module_type;  // e.g. "torch::nn::LinearImpl"
};

// A guard shaped like `like` (the parameter's gathered view) for parameter `param` (its name in
// the unit); `gradient`: it stands in for the parameter's .grad (Note [Guarded gradients]).
at::Tensor make_param_guard(const at::Tensor& like, std::shared_ptr<ParamGuardInfo> info, std::string param,
                            bool gradient = false);

// Whether `t` is a guard of a parameter's .grad.
bool is_gradient_guard(const at::Tensor& t);

// Points `param` at `data` (a guard or a view of the gathered buffer) without dispatching.
void point_param_at(const at::Tensor& param, const at::Tensor& data);

}  // namespace fsdp
