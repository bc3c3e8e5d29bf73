// Deterministic, range-addressable parameter initialisers for deferred (meta-device) init.
//
// Element i of parameter `name` depends only on (seed, name, i): values are drawn in blocks of
// kInitBlock elements, each block from its own generator seeded by (seed, name, block index). Any
// rank can therefore generate exactly its shard, and an unsharded model initialised with the same
// function holds exactly the same values.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "fsdp/options.h"

namespace fsdp::init {

constexpr int64_t kInitBlock = 4096;

// N(0, std^2) per element.
ParamInitFn normal(double std, uint64_t seed);
// Uniform in [lo, hi) per element.
ParamInitFn uniform(double lo, double hi, uint64_t seed);
// Every element `value`.
ParamInitFn constant(double value);
// The first rule whose name suffix matches `name` (e.g. "norm.weight"), else `fallback`.
ParamInitFn by_suffix(std::vector<std::pair<std::string, ParamInitFn>> rules, ParamInitFn fallback);
// No values of its own: for a meta-built model whose values a load writes (fsdp::checkpoint::load
// or import_weights) before its first forward. fully_shard refuses meta parameters without an
// init, so a model to be loaded says so with this one; it throws UsageError, naming the tensor,
// if the model is used before a load has written it.
ParamInitFn from_load();

// Fills every parameter of `module` with `fn` (computed in fp32, stored in the parameter's dtype);
// parameters on the meta device are allocated on the CPU and replaced in place (set_data),
// keeping identity and requires_grad. Buffers on the meta device (fsdp/meta.h) are filled too,
// under their names.
void materialize(torch::nn::Module& module, const ParamInitFn& fn);

}  // namespace fsdp::init
