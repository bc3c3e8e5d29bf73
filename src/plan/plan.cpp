// The planner: a model's shape from a module, the search over choices (fastest first), and what is
// short when nothing fits. The arithmetic of one set of choices is in plan_cost.cpp.
#include "fsdp/plan.h"

#include <algorithm>
#include <array>
#include <set>
#include <sstream>

#include "base/named.h"
#include "base/strings.h"
#include "fsdp/errors.h"
#include "offload/placement.h"
#include "plan/plan_cost.h"
#include "shard/resolved_options.h"
#include "sysinfo/sysinfo.h"

namespace fsdp {

using planning::Choices;

int64_t ModelShape::numel() const {
  int64_t n = 0;
  for (const auto& u : units) n = planning::add_bytes(n, u.numel(), "the parameter count of " + u.name);
  return n;
}

int64_t ModelShape::trainable_numel() const {
  int64_t n = 0;
  for (const auto& u : units) n += u.trainable_numel;
  return n;
}

namespace {

constexpr base::Named<Accumulation> kAccumulations[] = {
    {Accumulation::kNoSync, "no_sync"},
    {Accumulation::kReduceScatter, "reduce_scatter"},
    {Accumulation::kReduce, "reduce"},
};

constexpr base::Named<LoadKind> kLoadKinds[] = {
    {LoadKind::kInit, "init"},
    {LoadKind::kImport, "import"},
    {LoadKind::kResume, "resume"},
};

int64_t sum(const std::vector<std::pair<std::string, int64_t>>& items) {
  int64_t t = 0;
  for (const auto& [name, bytes] : items) t = planning::add_bytes(t, bytes, "the sum of the items up to " + name);
  return t;
}
}  // namespace

const char* accumulation_name(Accumulation a) { return base::name_of(kAccumulations, a, "unknown"); }

Accumulation parse_accumulation(const std::string& name) {
  if (auto a = base::value_of(kAccumulations, name)) return *a;
  throw ConfigError("fsdp: unknown accumulation '" + name + "' (expected " + base::names_text(kAccumulations) + ")");
}

const char* load_kind_name(LoadKind k) { return base::name_of(kLoadKinds, k, "unknown"); }

LoadKind parse_load_kind(const std::string& name) {
  if (auto k = base::value_of(kLoadKinds, name)) return *k;
  throw ConfigError("fsdp: unknown load '" + name + "' (expected " + base::names_text(kLoadKinds) + ")");
}

bool save_in_step_pays(OffloadTier params, OffloadTier optimizer_state, bool async_save) {
  return !async_save && (params == OffloadTier::kDisk || optimizer_state == OffloadTier::kDisk);
}

int64_t Plan::peak() const { return std::max({device.total(), load.total(), save.total()}); }

const char* Plan::peak_phase() const {
  const int64_t step = device.total();
  if (step >= load.total() && step >= save.total()) return "step";
  return load.total() >= save.total() ? "load" : "save";
}

int64_t PlanTier::total() const {
  return planning::add_bytes(sum(items), std::max(sum(at_backward_start), sum(at_backward_end)), "a tier's total");
}

void PlanTier::add(std::string name, int64_t bytes, Moment when) {
  // The figures are products of non-negative sizes: a negative one wrapped around.
  if (bytes < 0) planning::add_bytes(0, bytes, name);
  if (bytes == 0) return;
  (when == kBackwardStart ? at_backward_start
   : when == kBackwardEnd ? at_backward_end
                          : items)
      .emplace_back(std::move(name), bytes);
}

namespace {

void count_params(torch::nn::Module& m, UnitShape& u, std::set<const void*>& seen, const FrozenStorageFn& storage) {
  for (const auto& item : m.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: counted once, where first met
    (p.requires_grad() ? u.trainable_numel : u.frozen_numel) += p.numel();
    if (!p.requires_grad())
      u.frozen_by_storage[storage ? storage(item.key(), p) : FrozenStorage::kParamDtype] += p.numel();
    u.largest_param_numel = std::max(u.largest_param_numel, p.numel());
  }
}

}  // namespace

ModelShape model_shape(torch::nn::Module& model,
                       const std::function<bool(const std::string&, torch::nn::Module&)>& is_unit,
                       const FrozenStorageFn& frozen_storage) {
  ModelShape shape;
  shape.name = model.name();
  std::set<const void*> seen;
  std::vector<UnitShape> layers;
  std::vector<std::string> prefixes;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const std::string& name = item.key();
    const bool nested = std::any_of(prefixes.begin(), prefixes.end(),
                                    [&](const std::string& p) { return name.rfind(p + ".", 0) == 0; });
    if (nested || !is_unit(name, *item.value())) continue;
    prefixes.push_back(name);
    UnitShape u;
    u.name = name;
    count_params(*item.value(), u, seen, frozen_storage);
    layers.push_back(std::move(u));
  }
  UnitShape root;
  root.name = "root";
  root.is_root = true;
  root.checkpointable = false;
  count_params(model, root, seen, frozen_storage);  // what no unit took
  shape.units.push_back(std::move(root));
  for (auto& u : layers) shape.units.push_back(std::move(u));
  return shape;
}

namespace {

void check_request(const ModelShape& shape, const PlanRequest& r) {
  auto bad = [](const std::string& what) { throw ConfigError("fsdp::plan: " + what); };
  for (const auto& u : shape.units) {
    if (u.trainable_numel < 0 || u.frozen_numel < 0) bad("unit " + u.name + " has a negative parameter count");
  }
  if (shape.units.empty() || shape.numel() == 0) bad("the model shape has no parameters");
  // Far beyond any model or batch, and what keeps the byte counts inside 64 bits.
  if (shape.numel() > int64_t{1} << 50)
    bad("the model shape has " + std::to_string(shape.numel()) + " parameters, more than 2^50");
  if (r.seq_len > 0 && r.batch_per_rank > (int64_t{1} << 36) / r.seq_len) {
    bad("seq_len x batch_per_rank (" + std::to_string(r.seq_len) + " x " + std::to_string(r.batch_per_rank) +
        ") is more than 2^36 tokens per rank per step");
  }
  if (!(r.margin >= 0 && r.margin <= 0.9)) bad("margin must be in [0, 0.9], got " + std::to_string(r.margin));
  if (r.ranks_per_node < 1 || r.nodes < 1) {
    bad("ranks_per_node and nodes must be >= 1, got " + std::to_string(r.ranks_per_node) + " and " +
        std::to_string(r.nodes));
  }
  if (r.budget.device_bytes < 0 || r.budget.host_bytes < 0 || r.budget.disk_bytes < 0) bad("a budget is negative");
  if (r.batch_per_rank < 1) bad("batch_per_rank must be >= 1, got " + std::to_string(r.batch_per_rank));
  if (r.seq_len < 0 || r.prefetch_depth < 0 || r.optimizer_state_tensors < 0) {
    bad("seq_len, prefetch_depth and optimizer_state_tensors must be >= 0");
  }
  {  // The runtime's rule: the refusal fully_shard would give a block (FULL_SHARD when the search picks)
    const ShardingStrategy s = r.strategy.value_or(ShardingStrategy::kFullShard);
    ResolvedOptions unused;
    resolve_reshard_after_forward(
        FullyShardOptions().strategy(s).reshard_after_forward_group(r.reshard_after_forward_group),
        planning::shard_size_of(s, r), unused, "fsdp::plan");
  }
  if (r.optimizer_state_dtype != at::kFloat && r.optimizer_state_dtype != at::kBFloat16) {
    bad(std::string("optimizer_state_dtype must be Float or BFloat16, got ") + c10::toString(r.optimizer_state_dtype));
  }
  if (r.optimizer_state_dtype != at::kFloat && r.offload && r.offload->optimizer_state() == OffloadTier::kDisk) {
    bad("optimizer state in " + std::string(c10::toString(r.optimizer_state_dtype)) +
        " cannot go to the disk tier (it streams fp32 state): keep it in RAM or the host tier, or in Float");
  }
  if (r.micro_batch && (*r.micro_batch < 1 || *r.micro_batch > r.batch_per_rank)) {
    bad("micro_batch must be in [1, batch_per_rank], got " + std::to_string(*r.micro_batch));
  }
  if (r.checkpoint_every && *r.checkpoint_every < 0) bad("checkpoint_every must be >= 0");
  // The runtime's rule (Note [Placement rules]): the same refusal fully_shard would give.
  if (r.offload)
    offload::check_allowed_on_device(*r.offload, "root", r.device == c10::kCPU, c10::DeviceTypeName(r.device));
}

using Tiers = std::array<OffloadTier, 3>;  // params, grads, optimizer state

std::vector<Tiers> offload_choices(const PlanRequest& r) {
  if (r.offload) return {{r.offload->params(), r.offload->grads(), r.offload->optimizer_state()}};
  constexpr auto N = OffloadTier::kNone, H = OffloadTier::kHost, D = OffloadTier::kDisk;
  std::vector<Tiers> all;
  if (r.device == c10::kCPU) {
    all = {{N, N, N}, {N, N, D}, {D, N, D}, {D, D, D}};  // the host is the device
  } else {
    all = {{N, N, N}, {N, N, H}, {H, H, H}, {N, N, D}, {D, H, D}, {D, D, D}};
  }
  // The disk tier holds fp32 state only (AdamWOptions::state_dtype).
  if (r.optimizer_state_dtype != at::kFloat) {
    all.erase(std::remove_if(all.begin(), all.end(), [](const Tiers& t) { return t[2] == OffloadTier::kDisk; }),
              all.end());
  }
  return all;
}

std::vector<Choices> candidates(const PlanRequest& r) {
  std::vector<ShardingStrategy> strategies;
  if (r.strategy) {
    strategies = {*r.strategy};
  } else {
    const int k = r.reshard_after_forward_group;  // must divide the shard group
    if (r.nodes > 1 && (k <= 1 || r.ranks_per_node % k == 0)) strategies.push_back(ShardingStrategy::kHybridShard);
    strategies.push_back(ShardingStrategy::kFullShard);
  }
  std::vector<int64_t> ckpts =
      r.checkpoint_every ? std::vector<int64_t>{*r.checkpoint_every} : std::vector<int64_t>{0, 1};
  std::vector<int64_t> micros;
  if (r.micro_batch) {
    micros = {*r.micro_batch};
  } else {
    for (int64_t m = r.batch_per_rank; m >= 1; m = m == 1 ? 0 : (m + 1) / 2) micros.push_back(m);
  }
  // The offload tier costs the most time, then the strategy's traffic, then recomputation.
  std::vector<Choices> out;
  for (const auto& t : offload_choices(r)) {
    for (auto s : strategies) {
      for (int64_t ck : ckpts) {
        for (int64_t m : micros) {
          Choices c{s, t[0], t[1], t[2], r.offload ? r.offload->memory_budget_bytes() : 0, ck, m};
          // Keeping gathers saves all-gathers only across micro-batches: tried first when there are several.
          const bool several = (std::max<int64_t>(r.batch_per_rank, 1) + m - 1) / m > 1;
          const std::vector<bool> keeps = r.keep_gathered ? std::vector<bool>{*r.keep_gathered}
                                          : several       ? std::vector<bool>{true, false}
                                                          : std::vector<bool>{false};
          for (bool keep : keeps) {
            c.keep_gathered = keep;
            out.push_back(c);
          }
        }
      }
    }
  }
  return out;
}

std::string option(const PlanRequest& r, const std::string& name) { return r.option_name ? r.option_name(name) : name; }
std::string setting(const PlanRequest& r, const std::string& name, const std::string& value) {
  return option(r, name) + "=" + value;
}

std::string gib(int64_t b) { return base::mib(b, 1) + " (" + std::to_string(b) + " bytes)"; }

void describe(const ModelShape& shape, const PlanRequest& r, Plan& p) {
  const bool cpu = r.device == c10::kCPU;
  p.settings = {setting(r, "FullyShardOptions::strategy", strategy_name(p.strategy)),
                setting(r, "OffloadPolicy::params", offload_tier_name(p.params)),
                setting(r, "OffloadPolicy::grads", offload_tier_name(p.grads)),
                setting(r, "OffloadPolicy::optimizer_state", offload_tier_name(p.optimizer_state)),
                setting(r, "PlanRequest::checkpoint_every", std::to_string(p.checkpoint_every)),
                setting(r, "PlanRequest::micro_batch", std::to_string(p.micro_batch)),
                setting(r, "grad_accum_steps", std::to_string(p.grad_accum_steps))};
  if (r.accumulation != Accumulation::kNoSync) {
    p.settings.push_back(setting(r, "PlanRequest::accumulation", accumulation_name(r.accumulation)));
  }
  if (p.keep_gathered) p.settings.push_back(setting(r, "PlanRequest::keep_gathered", "true"));
  if (r.reshard_after_forward_group > 0) {
    p.settings.push_back(
        setting(r, "PlanRequest::reshard_after_forward_group", std::to_string(r.reshard_after_forward_group)));
  }
  if (r.replicate_adapters) p.settings.push_back(setting(r, "PlanRequest::replicate_adapters", "true"));
  auto& a = p.assumptions;
  const std::string process = base::mib(planning::process_host_bytes(r));
  a.push_back("process: " + process + " of host memory" +
              (r.process_host_bytes ? " (given)"
               : cpu && r.measured_process_bytes
                   ? " (this process's resident size when it planned, " + base::mib(*r.measured_process_bytes) +
                         ", its libraries mapped as the page cache holds them, and " + base::mib(planning::kJoinBytes) +
                         " that joining the job adds)"
               : cpu ? " (fsdp-train --init-only on 2 ranks, measured here, the libraries started once)"
                     : " (assumed for LibTorch with CUDA and NCCL)"));
  if (!cpu) {
    a.push_back("CUDA: a prediction, not validated on a GPU here; the context and workspaces taken as " +
                base::mib(r.process_device_bytes.value_or(planning::default_process_device_bytes(r.device))));
  }
  const bool any_acts =
      std::any_of(shape.units.begin(), shape.units.end(), [](const UnitShape& u) { return bool(u.activations); });
  a.push_back(any_acts ? "activations: the model's own formula, seq_len " + std::to_string(r.seq_len)
                       : "activations: none given (UnitShape::activations unset): not counted");
  a.push_back("prefetch_depth " + std::to_string(r.prefetch_depth) +
              "; the root and the last layer keep their params from forward to backward");
  a.push_back("optimizer: " + std::to_string(r.optimizer_state_tensors) + " " +
              (r.optimizer_state_dtype == at::kFloat ? "fp32" : "bf16") + " state tensor(s) per trainable parameter");
  a.push_back("collectives: rings; each rank sends (N - 1) shards per gathered unit and per reduced gradient");
  a.push_back(std::string(cpu ? "the heap's slack: half the activations kept (Note [The heap's slack]); " : "") +
              "not counted: the allocator's other slack, the data pipeline beyond the process, the page cache");
}

std::string with_more_ranks(const ModelShape& shape, const PlanRequest& r) {
  PlanRequest more = r;
  more.strategy.reset();
  for (int nodes = r.nodes * 2; nodes <= r.nodes * 64; nodes *= 2) {
    more.nodes = nodes;
    for (const auto& c : candidates(more)) {
      if (planning::cost(shape, more, c).fits) {
        return std::to_string(nodes) + " nodes of " + std::to_string(r.ranks_per_node) + " rank(s) (" +
               std::to_string(nodes * r.ranks_per_node) + " ranks) would fit";
      }
    }
  }
  return "";
}

// A narrower dtype that would make the plan fit: the optimizer's state in bf16, then gradients
// reduced in the compute dtype. Empty when neither would.
std::string narrower_dtype_lever(const ModelShape& shape, const PlanRequest& r) {
  if (r.optimizer_state_dtype == at::kFloat && r.optimizer_state_tensors > 0 &&
      !(r.offload && r.offload->optimizer_state() == OffloadTier::kDisk)) {
    PlanRequest half = r;
    half.optimizer_state_dtype = at::kBFloat16;
    if (plan(shape, half).fits) {
      return "Lever: the optimizer's state in bf16 (" + setting(r, "PlanRequest::optimizer_state_dtype", "bfloat16") +
             ", AdamWOptions::state_dtype: within a tolerance of fp32 state, not bit for bit) would fit.";
    }
  }
  if (r.reduce_dtype != r.param_dtype && r.reduce_dtype == at::kFloat) {
    PlanRequest narrow = r;
    narrow.reduce_dtype = r.param_dtype;
    if (plan(shape, narrow).fits) {
      return "Lever: reducing gradients in the compute dtype (" +
             setting(r, "MixedPrecisionPolicy::reduce_dtype", c10::toString(r.param_dtype)) + ") would fit.";
    }
  }
  return "";
}

std::string shortfall(const ModelShape& shape, const PlanRequest& r, const Plan& p) {
  const bool cpu = r.device == c10::kCPU;
  std::ostringstream s;
  auto check = [&](const char* what, const PlanTier& t, int64_t budget, const char* key) {
    if (t.total() <= budget) return;
    auto all = t.items;
    all.insert(all.end(), t.at_backward_start.begin(), t.at_backward_start.end());
    all.insert(all.end(), t.at_backward_end.begin(), t.at_backward_end.end());
    const auto big =
        std::max_element(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    s << what << ": needs " << gib(t.total()) << " per rank, the budget (" << key << ") is " << gib(budget)
      << ": short by " << gib(t.total() - budget) << "; its largest item is " << big->first << ", "
      << base::mib(big->second, 1) << ". ";
  };
  const std::string phase = p.peak_phase();
  const PlanTier& peak = phase == "load" ? p.load : phase == "save" ? p.save : p.device;
  const std::string what =
      std::string(cpu ? "RAM" : "device memory") + (phase == "step" ? "" : " (in the " + phase + ")");
  check(what.c_str(), peak, (cpu ? r.budget.host_bytes : r.budget.device_bytes) - p.margin_bytes,
        p.margin_bytes > 0 ? (cpu ? "host less the margin" : "device less the margin") : (cpu ? "host" : "device"));
  if (!cpu) check("host memory", p.host, r.budget.host_bytes, "host");
  check("disk", p.disk, r.budget.disk_bytes, "disk");
  const bool fixed = r.offload || r.checkpoint_every || r.micro_batch || r.strategy || r.keep_gathered;
  if (fixed) {
    PlanRequest free = r;
    free.offload.reset();
    free.checkpoint_every.reset();
    free.micro_batch.reset();
    free.strategy.reset();
    free.keep_gathered.reset();
    const Plan q = plan(shape, free);
    if (q.fits) {
      s << "Lever: these settings fit:";
      for (const auto& k : q.settings) s << " " << k;
      return s.str();
    }
  }
  const std::string narrower = narrower_dtype_lever(shape, r);
  if (!narrower.empty()) return s.str() + narrower;
  const auto root = std::find_if(shape.units.begin(), shape.units.end(), [](const UnitShape& u) { return u.is_root; });
  if (root != shape.units.end() && shape.units.size() > 1 &&
      root->numel() > 2 * (shape.numel() / static_cast<int64_t>(shape.units.size()))) {
    s << "The root's own parameters (" << root->numel()
      << ", the embedding and the head) are gathered, and their "
         "gradient reduced, as one unit: giving each its own unit (fully_shard on each) would shrink the largest "
         "items. ";
  }
  const std::string more = with_more_ranks(shape, r);
  if (!more.empty())
    return s.str() +
           "Lever: every offload tier, activation checkpointing and a micro-batch of 1 "
           "do not fit on these ranks; " +
           more + ".";
  return s.str() + "Lever: none within 64 times the nodes: a larger budget (more memory per rank, more disk).";
}

}  // namespace

Plan plan(const ModelShape& shape, const PlanRequest& request) {
  check_request(shape, request);
  const auto all = candidates(request);
  for (const auto& c : all) {
    Plan p = planning::cost(shape, request, c);
    if (!p.fits) continue;
    describe(shape, request, p);
    return p;
  }
  Plan p = planning::cost(shape, request, all.back());  // every lever pulled
  describe(shape, request, p);
  p.shortfall = shortfall(shape, request, p);
  return p;
}

std::string Plan::to_string() const {
  std::ostringstream s;
  s << (fits ? "fits" : "does NOT fit") << ": " << strategy_name(strategy) << " over " << shard_size
    << " rank(s); offload params " << offload_tier_name(params) << ", grads " << offload_tier_name(grads)
    << ", optimizer_state " << offload_tier_name(optimizer_state) << "; activation checkpointing "
    << (checkpoint_every == 0 ? std::string("off") : "every " + std::to_string(checkpoint_every)) << "; micro-batch "
    << micro_batch << " x " << grad_accum_steps << " accumulation step(s)\n";
  auto tier = [&](const char* name, const PlanTier& t) {
    if (t.items.empty()) return;
    s << name << " per rank: " << base::mib(t.total(), 1) << "\n";
    for (const auto& [item, bytes] : t.items) s << "  " << item << ": " << base::mib(bytes, 1) << "\n";
    const bool start_larger = sum(t.at_backward_start) >= sum(t.at_backward_end);
    auto moment = [&](const char* when, const std::vector<std::pair<std::string, int64_t>>& items, bool larger) {
      if (items.empty()) return;
      s << "  at " << when << " (" << (larger ? "the larger, counted" : "not counted") << "):\n";
      for (const auto& [item, bytes] : items) s << "    " << item << ": " << base::mib(bytes, 1) << "\n";
    };
    moment("the start of backward", t.at_backward_start, start_larger);
    moment("the end of backward", t.at_backward_end, !start_larger);
  };
  tier(host.items.empty() ? "memory (RAM)" : "device memory", device);
  if (margin_bytes > 0) {
    s << "margin held free: " << base::mib(margin_bytes, 1) << " of " << (host.items.empty() ? "RAM" : "device memory")
      << ", kept out of the budget when choosing\n";
  }
  auto phase = [&](const std::string& name, const PlanTier& t) {
    if (t.items.empty()) return;
    s << name << ": " << base::mib(t.total(), 1) << "\n";
    for (const auto& [item, bytes] : t.items) s << "  " << item << ": " << base::mib(bytes, 1) << "\n";
  };
  phase(std::string("the load (") + load_kind_name(load_kind) + ") per rank", load);
  phase("a save per rank", save);
  s << "peak per rank: " << base::mib(peak(), 1) << ", in the " << peak_phase() << "\n";
  phase("an export (fsdp-ckpt export: one process, not a rank)", exporting);
  phase("an adapter export (fsdp-ckpt export of the adapters alone: one process)", exporting_adapters);
  tier("host memory", host);
  tier("disk", disk);
  s << "per step per rank: all-gathers send " << base::mib(all_gather_bytes, 1) << " (" << gathers_per_step
    << (keep_gathered ? " unit gathers per step, kept across micro-batches" : " unit gathers per micro-batch") << ")"
    << (group_all_gather_bytes > 0 ? ", " + base::mib(group_all_gather_bytes, 1) + " of it inside post-forward groups"
                                   : "")
    << ", reductions send " << base::mib(reduce_bytes, 1) << "; disk tier " << io_per_step.to_string() << "\n";
  s << "settings:";
  for (const auto& k : settings) s << " " << k;
  s << "\nassumptions:\n";
  for (const auto& a : assumptions) s << "  - " << a << "\n";
  if (!fits) s << "short: " << shortfall << "\n";
  return s.str();
}

// Note [The process measured by the process]
// Most of a process without a model is its libraries' mapped pages, and how many of them it maps
// depends on the page cache, not on fsdp: libraries read whole (as an install or a copy leaves
// them) sit in large folios, which a fault maps whole. fsdp-train --init-only on 2 ranks measured
// 518 MiB per rank that way and 351 MiB with the libraries faulted in by a program started once
// (the constant default, 350 MiB). So a program that plans measures itself: its resident size when
// it first plans (process_resident_bytes), its libraries mapped, its configuration and data opened,
// before it joins the job; the process item is that and kJoinBytes, what joining adds (the
// communicator's shared-memory channels, its threads, the code they run: --init-only's peak less
// the resident size at the plan, 31-32 MiB per rank with the libraries read whole, 6-8 MiB started
// once: counted as 16, within 16 MiB of either). What the first step maps later is the compute
// libraries' item. On CUDA the context's host side
// comes after the plan: the constant stays.
int64_t process_resident_bytes() {
  static const int64_t bytes = sysinfo::process_rss_bytes();
  return bytes;
}

namespace planning {

int64_t process_host_bytes(const PlanRequest& req) {
  if (req.process_host_bytes) return *req.process_host_bytes;
  if (req.device == c10::kCPU && req.measured_process_bytes) return *req.measured_process_bytes + kJoinBytes;
  return default_process_host_bytes(req.device);
}

}  // namespace planning

}  // namespace fsdp
