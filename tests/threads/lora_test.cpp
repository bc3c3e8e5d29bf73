// LoRA (fsdp/lora.h) and frozen storage (FullyShardOptions::frozen_storage): adapters on stock
// torch::nn::Linear layers of a model whose code knows nothing of them, their forward and
// gradients against PEFT's formula, merge_lora, the bad inputs; sharded on 2 ranks with the base
// kept in fp32, bf16, int8 and NF4, each against an unsharded model holding the same decoded
// weights; bf16 storage against today's fp32 masters bit for bit; adapter-only checkpoints.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <map>
#include <mutex>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "frozen/frozen_storage.h"
#include "shard/checkpoint_view.h"
#include "shard/testing.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

constexpr int64_t kDim = 32;

// A user's block: stock modules, called directly (no knowledge of adapters).
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl()
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        q(register_module("q", torch::nn::Linear(kDim, kDim))),
        up(register_module("up", torch::nn::Linear(torch::nn::LinearOptions(kDim, 2 * kDim).bias(false)))),
        down(register_module("down", torch::nn::Linear(2 * kDim, kDim))) {}
  at::Tensor forward(const at::Tensor& x) { return x + down(at::gelu(up(q(norm(x))))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear q, up, down;
};
TORCH_MODULE(Block);

class NetImpl : public torch::nn::Module {
 public:
  NetImpl()
      : inp(register_module("inp", torch::nn::Linear(8, kDim))),
        b0(register_module("b0", Block())),
        b1(register_module("b1", Block())),
        head(register_module("head", torch::nn::Linear(kDim, 4))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = inp(x);
    first_block_input_requires_grad = h.requires_grad();
    for (Block b : {b0, b1}) {
      h = checkpoint ? fsdp::checkpoint_activations([b](const at::Tensor& t) mutable { return fsdp::call(b, t); }, h)
                     : fsdp::call(b, h);
    }
    return head(h);
  }
  torch::nn::Linear inp;
  Block b0, b1;
  torch::nn::Linear head;
  bool checkpoint = false;  // each block under activation checkpointing
  bool first_block_input_requires_grad = false;
};
TORCH_MODULE(Net);

std::mutex g_seed_mutex;

Net make_net() {
  std::lock_guard<std::mutex> lock(g_seed_mutex);
  at::manual_seed(3);
  return Net();
}

LoraOptions lora_options(FrozenStorage base) {
  return LoraOptions().targets({"q", "up", "down"}).r(4).alpha(8).base_dtype(base);
}

std::pair<at::Tensor, at::Tensor> batch(int step, int rank, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  auto x = at::randn({8, 3, 8}, gen), y = at::randn({8, 3, 4}, gen);
  const int64_t n = 8 / world;
  return {x.narrow(0, rank * n, n), y.narrow(0, rank * n, n)};
}

TEST(Lora, AdaptsStockLinearsAsPeftDoes) {
  Net net = make_net();
  const LoraModel lm = lora(*net, lora_options(FrozenStorage::kParamDtype), 7);
  ASSERT_EQ(lm.targets.size(), 6u);
  EXPECT_EQ(lm.targets[0].name, "b0.q");
  EXPECT_DOUBLE_EQ(lm.scaling(), 2.0);
  std::vector<std::string> trainable;
  for (const auto& p : net->named_parameters()) {
    if (p.value().requires_grad()) trainable.push_back(p.key());
  }
  EXPECT_EQ(trainable, lm.adapter_names());
  EXPECT_EQ(trainable.front(), "b0.q.lora_A.weight");
  // PEFT's init: A within +-1/sqrt(in), B zero; so the adapted model starts as the base.
  const at::Tensor a = net->b0->q->named_children()["lora_A"]->named_parameters()["weight"];
  EXPECT_LE(a.abs().max().item<double>(), 1.0 / std::sqrt(double(kDim)));
  EXPECT_GT(a.abs().max().item<double>(), 0.0);
  // Give B values, then compare with the formula on the plain weights (3-D input: t() + matmul;
  // 2-D with bias: addmm; no bias: matmul).
  for (auto& t : lm.targets) {
    auto b = net->named_parameters()[t.name + ".lora_B.weight"];
    at::NoGradGuard g;
    b.copy_(at::randn(b.sizes()) * 0.1);
  }
  for (const auto& x : {at::randn({2, 3, kDim}), at::randn({5, kDim})}) {
    auto& q = net->b0->q;
    const auto A = q->named_children()["lora_A"]->named_parameters()["weight"];
    const auto B = q->named_children()["lora_B"]->named_parameters()["weight"];
    const auto W = q->named_parameters(false)["weight"];
    const at::Tensor want = at::linear(x, W, q->bias) + at::linear(at::linear(x, A), B) * 2.0;
    const at::Tensor got = q(x);
    EXPECT_TRUE(at::allclose(got, want, 1e-6, 1e-6));
    got.sum().backward();
    EXPECT_TRUE(A.grad().defined() && B.grad().defined());
    EXPECT_FALSE(W.grad().defined());
    EXPECT_FALSE(q->bias.grad().defined());
  }
  // Dropout on the adapters' input in training mode only.
  Net d = make_net();
  lora(*d, lora_options(FrozenStorage::kParamDtype).dropout(0.5), 7);
  for (auto& p : d->named_parameters()) {
    if (p.key().find("lora_B") != std::string::npos) at::NoGradGuard(), p.value().detach().fill_(0.1);
  }
  const at::Tensor x = at::randn({4, kDim});
  d->eval();
  EXPECT_TRUE(at::equal(d->b0->q(x), d->b0->q(x)));
  d->train();
  EXPECT_FALSE(at::equal(d->b0->q(x), d->b0->q(x)));
}

TEST(Lora, MergeFoldsTheAdaptersIntoTheBase) {
  Net net = make_net();
  lora(*net, lora_options(FrozenStorage::kParamDtype), 7);
  for (auto& p : net->named_parameters()) {
    at::NoGradGuard g;
    if (p.key().find("lora_B") != std::string::npos) p.value().copy_(at::randn(p.value().sizes()) * 0.1);
  }
  const at::Tensor x = at::randn({2, 8});
  at::Tensor before;
  {
    at::NoGradGuard g;
    before = net->forward(x);
  }
  EXPECT_TRUE(has_lora(*net));
  merge_lora(*net);
  EXPECT_FALSE(has_lora(*net));
  for (const auto& p : net->named_parameters()) EXPECT_EQ(p.key().find("lora_"), std::string::npos) << p.key();
  at::NoGradGuard g;
  EXPECT_TRUE(at::allclose(net->forward(x), before, 1e-5, 1e-5));
}

std::string config_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Lora, BadInputsAreClearErrors) {
  EXPECT_NE(config_error([] {
              Net n = make_net();
              lora(*n, LoraOptions().targets({"q", "k_proj"}));
            }).find("pattern 'k_proj' matches no module"),
            std::string::npos);
  EXPECT_NE(config_error([] {
              Net n = make_net();
              lora(*n, LoraOptions().targets({"norm"}));
            }).find("which is not a Linear"),
            std::string::npos);
  EXPECT_NE(config_error([] {
              Net n = make_net();
              lora(*n, LoraOptions().targets({"q"}));
              lora(*n, LoraOptions().targets({"q"}));
            }).find("already has adapters"),
            std::string::npos);
  EXPECT_NE(config_error([] {
              Net n = make_net();
              lora(*n, LoraOptions().targets({"q"}).r(0));
            }).find("r is 0"),
            std::string::npos);
  // A regular expression matches whole names.
  Net n = make_net();
  EXPECT_EQ(lora(*n, LoraOptions().targets({"b1\\.(q|up)"})).targets.size(), 2u);
  // Quantizing a trainable parameter.
  testing::run_threads(1, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Net net = make_net();
    const std::string e = config_error([&] {
      fully_shard(net, mesh, FullyShardOptions().frozen_storage([](const std::string&, const at::Tensor&) {
        return FrozenStorage::kNF4;
      }));
    });
    EXPECT_NE(e.find("is trainable (requires_grad) but frozen_storage gives it nf4"), std::string::npos) << e;
  });
}

// The unsharded reference of a sharded LoRA model: the same net, its base weights replaced by what
// the stored form decodes to (each target's weight quantized alone; other frozen params rounded to
// a floating base dtype, or left as they are).
void round_like_storage(Net& ref, const LoraModel& lm, FrozenStorage s) {
  at::NoGradGuard g;
  for (auto& p : ref->named_parameters()) {
    if (p.value().requires_grad()) continue;
    bool target = false;
    for (const auto& t : lm.targets) target = target || p.key() == t.name + ".weight";
    at::Tensor v = p.value();
    if (frozen::quantized(s) && target) {
      at::Tensor flat = v.reshape({-1}).clone();
      frozen::decode(s, frozen::encode(s, flat), flat);
      v.copy_(flat.view(v.sizes()));
    } else if (!frozen::quantized(s) && s != FrozenStorage::kParamDtype) {
      v.copy_(v.to(frozen::stored_dtype(s)));
    }
  }
}

void expect_sharded_matches_reference(FrozenStorage storage, OffloadTier params = OffloadTier::kNone) {
  testing::run_threads(2, [storage, params](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Net ref = make_net();
    const LoraModel ref_lm = lora(*ref, lora_options(storage), 7);
    round_like_storage(ref, ref_lm, storage);
    Net net = make_net();
    const LoraModel lm = lora(*net, lora_options(storage), 7);
    const auto opts = FullyShardOptions().frozen_storage(lm.frozen_storage());
    fully_shard(net->b0, mesh, opts);
    fully_shard(net->b1, mesh, opts);
    auto root_opts = opts;
    if (params != OffloadTier::kNone) root_opts.offload(OffloadPolicy().params(params));
    auto root = fully_shard(net, mesh, root_opts);
    SGD optim(root, SGDOptions(0.5));
    std::vector<at::Tensor> ref_params;
    for (auto& p : ref->parameters()) {
      if (p.requires_grad()) ref_params.push_back(p);
    }
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = batch(step, dist->rank(), 2);
      auto [gx, gy] = batch(step, 0, 1);
      auto loss = at::mse_loss(fsdp::call(net, x), y);
      loss.backward();
      optim.step();
      optim.zero_grad();
      auto l = loss.detach().to(at::kDouble).reshape({1});
      dist->world().all_reduce(l, ReduceOp::kAvg, "loss").wait();
      auto ref_loss = at::mse_loss(ref->forward(gx), gy);
      ref_loss.backward();
      at::NoGradGuard g;
      for (auto& p : ref_params) {
        p.sub_(p.grad() * 0.5);
        p.mutable_grad() = at::Tensor();
      }
      EXPECT_NEAR(l.item<double>(), ref_loss.item<double>(), 2e-6) << frozen_storage_name(storage) << " step " << step;
    }
    // The frozen base has no fp32 master: its stored bytes per parameter.
    const MemoryReport m = memory_report(*root);
    int64_t adapters = 0, frozen = 0;
    for (const auto& p : ref->parameters()) (p.requires_grad() ? adapters : frozen) += p.numel();
    const double per_rank_frozen = double(m.sharded_params - adapters * 4 / 2) / double(frozen / 2);
    if (storage == FrozenStorage::kBFloat16) EXPECT_NEAR(per_rank_frozen, 2.0, 0.1);
    if (storage == FrozenStorage::kNF4 && params == OffloadTier::kNone) {
      EXPECT_LT(per_rank_frozen, 1.6);  // norms and biases in fp32
    }
    if (params == OffloadTier::kHost) EXPECT_GT(m.tier_host, 0);
  });
}

TEST(LoraSharded, Float32BaseMatchesTheUnshardedModel) { expect_sharded_matches_reference(FrozenStorage::kParamDtype); }
TEST(LoraSharded, BFloat16BaseMatchesTheUnshardedModel) { expect_sharded_matches_reference(FrozenStorage::kBFloat16); }
TEST(LoraSharded, Int8BaseMatchesTheUnshardedModel) { expect_sharded_matches_reference(FrozenStorage::kInt8); }
TEST(LoraSharded, NF4BaseMatchesTheUnshardedModel) { expect_sharded_matches_reference(FrozenStorage::kNF4); }
// Params offloaded: the NF4 shards move to the host tier and are gathered from there.
TEST(LoraSharded, NF4BaseInTheHostTierMatchesTheUnshardedModel) {
  expect_sharded_matches_reference(FrozenStorage::kNF4, OffloadTier::kHost);
}

// At bf16 compute, a frozen base stored in bf16 (no master) gives today's fp32-master frozen
// params' logits bit for bit, before and after a step on the adapters.
TEST(LoraSharded, BFloat16StorageEqualsFp32MastersAtBf16Compute) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    std::vector<at::Tensor> logits;
    for (FrozenStorage s : {FrozenStorage::kFloat32, FrozenStorage::kParamDtype}) {
      Net net = make_net();
      lora(*net, lora_options(FrozenStorage::kParamDtype), 7);
      for (auto& p : net->named_parameters()) {
        at::NoGradGuard g;
        if (p.key().find("lora_B") != std::string::npos) p.value().fill_(0.05);
      }
      const auto opts = FullyShardOptions()
                            .mp_policy(MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat))
                            .frozen_storage([s](const std::string&, const at::Tensor&) { return s; });
      fully_shard(net->b0, mesh, opts);
      fully_shard(net->b1, mesh, opts);
      auto root = fully_shard(net, mesh, opts);
      SGD optim(root, SGDOptions(0.5));
      for (int step = 0; step < 2; ++step) {  // the second forward sees the adapters' gradients
        auto [x, y] = batch(step, dist->rank(), 2);
        at::Tensor out = fsdp::call(net, x);
        at::mse_loss(out.to(at::kFloat), y).backward();
        optim.step();
        optim.zero_grad();
        logits.push_back(out.detach());
      }
    }
    EXPECT_TRUE(at::equal(logits[0], logits[2]));
    EXPECT_TRUE(at::equal(logits[1], logits[3]));
  });
}

// Activation checkpointing on a LoRA model: the first block's input comes from a frozen layer and
// has no grad, yet the checkpointed blocks' adapters train exactly as without checkpointing.
TEST(LoraSharded, CheckpointedBlocksWhoseInputHasNoGradTrainTheirAdapters) {
  testing::run_threads(2, [](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    std::vector<at::Tensor> outputs;
    std::vector<std::vector<double>> losses(2);
    const auto [x_eval, y_eval] = batch(9, dist->rank(), 2);
    at::Tensor untrained;
    for (int ckpt = 0; ckpt < 2; ++ckpt) {
      Net net = make_net();
      net->checkpoint = ckpt == 1;
      const LoraModel lm = lora(*net, lora_options(FrozenStorage::kParamDtype), 7);
      const auto opts = FullyShardOptions().frozen_storage(lm.frozen_storage());
      fully_shard(net->b0, mesh, opts);
      fully_shard(net->b1, mesh, opts);
      auto root = fully_shard(net, mesh, opts);
      SGD optim(root, SGDOptions(0.5));
      if (ckpt == 0) {
        at::NoGradGuard no_grad;
        untrained = fsdp::call(net, x_eval).clone();
      }
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = batch(step, dist->rank(), 2);
        auto loss = at::mse_loss(fsdp::call(net, x), y);
        ASSERT_FALSE(net->first_block_input_requires_grad);  // a frozen layer's output
        losses[ckpt].push_back(loss.item<double>());
        loss.backward();
        optim.step();
        optim.zero_grad();
      }
      at::NoGradGuard no_grad;
      outputs.push_back(fsdp::call(net, x_eval).clone());
    }
    EXPECT_EQ(losses[0], losses[1]);
    EXPECT_TRUE(at::equal(outputs[0], outputs[1])) << (outputs[0] - outputs[1]).abs().max().item<double>();
    EXPECT_FALSE(at::equal(outputs[1], untrained));  // the adapters did train
  });
}

// A sharded NF4-base LoRA model, trained `steps` SGD steps on 2 ranks.
struct Trained {
  Net net{nullptr};
  std::shared_ptr<FSDPModule> root;
  std::unique_ptr<SGD> optim;
};
Trained trained_nf4(DeviceMesh& mesh, int rank, int steps, uint64_t base_seed) {
  Trained t;
  {
    std::lock_guard<std::mutex> lock(g_seed_mutex);
    at::manual_seed(base_seed);
    t.net = Net();
  }
  const LoraModel lm = lora(*t.net, lora_options(FrozenStorage::kNF4), 7);
  const auto opts = FullyShardOptions().frozen_storage(lm.frozen_storage());
  fully_shard(t.net->b0, mesh, opts);
  fully_shard(t.net->b1, mesh, opts);
  t.root = fully_shard(t.net, mesh, opts);
  t.optim = std::make_unique<SGD>(t.root, SGDOptions(0.5));
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = batch(step, rank, 2);
    at::mse_loss(fsdp::call(t.net, x), y).backward();
    t.optim->step();
    t.optim->zero_grad();
  }
  return t;
}

// Adapter-only checkpoints (SaveOptions::frozen_params off) hold the adapters and their state and
// load over a base imported again; full ones hold the NF4 base too (saved dequantized, stored again
// on load: the same codes), whatever base the loading model started from.
TEST(LoraSharded, CheckpointsTheAdaptersAloneOrEverything) {
  const std::string root_dir = testing::temp_path("lora-ckpt");
  io::make_dirs(root_dir);
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    Trained a = trained_nf4(mesh, dist->rank(), 2, 3);
    const auto [x, y] = batch(9, dist->rank(), 2);
    const at::Tensor want = fsdp::call(a.net, x).detach();
    checkpoint::save(root_dir, "adapters", *a.root, a.optim.get(), {}, checkpoint::SaveOptions().frozen_params(false));
    checkpoint::save(root_dir, "all", *a.root, a.optim.get(), {});
    Trained b = trained_nf4(mesh, dist->rank(), 0, 3);  // the same base, fresh adapters
    checkpoint::load(io::join(root_dir, "adapters"), *b.root, b.optim.get());
    EXPECT_TRUE(at::equal(fsdp::call(b.net, x).detach(), want));
    Trained c = trained_nf4(mesh, dist->rank(), 0, 11);  // another base
    EXPECT_FALSE(at::equal(fsdp::call(c.net, x).detach(), want));
    checkpoint::load(io::join(root_dir, "all"), *c.root, c.optim.get());
    const at::Tensor got = fsdp::call(c.net, x).detach();
    EXPECT_TRUE(at::equal(got, want)) << (got - want).abs().max().item<double>();
    checkpoint::load(io::join(root_dir, "all"), *b.root, b.optim.get());
    const at::Tensor got_b = fsdp::call(b.net, x).detach();
    EXPECT_TRUE(at::equal(got_b, want)) << "b " << (got_b - want).abs().max().item<double>();
    if (dist->rank() == 0) {
      const std::string index = io::read_small_file(io::join(root_dir, "adapters/model.safetensors.index.json"));
      EXPECT_EQ(index.find("b0.q.weight"), std::string::npos);
      EXPECT_NE(index.find("b0.q.lora_A.weight"), std::string::npos);
    }
  });
  // Onto unsharded models: the adapters-only checkpoint restores the adapters of a LoRA model and
  // leaves its base as it was; the full one gives the same adapters; a model without adapters is
  // told what the checkpoint holds and what to do.
  auto lora_model = [](uint64_t seed) {
    std::lock_guard<std::mutex> lock(g_seed_mutex);
    at::manual_seed(seed);
    Net n;
    lora(*n, lora_options(FrozenStorage::kNF4), 99);
    return n;
  };
  auto state = [](Net& n) {
    std::map<std::string, at::Tensor> m;
    for (const auto& p : n->named_parameters()) m[p.key()] = p.value().detach().clone();
    return m;
  };
  Net from_adapters = lora_model(3), from_all = lora_model(3);
  const auto before = state(from_adapters);
  checkpoint::load_unsharded(io::join(root_dir, "adapters"), *from_adapters);
  checkpoint::load_unsharded(io::join(root_dir, "all"), *from_all);
  const auto got = state(from_adapters), full = state(from_all);
  int adapters = 0;
  for (const auto& [name, t] : got) {
    if (is_lora_adapter(name)) {
      ++adapters;
      EXPECT_FALSE(at::equal(t, before.at(name))) << name << ": not restored";
      EXPECT_TRUE(at::equal(t, full.at(name))) << name;
    } else {
      EXPECT_TRUE(at::equal(t, before.at(name))) << name << ": the base changed";
    }
  }
  EXPECT_GT(adapters, 0);
  Net plain;
  try {
    checkpoint::load_unsharded(io::join(root_dir, "adapters"), *plain);
    ADD_FAILURE() << "an adapters-only checkpoint loaded onto a model without adapters";
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("adapters only"), std::string::npos) << what;
    EXPECT_NE(what.find("fsdp::lora("), std::string::npos) << what;
  }
  io::remove_tree(root_dir);
}

// FullyShardOptions::replicate_params: the adapters kept whole on every rank and all-reduced (on a
// communicator of their own), the base sharded. Against sharded adapters: the same losses and
// parameters within fp32 rounding (the reductions sum in another order), no all-gather of an
// adapter, and checkpoints that load either way.
struct Adapted {
  Net net{nullptr};
  std::shared_ptr<FSDPModule> root;
  std::unique_ptr<AdamW> optim;
};

Adapted adapted(DeviceMesh& mesh, bool replicate, ShardingStrategy strategy) {
  Adapted t;
  {
    std::lock_guard<std::mutex> lock(g_seed_mutex);
    at::manual_seed(3);
    t.net = Net();
  }
  const LoraModel lm = lora(*t.net, lora_options(FrozenStorage::kNF4), 7);
  auto opts = FullyShardOptions().strategy(strategy).frozen_storage(lm.frozen_storage());
  if (replicate) opts.replicate_params([](const std::string& n, const at::Tensor&) { return is_lora_adapter(n); });
  fully_shard(t.net->b0, mesh, opts);
  fully_shard(t.net->b1, mesh, opts);
  t.root = fully_shard(t.net, mesh, opts);
  t.optim = std::make_unique<AdamW>(t.root, AdamWOptions(1e-2));
  return t;
}

struct AdaptedRun {
  std::vector<double> losses;
  at::Tensor out;            // on a fixed batch after training
  uint64_t gathered = 0;     // all-gather bytes sent over the mesh's groups
  uint64_t all_reduced = 0;  // over the replicated parameters' communicator
};

// The counters of the mesh's groups (the world's is shared by every mesh of the job).
std::pair<uint64_t, uint64_t> traffic(DeviceMesh& mesh) {
  uint64_t gathered = 0, all_reduced = 0;
  for (Communicator* c : {&mesh.shard_group(), &mesh.replicate_group()}) {
    gathered += c->stats().of(CollectiveKind::kAllGather).bytes_sent;
  }
  for (Communicator* c : mesh.groups_made_on_use()) all_reduced += c->stats().of(CollectiveKind::kAllReduce).bytes_sent;
  return {gathered, all_reduced};
}

AdaptedRun train_adapted(DeviceMesh& mesh, Adapted& t, int rank, int world) {
  AdaptedRun r;
  const auto before = traffic(mesh);
  for (int step = 0; step < 4; ++step) {
    auto [x, y] = batch(step, rank, world);
    const at::Tensor loss = at::mse_loss(fsdp::call(t.net, x), y);
    loss.backward();
    clip_grad_norm(*t.root, 0.05);
    t.optim->step();
    t.optim->zero_grad();
    r.losses.push_back(loss.item<double>());
  }
  const auto after = traffic(mesh);
  r.gathered = after.first - before.first;
  r.all_reduced = after.second - before.second;
  r.out = fsdp::call(t.net, batch(9, rank, world).first).detach();
  return r;
}

void expect_close(const AdaptedRun& a, const AdaptedRun& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_NEAR(a.losses[i], b.losses[i], 1e-6 * std::abs(b.losses[i]));
  EXPECT_TRUE(at::allclose(a.out, b.out, 1e-5, 1e-6)) << (a.out - b.out).abs().max().item<double>();
}

TEST(LoraSharded, ReplicatedAdaptersTrainAsShardedOnesWithoutGatheringThem) {
  const std::string root_dir = testing::temp_path("lora-replicated");
  io::make_dirs(root_dir);
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    const int rank = dist->rank();
    DeviceMesh sharded_mesh(dist), replicated_mesh(dist);
    Adapted s = adapted(sharded_mesh, false, ShardingStrategy::kFullShard);
    Adapted r = adapted(replicated_mesh, true, ShardingStrategy::kFullShard);
    int64_t adapter_numel = 0;
    for (FlatParam* fp : testing::flat_params(*r.root)) {
      if (!fp->config().replicated) continue;
      EXPECT_TRUE(fp->config().requires_grad);
      EXPECT_EQ(fp->shard_numel(), fp->numel()) << "whole on every rank";
      EXPECT_EQ(fp->shard_group().size(), 1);
      EXPECT_EQ(fp->replicate_group().size(), 2);
      for (const auto& e : fp->entries()) EXPECT_TRUE(is_lora_adapter(e.name)) << e.name;
      adapter_numel += fp->numel();
    }
    // r = 4 on q (32 -> 32), up (32 -> 64) and down (64 -> 32) of two blocks.
    EXPECT_EQ(adapter_numel, 2 * (4 * kDim + kDim * 4 + 4 * kDim + 2 * kDim * 4 + 4 * 2 * kDim + kDim * 4));
    // A checkpoint writes a replicated flat param from rank 0 alone, a sharded one from every rank.
    const std::vector<FlatParam*> flats = testing::flat_params(*r.root);
    const ModelView view = model_view(*r.root, /*frozen_values=*/false);
    ASSERT_EQ(view.flats.size(), flats.size());
    for (size_t i = 0; i < flats.size(); ++i) {
      EXPECT_EQ(view.flats[i].writer, !flats[i]->config().replicated || rank == 0) << flats[i]->config().tag;
    }
    const AdaptedRun a = train_adapted(sharded_mesh, s, rank, 2);
    const AdaptedRun b = train_adapted(replicated_mesh, r, rank, 2);
    expect_close(b, a);
    EXPECT_EQ(a.all_reduced, 0u);
    EXPECT_GT(b.all_reduced, 0u) << "the adapters' gradients are all-reduced";
    EXPECT_LT(b.gathered, a.gathered) << "no adapter is gathered";
    // Checkpoints: saved replicated (rank 0 alone writes the adapters), loaded into either layout.
    checkpoint::save(root_dir, "rep", *r.root, r.optim.get(), {});
    checkpoint::save(root_dir, "sh", *s.root, s.optim.get(), {});
    const at::Tensor x = batch(9, rank, 2).first;
    const at::Tensor want_r = fsdp::call(r.net, x).detach(), want_s = fsdp::call(s.net, x).detach();
    DeviceMesh m1(dist), m2(dist);
    Adapted fresh_s = adapted(m1, false, ShardingStrategy::kFullShard);
    checkpoint::load(io::join(root_dir, "rep"), *fresh_s.root, fresh_s.optim.get());
    EXPECT_TRUE(at::equal(fsdp::call(fresh_s.net, x).detach(), want_r));
    Adapted fresh_r = adapted(m2, true, ShardingStrategy::kFullShard);
    checkpoint::load(io::join(root_dir, "sh"), *fresh_r.root, fresh_r.optim.get());
    EXPECT_TRUE(at::equal(fsdp::call(fresh_r.net, x).detach(), want_s));
    // Training on from the loaded state agrees too (the optimizer state came along).
    const AdaptedRun c = train_adapted(m2, fresh_r, rank, 2);
    const AdaptedRun d = train_adapted(sharded_mesh, s, rank, 2);
    expect_close(c, d);
  });
  io::remove_tree(root_dir);
}

// Under HYBRID_SHARD (2 replicas of 2) the adapters are all-reduced over all four ranks.
TEST(LoraSharded, ReplicatedAdaptersUnderHybridSharding) {
  testing::run_threads(4, [&](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh a_mesh(dist, 2, 2), b_mesh(dist, 2, 2);
    Adapted s = adapted(a_mesh, false, ShardingStrategy::kHybridShard);
    Adapted r = adapted(b_mesh, true, ShardingStrategy::kHybridShard);
    for (FlatParam* fp : testing::flat_params(*r.root)) {
      if (fp->config().replicated) EXPECT_EQ(fp->replicate_group().size(), 4);
    }
    expect_close(train_adapted(b_mesh, r, dist->rank(), 4), train_adapted(a_mesh, s, dist->rank(), 4));
  });
}

// ---- one rank, a bf16 base at bf16 compute (docs/ARCHITECTURE.md, "A flat parameter's life")

const FullyShardOptions kOneRankBf16 =
    FullyShardOptions().mp_policy(MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));

// B non-zero, so that every adapter has a gradient at the first step.
Net one_rank_net(bool meta = false) {
  Net net{nullptr};
  if (meta) {
    MetaDeviceGuard guard;
    net = Net();
  } else {
    net = make_net();
  }
  lora(*net, lora_options(FrozenStorage::kParamDtype), 7);
  return net;
}

void fill_lora_b(Net& net, double value) {
  at::NoGradGuard g;
  for (auto& p : net->named_parameters()) {
    if (p.key().find("lora_B") != std::string::npos) p.value().fill_(value);
  }
}

std::shared_ptr<FSDPModule> shard_one_rank(Net& net, DeviceMesh& mesh, const FullyShardOptions& opts) {
  fully_shard(net->b0, mesh, opts);
  fully_shard(net->b1, mesh, opts);
  return fully_shard(net, mesh, opts);
}

// Every frozen flat param's stored bf16 shard is its gathered params: never resharded, no buffer
// of its own, each parameter a view into the shard.
void expect_base_is_the_stored_shard(const FSDPModule& root, const std::string& when) {
  int frozen = 0;
  for (FlatParam* fp : fsdp::testing::flat_params(root)) {
    if (fp->config().requires_grad) continue;
    ++frozen;
    const at::Tensor& shard = fp->sharded_param();
    ASSERT_EQ(shard.scalar_type(), at::kBFloat16) << fp->config().tag;
    ASSERT_EQ(shard.numel(), fp->padded_numel()) << fp->config().tag << ": padded at one rank";
    ASSERT_EQ(fp->state(), ShardedState::kUnsharded) << fp->config().tag << " " << when << ": resharded";
    EXPECT_EQ(fp->unsharded_bytes(), 0) << fp->config().tag << " " << when;
    for (const auto& e : fp->entries()) {
      const void* in_shard = shard.data_ptr<at::BFloat16>() + e.offset;
      EXPECT_EQ(e.param.data_ptr(), in_shard) << e.name << " " << when << ": not a view of the stored shard";
    }
  }
  EXPECT_EQ(frozen, 6);  // the root's, b0's and b1's: 2-D weights and 1-D params (optimizer groups) apart
}

// On one rank the frozen base kept in bf16 is the gathered params themselves: no second copy at any
// moment and none made per forward or backward, while a LoRA step's losses and gradients equal an
// unsharded bf16 model's bit for bit (its adapters stepped in fp32, as the masters are).
TEST(LoraOneRank, BFloat16BaseIsTheGatheredParamsAndStepsAsTheUnshardedModel) {
  testing::run_threads(1, [](const std::shared_ptr<Dist>& dist) {
    at::set_num_threads(1);
    DeviceMesh mesh(dist);
    Net ref = one_rank_net(), net = one_rank_net();
    fill_lora_b(ref, 0.05);
    fill_lora_b(net, 0.05);
    std::map<std::string, at::Tensor> masters;  // the reference adapters' fp32 values
    int64_t adapters = 0;
    for (const auto& p : ref->named_parameters()) {
      if (!p.value().requires_grad()) continue;
      masters[p.key()] = p.value().detach().clone();
      adapters += p.value().numel();
    }
    ref->to(at::kBFloat16);
    auto ref_params = ref->named_parameters();
    std::map<const void*, std::string> names;
    for (const auto& p : net->named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
    auto root = shard_one_rank(net, mesh, kOneRankBf16);
    SGD optim(root, SGDOptions(0.5));
    expect_base_is_the_stored_shard(*root, "before the first forward");
    for (int step = 0; step < 3; ++step) {
      const auto [x, y] = batch(step, 0, 1);
      at::Tensor loss = at::mse_loss(fsdp::call(net, x).to(at::kFloat), y);
      loss.backward();
      {
        at::NoGradGuard g;
        for (const auto& [name, m] : masters) ref_params[name].copy_(m);
      }
      at::Tensor ref_loss = at::mse_loss(ref->forward(x.to(at::kBFloat16)).to(at::kFloat), y);
      ref_loss.backward();
      EXPECT_TRUE(at::equal(loss.detach(), ref_loss.detach()))
          << "step " << step << ": " << loss.item<double>() << " against " << ref_loss.item<double>();
      int compared = 0;
      for (FlatParam* fp : fsdp::testing::flat_params(*root)) {
        if (!fp->config().requires_grad) continue;
        fp->grads().finalize();
        for (const auto& e : fp->entries()) {
          const std::string& name = names.at(e.param.unsafeGetTensorImpl());
          const at::Tensor got = fp->sharded_grad().narrow(0, e.offset, e.numel).view(e.shape);
          EXPECT_TRUE(at::equal(got, ref_params[name].grad().to(at::kFloat))) << name << " step " << step;
          ++compared;
        }
      }
      EXPECT_EQ(compared, static_cast<int>(masters.size()));
      optim.step();
      optim.zero_grad();
      at::NoGradGuard g;
      for (auto& [name, m] : masters) {
        m.sub_(ref_params[name].grad().to(at::kFloat) * 0.5);
        ref_params[name].mutable_grad() = at::Tensor();
      }
      expect_base_is_the_stored_shard(*root, "after step " + std::to_string(step));
    }
    // The gathered bytes never held more than the adapters' bf16 params and gradient buffers: a
    // gathered copy of any block's base (5,248 bf16 values) would pass that.
    EXPECT_LE(memory_report(*root).peak_unsharded, adapters * 2 * 2);
  });
}

// On one rank a checkpoint load writes the bf16 base in place, and the params, which are that
// shard, see it; a model built on the meta device, whose deferred init leaves the base to an import
// (a new stored shard, made as the import reads it), takes that shard as its params.
TEST(LoraOneRank, LoadsWriteTheStoredShardTheParamsAre) {
  const std::string dir = testing::temp_path("lora-one-rank");
  io::make_dirs(dir);
  testing::run_threads(1, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    const auto [x, y] = batch(0, 0, 1);
    Net a = one_rank_net();
    fill_lora_b(a, 0.05);
    auto a_root = shard_one_rank(a, mesh, kOneRankBf16);
    const at::Tensor want = fsdp::call(a, x).detach();
    checkpoint::save(dir, "all", *a_root, nullptr, {});
    Net b = one_rank_net();  // another base
    {
      at::NoGradGuard g;
      for (auto& p : b->parameters()) p.add_(1.0);
    }
    auto b_root = shard_one_rank(b, mesh, kOneRankBf16);
    EXPECT_FALSE(at::equal(fsdp::call(b, x).detach(), want));
    checkpoint::load(io::join(dir, "all"), *b_root, nullptr);
    expect_base_is_the_stored_shard(*b_root, "after a load");
    EXPECT_TRUE(at::equal(b->b0->q->named_parameters(false)["weight"], a->b0->q->named_parameters(false)["weight"]));
    EXPECT_TRUE(at::equal(fsdp::call(b, x).detach(), want));
    Net c = one_rank_net(/*meta=*/true);
    auto c_root = shard_one_rank(c, mesh, FullyShardOptions(kOneRankBf16).init(init::normal(0.2, 11)));
    checkpoint::import_weights(io::join(dir, "all"), *c_root);
    expect_base_is_the_stored_shard(*c_root, "after deferred init left it to an import");
    EXPECT_TRUE(at::equal(fsdp::call(c, x).detach(), want));
  });
  io::remove_tree(dir);
}

}  // namespace
}  // namespace fsdp
