// Mixed precision for fully_shard, as FSDP2's MixedPrecisionPolicy: the dtypes a unit gathers,
// computes, reduces and returns in. Master shards (and the optimizer's state) stay fp32.
//
//   auto mp = fsdp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
//   fsdp::fully_shard(block, mesh, fsdp::FullyShardOptions().mp_policy(mp));
#pragma once

#include <optional>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

namespace fsdp {

struct MixedPrecisionPolicy {
  // Params are gathered and computed in param_dtype, and floating inputs of the unit's forward
  // are cast to it. Unset: each parameter's own dtype (no mixed precision).
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype) = std::nullopt;
  // Gradients are reduced in reduce_dtype. Unset: param_dtype.
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype) = std::nullopt;
  // Floating outputs of the unit's forward are cast to output_dtype (e.g. fp32 on the root for
  // the loss). Unset: left as computed.
  TORCH_ARG(std::optional<at::ScalarType>, output_dtype) = std::nullopt;
  // Floating persistent buffers of the unit (those no nested unit owns) are cast to buffer_dtype
  // at the root's lazy init, and kept so; checkpoints still hold them in their original dtype.
  // Unset: left as they are.
  TORCH_ARG(std::optional<at::ScalarType>, buffer_dtype) = std::nullopt;
};

}  // namespace fsdp
