// ParamInitFn: how deferred initialisation fills a parameter's values, a range at a time
// (FullyShardOptions::init in fsdp/options.h; ready-made ones in fsdp/init.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <ATen/core/Tensor.h>

namespace fsdp {

// Deferred initialisation: fills `out` with elements [offset, offset + out.numel()) of the
// row-major flattened parameter `name` of shape `shape`. Must give the same values whatever the
// range, so that every rank can materialise only its shard. See fsdp/init.h for ready-made ones.
using ParamInitFn =
    std::function<void(const std::string& name, at::IntArrayRef shape, int64_t offset, at::Tensor& out)>;

}  // namespace fsdp
