// Re-pointing a parameter's data at another tensor while keeping the parameter's identity.
#pragma once

#include <ATen/core/Tensor.h>

namespace fsdp {

// C++'s `param.data = data`: the parameter keeps its TensorImpl (so every module handle to it
// sees the change), its autograd metadata and hooks. Unlike Tensor::set_data this also moves a
// parameter off the meta device, which deferred init needs: set_data refuses meta -> CPU because
// the two are not "shallow-copy compatible", though the metadata copy itself is well defined.
void rebind_param_data(const at::Tensor& param, const at::Tensor& data);

}  // namespace fsdp
