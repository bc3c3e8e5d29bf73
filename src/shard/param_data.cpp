// See param_data.h.
#include "shard/param_data.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

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

}  // namespace fsdp
