// LoRA adapters on any module's Linears (fsdp/lora.h).
//
// Note [How an adapter joins a Linear's forward]
// LibTorch modules have no forward hooks, and a Linear's forward is not virtual: the only thing of
// the Linear that lora() can change is the tensor its forward passes as the weight. lora()
// replaces the Linear's `weight` member (not its registered parameter, which stays the base
// weight that fully_shard shards and checkpoints name) with a LoraWeight: a tensor without storage
// whose dispatch keys are PrivateUse1's, holding the base weight, the two adapters' weights, the
// scaling and the dropout. The ops a Linear's forward applies to its weight (at::linear, or
// F::linear's t() followed by matmul or addmm) meet that key and come to the kernels registered
// below, which compute base(x) + B(A(dropout(x))) * scaling on the real tensors, through autograd
// like any other op. So the adapters get gradients, the base weight none, and nothing the size of
// the base weight is materialised or kept for backward: the saved tensors are those of PEFT's
// forward. The real tensors are the registered parameters themselves (one TensorImpl each), so
// they follow fully_shard's gathers and guards: a LoraWeight read while its unit is sharded reads
// the guards and fails as any parameter would.
#include "fsdp/lora.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/TensorImpl.h>
#include <torch/library.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <typeindex>

#include "base/strings.h"
#include "fsdp/errors.h"
#include "fsdp/init.h"

namespace fsdp {
namespace {

constexpr const char* kAdapterA = "lora_A";
constexpr const char* kAdapterB = "lora_B";

// An adapter: one "weight" parameter, never called (the LoraWeight kernels read it).
class AdapterImpl : public torch::nn::Module {
 public:
  explicit AdapterImpl(at::Tensor w) : weight(register_parameter("weight", std::move(w))) {}
  at::Tensor weight;
};

struct LoraState {
  at::Tensor base, a, b;  // the registered parameters (their TensorImpls, so they follow set_data)
  double scaling = 1.0;
  double dropout = 0.0;
  std::weak_ptr<torch::nn::Module> owner;  // the Linear: dropout applies in its training mode
};

class LoraWeightImpl : public c10::TensorImpl {
 public:
  LoraWeightImpl(std::shared_ptr<const LoraState> state, bool transposed)
      : c10::TensorImpl(c10::DispatchKeySet({c10::DispatchKey::PrivateUse1, c10::DispatchKey::AutogradPrivateUse1,
                                             c10::DispatchKey::ADInplaceOrView}),
                        state->base.dtype(), c10::Device(c10::kPrivateUse1, 0)),
        state_(std::move(state)),
        transposed_(transposed) {
    std::vector<int64_t> sizes = state_->base.sizes().vec();
    if (transposed) std::swap(sizes[0], sizes[1]);
    set_sizes_contiguous(sizes);
    set_storage_access_should_throw();
  }
  const LoraState& state() const { return *state_; }
  const std::shared_ptr<const LoraState>& shared() const { return state_; }
  bool transposed() const { return transposed_; }

 private:
  std::shared_ptr<const LoraState> state_;
  bool transposed_;
};

at::Tensor make_lora_weight(std::shared_ptr<const LoraState> state, bool transposed) {
  // A tensor made under InferenceMode would be an inference tensor, which the view tracking of
  // t() (for a normal input) refuses: make it a normal one.
  const c10::InferenceMode normal(false);
  return at::Tensor(c10::make_intrusive<LoraWeightImpl>(std::move(state), transposed));
}

const LoraWeightImpl* as_lora(const at::Tensor& t) {
  return t.defined() ? dynamic_cast<const LoraWeightImpl*>(t.unsafeGetTensorImpl()) : nullptr;
}

const LoraState& lora_of(const at::Tensor& w, bool transposed, const char* op) {
  const LoraWeightImpl* l = as_lora(w);
  if (l == nullptr || l->transposed() != transposed) {
    throw ConfigError(std::string("fsdp: lora: aten::") + op +
                      " reached a LoRA weight in a form it does not take; an adapted Linear's weight only "
                      "goes through at::linear, or t() then matmul or addmm (F::linear)");
  }
  return l->state();
}

// PEFT's forward: base(x) + lora_B(lora_A(dropout(x))) * scaling.
at::Tensor adapted(const at::Tensor& x, const LoraState& s, const std::optional<at::Tensor>& bias) {
  at::Tensor y = at::linear(x, s.base, bias);
  at::Tensor h = x;
  const auto owner = s.owner.lock();
  if (s.dropout > 0 && owner && owner->is_training()) h = at::dropout(x, s.dropout, /*train=*/true);
  return y + at::linear(at::linear(h, s.a), s.b) * s.scaling;
}

at::Tensor k_t(const at::Tensor& w) {
  const LoraWeightImpl* l = as_lora(w);
  lora_of(w, false, "t");
  return make_lora_weight(l->shared(), true);
}
at::Tensor k_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return adapted(x, lora_of(w, false, "linear"), bias);
}
at::Tensor k_matmul(const at::Tensor& x, const at::Tensor& w_t) { return adapted(x, lora_of(w_t, true, "matmul"), {}); }
at::Tensor k_addmm(const at::Tensor& bias, const at::Tensor& x, const at::Tensor& w_t, const at::Scalar& beta,
                   const at::Scalar& alpha) {
  if (beta.toDouble() != 1.0 || alpha.toDouble() != 1.0) lora_of(at::Tensor(), true, "addmm with beta or alpha");
  return adapted(x, lora_of(w_t, true, "addmm"), bias);
}

}  // namespace
}  // namespace fsdp

// Autograd first (training), the backend key for what runs with autograd excluded (InferenceMode).
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("t", fsdp::k_t);
  m.impl("linear", fsdp::k_linear);
  m.impl("matmul", fsdp::k_matmul);
  m.impl("addmm", fsdp::k_addmm);
}
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("t", fsdp::k_t);
  m.impl("linear", fsdp::k_linear);
  m.impl("matmul", fsdp::k_matmul);
  m.impl("addmm", fsdp::k_addmm);
}

namespace fsdp {
namespace {

using WeightFn = std::function<at::Tensor*(torch::nn::Module&)>;

std::map<std::type_index, WeightFn>& linear_types(std::unique_lock<std::mutex>& lock) {
  static std::mutex mutex;
  static std::map<std::type_index, WeightFn> types{
      {std::type_index(typeid(torch::nn::LinearImpl)),
       [](torch::nn::Module& m) { return &static_cast<torch::nn::LinearImpl&>(m).weight; }}};
  lock = std::unique_lock<std::mutex>(mutex);
  return types;
}

// The member a Linear's forward reads as its weight, or null when `m` is not a Linear.
at::Tensor* weight_member(torch::nn::Module& m) {
  std::unique_lock<std::mutex> lock;
  auto& types = linear_types(lock);
  auto it = types.find(std::type_index(typeid(m)));
  return it == types.end() ? nullptr : it->second(m);
}

bool is_regex(const std::string& pattern) { return pattern.find_first_of("*+?[](){}|^$\\") != std::string::npos; }

bool matches(const std::string& pattern, const std::string& name) {
  if (is_regex(pattern)) return std::regex_match(name, std::regex(pattern));
  if (name == pattern) return true;
  return name.size() > pattern.size() && name.compare(name.size() - pattern.size(), pattern.size(), pattern) == 0 &&
         name[name.size() - pattern.size() - 1] == '.';
}

void check_options(const LoraOptions& o) {
  if (o.targets().empty()) throw ConfigError("fsdp: lora: no target patterns (LoraOptions::targets)");
  if (o.r() < 1) throw ConfigError("fsdp: lora: r is " + std::to_string(o.r()) + "; it must be at least 1");
  if (!(o.alpha() > 0)) throw ConfigError("fsdp: lora: alpha is " + std::to_string(o.alpha()) + "; it must be > 0");
  if (!(o.dropout() >= 0 && o.dropout() < 1)) {
    throw ConfigError("fsdp: lora: dropout is " + std::to_string(o.dropout()) + "; it must be in [0, 1)");
  }
}

std::string linear_names(const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& modules) {
  std::string out;
  int shown = 0;
  for (const auto& [name, m] : modules) {
    if (weight_member(*m) == nullptr || shown == 6) continue;
    out += (shown++ ? ", " : "") + name;
  }
  return out.empty() ? "none" : out;
}

// The modules `options` targets, each checked to be a Linear; every pattern must match.
std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> find_targets(torch::nn::Module& model,
                                                                                     const LoraOptions& options) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> modules;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (item.key() == "_fsdp_unit" || item.key().find("._fsdp_unit") != std::string::npos) {
      throw ConfigError("fsdp: lora: the model is already sharded; call fsdp::lora before fully_shard");
    }
    if (item.value()->named_children().contains(kAdapterA)) {
      throw ConfigError("fsdp: lora: module '" + item.key() + "' already has adapters (lora was applied before)");
    }
    modules.emplace_back(item.key(), item.value());
  }
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> targets;  // module order
  std::vector<bool> used(options.targets().size(), false);
  for (const auto& [name, m] : modules) {
    bool hit = false;
    for (size_t k = 0; k < options.targets().size(); ++k) {
      const std::string& pattern = options.targets()[k];
      if (!matches(pattern, name)) continue;
      used[k] = hit = true;
      if (weight_member(*m) == nullptr) {
        throw ConfigError("fsdp: lora: target pattern '" + pattern + "' matches module '" + name + "' of type " +
                          m->name() +
                          ", which is not a Linear; narrow the pattern, or declare the type with "
                          "fsdp::register_linear_type if its forward is at::linear(x, weight, bias)");
      }
    }
    if (hit) targets.emplace_back(name, m);
  }
  for (size_t k = 0; k < used.size(); ++k) {
    if (!used[k]) {
      throw ConfigError("fsdp: lora: target pattern '" + options.targets()[k] +
                        "' matches no module of the model; its Linears include: " + linear_names(modules));
    }
  }
  return targets;
}

}  // namespace

std::string lora_adapter_name(const std::string& module, LoraWeight which) {
  return module + "." + (which == LoraWeight::kA ? kAdapterA : kAdapterB) + ".weight";
}

std::string lora_module_of(const std::string& name, LoraWeight* which) {
  for (const LoraWeight w : {LoraWeight::kA, LoraWeight::kB}) {
    const std::string suffix = lora_adapter_name("", w);  // ".lora_A.weight"
    if (name.size() > suffix.size() && fsdp::base::ends_with(name, suffix)) {
      if (which != nullptr) *which = w;
      return name.substr(0, name.size() - suffix.size());
    }
  }
  return "";
}

bool is_lora_adapter(const std::string& name) { return !lora_module_of(name).empty(); }

void register_linear_type(const std::type_info& type, std::function<at::Tensor*(torch::nn::Module&)> weight) {
  std::unique_lock<std::mutex> lock;
  linear_types(lock)[std::type_index(type)] = std::move(weight);
}

ParamInitFn LoraModel::init(ParamInitFn base, uint64_t seed) const {
  return
      [base = std::move(base), seed](const std::string& name, at::IntArrayRef shape, int64_t offset, at::Tensor& out) {
        LoraWeight which = LoraWeight::kA;
        const bool adapter = !lora_module_of(name, &which).empty();
        if (adapter && which == LoraWeight::kA) {
          // PEFT's kaiming_uniform_(a=sqrt(5)) over fan_in = in_features: bound 1/sqrt(in).
          const double bound = 1.0 / std::sqrt(static_cast<double>(shape[1]));
          init::uniform(-bound, bound, seed)(name, shape, offset, out);
        } else if (adapter) {
          out.zero_();
        } else if (base) {
          base(name, shape, offset, out);
        } else {
          throw ConfigError("fsdp: lora: parameter '" + name + "' needs deferred init and LoraModel::init has no base");
        }
      };
}

FrozenStorageFn LoraModel::frozen_storage() const {
  std::set<const void*> bases;
  for (const auto& t : targets) bases.insert(t.base_weight.unsafeGetTensorImpl());
  const FrozenStorage s = options.base_dtype();
  const bool quantized = s == FrozenStorage::kInt8 || s == FrozenStorage::kNF4;
  return [bases = std::move(bases), s, quantized](const std::string&, const at::Tensor& p) {
    if (p.requires_grad()) return FrozenStorage::kParamDtype;  // the adapters: fp32 masters
    if (bases.count(p.unsafeGetTensorImpl())) return s;
    return quantized ? FrozenStorage::kParamDtype : s;
  };
}

std::vector<std::string> LoraModel::adapter_names() const {
  std::vector<std::string> names;
  for (const auto& t : targets) {
    names.push_back(lora_adapter_name(t.name, LoraWeight::kA));
    names.push_back(lora_adapter_name(t.name, LoraWeight::kB));
  }
  return names;
}

LoraModel lora(torch::nn::Module& model, const LoraOptions& options, uint64_t seed) {
  check_options(options);
  const auto found = find_targets(model, options);
  for (auto& p : model.parameters(/*recurse=*/true)) p.set_requires_grad(false);
  LoraModel out;
  out.options = options;
  const ParamInitFn init = out.init(nullptr, seed);
  c10::NoGradGuard no_grad;
  for (const auto& [name, m] : found) {
    at::Tensor* member = weight_member(*m);
    const at::Tensor base = m->named_parameters(/*recurse=*/false)["weight"];
    if (base.dim() != 2 || !member->is_same(base)) {
      throw ConfigError("fsdp: lora: Linear '" + name + "' has no 2-D registered \"weight\" that its forward reads");
    }
    const int64_t in = base.size(1), out_f = base.size(0), r = options.r();
    const auto opts = base.options().requires_grad(false);
    auto a = m->register_module(kAdapterA, std::make_shared<AdapterImpl>(at::empty({r, in}, opts)));
    auto b = m->register_module(kAdapterB, std::make_shared<AdapterImpl>(at::empty({out_f, r}, opts)));
    if (!base.is_meta()) {
      for (auto* w : {&a->weight, &b->weight}) {
        const std::string full = lora_adapter_name(name, w == &a->weight ? LoraWeight::kA : LoraWeight::kB);
        at::Tensor flat = at::empty({w->numel()}, at::kFloat);
        init(full, w->sizes(), 0, flat);
        w->copy_(flat.view(w->sizes()));
      }
    }
    a->weight.set_requires_grad(true);
    b->weight.set_requires_grad(true);
    auto state = std::make_shared<LoraState>();
    state->base = base;
    state->a = a->weight;
    state->b = b->weight;
    state->scaling = out.scaling();
    state->dropout = options.dropout();
    state->owner = m;
    *member = make_lora_weight(std::move(state), false);
    out.targets.push_back({name, in, out_f, base});
  }
  return out;
}

bool has_lora(torch::nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/true)) {
    at::Tensor* member = weight_member(*m);
    if (member != nullptr && as_lora(*member) != nullptr) return true;
  }
  return false;
}

void merge_lora(torch::nn::Module& model) {
  c10::NoGradGuard no_grad;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    torch::nn::Module& m = *item.value();
    at::Tensor* member = weight_member(m);
    const LoraWeightImpl* l = member ? as_lora(*member) : nullptr;
    if (l == nullptr) continue;
    const LoraState& s = l->state();
    if (s.base.is_meta() || !s.base.has_storage() || s.base.numel() == 0) {
      throw ConfigError("fsdp: merge_lora: Linear '" + item.key() +
                        "' has no values to merge into (a sharded or meta model); merge an unsharded one");
    }
    const at::Tensor delta = at::matmul(s.b.to(at::kFloat), s.a.to(at::kFloat)) * s.scaling;
    at::Tensor base = s.base;
    base.copy_(base.to(at::kFloat) + delta);
    *member = base;
    m.unregister_module(kAdapterA);
    m.unregister_module(kAdapterB);
  }
}

}  // namespace fsdp
