// Range-addressable initialisers (see fsdp/init.h): element i of a parameter is drawn from the
// generator of its block, seeded by (seed, name, i / kInitBlock), so any element range can be
// generated alone and always gets the same values.
#include "fsdp/init.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <ATen/CPUGeneratorImpl.h>

#include <unordered_set>

#include "fsdp/errors.h"
#include "flat/param_data.h"

namespace fsdp::init {
namespace {

uint64_t mix(uint64_t h, uint64_t v) {
  // splitmix64-style mixing; stable across platforms and runs.
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 29;
  return h;
}

uint64_t hash_name(const std::string& name) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

// Fills out[k] = value of element (offset + k), generating block by block.
void fill_blocks(const std::string& name, int64_t offset, at::Tensor& out, uint64_t seed,
                 const std::function<at::Tensor(at::Generator&)>& block) {
  const int64_t n = out.numel();
  int64_t done = 0;
  const uint64_t base = mix(seed, hash_name(name));
  while (done < n) {
    const int64_t element = offset + done;
    const int64_t b = element / kInitBlock;
    const int64_t within = element % kInitBlock;
    const int64_t take = std::min(kInitBlock - within, n - done);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(mix(base, static_cast<uint64_t>(b)));
    at::Tensor values = block(gen);
    out.narrow(0, done, take).copy_(values.narrow(0, within, take));
    done += take;
  }
}

}  // namespace

ParamInitFn normal(double std, uint64_t seed) {
  return [std, seed](const std::string& name, at::IntArrayRef, int64_t offset, at::Tensor& out) {
    fill_blocks(name, offset, out, seed, [std](at::Generator& gen) {
      return at::normal(0.0, std, {kInitBlock}, gen, at::TensorOptions().dtype(at::kFloat));
    });
  };
}

ParamInitFn uniform(double lo, double hi, uint64_t seed) {
  return [lo, hi, seed](const std::string& name, at::IntArrayRef, int64_t offset, at::Tensor& out) {
    fill_blocks(name, offset, out, seed, [lo, hi](at::Generator& gen) {
      return at::empty({kInitBlock}, at::TensorOptions().dtype(at::kFloat)).uniform_(lo, hi, gen);
    });
  };
}

ParamInitFn constant(double value) {
  return [value](const std::string&, at::IntArrayRef, int64_t, at::Tensor& out) { out.fill_(value); };
}

ParamInitFn from_load() {
  return [](const std::string& name, at::IntArrayRef, int64_t, at::Tensor&) {
    throw UsageError("fsdp: '" + name +
                     "' was left to a load (FullyShardOptions::init(fsdp::init::from_load())), but the model was used "
                     "before a load wrote it: call fsdp::checkpoint::load or import_weights before the first forward, "
                     "or give FullyShardOptions::init an initialiser (fsdp/init.h)");
  };
}

ParamInitFn by_suffix(std::vector<std::pair<std::string, ParamInitFn>> rules, ParamInitFn fallback) {
  return [rules = std::move(rules), fallback = std::move(fallback)](const std::string& name, at::IntArrayRef shape,
                                                                    int64_t offset, at::Tensor& out) {
    for (const auto& [suffix, fn] : rules) {
      if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
        fn(name, shape, offset, out);
        return;
      }
    }
    fallback(name, shape, offset, out);
  };
}

void materialize(torch::nn::Module& module, const ParamInitFn& fn) {
  c10::NoGradGuard no_grad;
  std::unordered_set<const void*> done;  // tied parameters: the first name initialises them
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    at::Tensor& p = item.value();
    if (!done.insert(p.unsafeGetTensorImpl()).second) continue;
    if (p.is_meta()) {
      fsdp::materialize_whole(p, item.key(), fn);
      continue;
    }
    at::Tensor full = at::empty(p.sizes(), at::TensorOptions().dtype(at::kFloat));
    at::Tensor flat = full.view({-1});
    fn(item.key(), p.sizes(), 0, flat);
    p.copy_(full);
  }
  // Buffers built on the meta device (fsdp/meta.h), as the root's lazy init materialises them.
  for (auto& item : module.named_buffers(/*recurse=*/true)) {
    if (item.value().is_meta()) fsdp::materialize_whole(item.value(), item.key(), fn);
  }
}

}  // namespace fsdp::init
