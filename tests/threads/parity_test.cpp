// Parity with unsharded training: the same model from the same seed trained sharded on N ranks
// (threads, Gloo) and as an unsharded single-process reference over the same global batch. Losses
// are compared every step and, at the end, each rank's master shard with the matching slice of
// the reference parameters. A grid over world sizes, strategies, mixed precision, accumulation,
// frozen and reused blocks, skipped units, clipping and deferred init.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <mutex>

#include "fsdp/fsdp.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"

namespace fsdp {
namespace {
using testing::Net;
using testing::NetOptions;

struct ParityConfig {
  int world = 2;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int replicate = 1;  // > 1: a 2-D mesh (replicate x world/replicate)
  std::optional<at::ScalarType> param_dtype;
  std::optional<at::ScalarType> reduce_dtype;
  int steps = 10;
  int microbatches = 1;
  Accumulation accumulation = Accumulation::kNoSync;  // how the micro-batches accumulate
  int skip_block_first_micro = -1;                    // this block reaches the loss in every micro-batch but the first
  double clip = 0;
  bool freeze_first = false;
  bool sgd = false;
  bool deferred_init = false;
  NetOptions net;
  double lr = 1e-2;
  double loss_rtol = 1e-5;
  double param_atol = 2e-5;
};

constexpr int64_t kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4
std::mutex g_seed_mutex;              // at::manual_seed is process-global; ranks are threads

ParamInitFn net_init() { return init::by_suffix({{"bias", init::normal(0.1, 7)}}, init::normal(0.3, 7)); }

Net make_net(const NetOptions& o, uint64_t seed) {
  std::lock_guard<std::mutex> lock(g_seed_mutex);
  at::manual_seed(seed);
  return Net(o);
}

// The reference optimizer: the same update rule, applied to whole unsharded parameters.
struct ReferenceOptimizer {
  ParityConfig cfg;
  std::map<const void*, std::pair<at::Tensor, at::Tensor>> adam;  // exp_avg, exp_avg_sq
  std::map<const void*, at::Tensor> momentum;
  int64_t step = 0;
  void apply(const std::vector<at::Tensor>& params) {
    c10::NoGradGuard no_grad;
    ++step;
    for (const auto& p : params) {
      if (!p.requires_grad() || !p.grad().defined()) continue;
      const double wd = p.dim() >= 2 ? 0.1 : 0.0;
      auto g = p.grad();
      if (cfg.sgd) {
        auto d = g.add(p, wd);
        auto& buf = momentum[p.unsafeGetTensorImpl()];
        if (!buf.defined()) buf = d.clone();
        else buf.mul_(0.9).add_(d);
        p.add_(buf, -cfg.lr);
        continue;
      }
      auto& st = adam[p.unsafeGetTensorImpl()];
      if (!st.first.defined()) st = {at::zeros_like(p), at::zeros_like(p)};
      p.mul_(1 - cfg.lr * wd);
      st.first.lerp_(g, 0.1);
      st.second.mul_(0.999).addcmul_(g, g, 0.001);
      const double bc1 = 1 - std::pow(0.9, double(step)), bc2 = 1 - std::pow(0.999, double(step));
      p.addcdiv_(st.first, (st.second.sqrt() / std::sqrt(bc2)).add_(1e-8), -cfg.lr / bc1);
    }
  }
};

// One rank's side of a parity run; the reference runs in every rank, on the whole global batch.
void parity_on_rank(const std::shared_ptr<Dist>& dist, const ParityConfig& cfg) {
  {
    auto mesh = cfg.replicate > 1 ? DeviceMesh(dist, cfg.replicate, cfg.world / cfg.replicate) : DeviceMesh(dist);

    Net ref = make_net(cfg.net, 42);
    NetOptions sharded_opts = cfg.net;
    if (cfg.deferred_init) {
      sharded_opts.device = at::kMeta;
      init::materialize(*ref, net_init());
    }
    Net model = make_net(sharded_opts, 42);
    if (cfg.freeze_first) {
      for (auto* m : {ref.ptr().get(), model.ptr().get()}) {
        auto* net = static_cast<testing::NetImpl*>(m);
        net->blocks[0]->fc1->weight.requires_grad_(false);
        net->blocks[0]->fc1->bias.requires_grad_(false);
      }
    }
    FullyShardOptions opts;
    opts.strategy(cfg.strategy)
        .mp_policy(MixedPrecisionPolicy().param_dtype(cfg.param_dtype).reduce_dtype(cfg.reduce_dtype));
    if (cfg.deferred_init) opts.init(net_init());
    for (auto& block : model->blocks) fully_shard(block, mesh, opts);
    // Only the root casts its output back to fp32 for the loss; blocks hand bf16 to each other.
    auto root_opts = opts;
    if (cfg.param_dtype) root_opts.mp_policy().output_dtype(at::kFloat);
    auto root = fully_shard(model, mesh, root_opts);

    std::unique_ptr<ShardedOptimizer> optim;
    if (cfg.sgd) {
      optim = std::make_unique<SGD>(root, SGDOptions(cfg.lr).momentum(0.9).weight_decay(0.1));
    } else {
      optim = std::make_unique<AdamW>(root, AdamWOptions(cfg.lr).weight_decay(0.1));
    }
    ReferenceOptimizer ref_optim{cfg};
    std::vector<at::Tensor> ref_params;
    for (auto& p : ref->parameters()) ref_params.push_back(p);
    // Mixed precision reference: a low-precision copy that computes, fp32 masters that step.
    Net ref_lowp = cfg.param_dtype ? make_net(cfg.net, 42) : Net(nullptr);

    const int64_t local = kGlobalBatch / dist->world_size();
    for (int step = 0; step < cfg.steps; ++step) {
      double ref_loss_total = 0, loss_total = 0;
      for (int micro = 0; micro < cfg.microbatches; ++micro) {
        if (cfg.skip_block_first_micro >= 0) {
          const int skip = micro == 0 ? cfg.skip_block_first_micro : cfg.net.skip_block;
          model->opts.skip_block = skip;
          ref->opts.skip_block = skip;
        }
        auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step * 10 + micro);
        auto x = at::randn({kGlobalBatch, cfg.net.in}, gen);
        auto y = at::randn({kGlobalBatch, cfg.net.out}, gen);
        const bool last = micro == cfg.microbatches - 1;
        root->set_requires_gradient_sync(last || cfg.accumulation != Accumulation::kNoSync);
        root->set_requires_all_reduce(last || cfg.accumulation != Accumulation::kReduceScatter);
        auto xs = x.narrow(0, dist->rank() * local, local), ys = y.narrow(0, dist->rank() * local, local);
        auto loss = at::mse_loss(fsdp::call(model, xs), ys) / cfg.microbatches;
        loss.backward();
        loss_total += loss.item<double>();

        at::Tensor ref_loss;
        if (cfg.param_dtype) {
          c10::NoGradGuard ng;
          auto lp = ref_lowp->parameters();
          for (size_t i = 0; i < lp.size(); ++i) {
            lp[i].set_data(ref_params[i].detach().to(*cfg.param_dtype));
            lp[i].mutable_grad() = at::Tensor();
          }
        }
        if (cfg.param_dtype) {
          auto out = ref_lowp->forward(x.to(*cfg.param_dtype)).to(at::kFloat);
          ref_loss = at::mse_loss(out, y) / cfg.microbatches;
          ref_loss.backward();
          auto lp = ref_lowp->parameters();
          for (size_t i = 0; i < lp.size(); ++i) {
            if (!lp[i].grad().defined()) continue;
            auto g = lp[i].grad().to(at::kFloat);
            if (ref_params[i].grad().defined()) ref_params[i].mutable_grad().add_(g);
            else ref_params[i].mutable_grad() = g;
          }
        } else {
          ref_loss = at::mse_loss(ref->forward(x), y) / cfg.microbatches;
          ref_loss.backward();
        }
        ref_loss_total += ref_loss.item<double>();
      }
      // The sharded global loss is the mean of the ranks' local means.
      auto l = at::full({1}, loss_total, at::kDouble);
      dist->world().all_reduce(l, ReduceOp::kAvg, "loss").wait();
      EXPECT_NEAR(l.item<double>(), ref_loss_total, cfg.loss_rtol * std::abs(ref_loss_total) + 1e-12)
          << "step " << step << " rank " << dist->rank();
      if (cfg.clip > 0) {
        const double norm = clip_grad_norm(*root, cfg.clip);
        double sq = 0;
        for (auto& p : ref_params)
          if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
        const double ref_norm = std::sqrt(sq);
        EXPECT_NEAR(norm, ref_norm, 1e-4 * ref_norm) << "step " << step;
        const double coef = cfg.clip / (ref_norm + 1e-6);
        if (coef < 1)
          for (auto& p : ref_params)
            if (p.grad().defined()) p.mutable_grad().mul_(coef);
      }
      optim->step();
      optim->zero_grad();
      ref_optim.apply(ref_params);
      for (auto& p : ref_params) p.mutable_grad() = at::Tensor();
    }

    // Each rank's master shard equals the matching slice of the reference.
    std::map<std::string, at::Tensor> ref_named;
    for (auto& item : ref->named_parameters()) ref_named[item.key()] = item.value();
    for (const auto& unit : fsdp::testing::units(*root)) {
      for (auto& fp : unit->flat_params()) {
        std::vector<at::Tensor> flat;
        for (const auto& e : fp->entries())
          flat.push_back(ref_named.at(unit->prefix() + e.name).detach().reshape({-1}));
        auto full = at::cat(flat);
        full = at::constant_pad_nd(full, {0, fp->padded_numel() - fp->numel()});
        auto expect = full.narrow(0, fp->shard_offset(), fp->shard_numel());
        const double err = (fp->sharded_param() - expect).abs().max().item<double>();
        EXPECT_LE(err, cfg.param_atol) << unit->name() << " flat param " << fp->config().tag << " rank "
                                       << dist->rank();
        if (!fp->config().requires_grad) EXPECT_FALSE(fp->sharded_grad().defined());
      }
    }
    // Frozen parameters have no optimizer state.
    const auto flats = fsdp::testing::flat_params(*root);
    for (auto& s : optim->states()) EXPECT_TRUE(flats.at(s.flat_index)->config().requires_grad);
  }
}

void run_parity(const ParityConfig& cfg) {
  testing::run_threads(cfg.world, [&](const std::shared_ptr<Dist>& dist) { parity_on_rank(dist, cfg); });
}

struct NamedConfig {
  std::string name;
  ParityConfig cfg;
};

class Parity : public ::testing::TestWithParam<NamedConfig> {};
TEST_P(Parity, MatchesUnshardedReference) { run_parity(GetParam().cfg); }

std::vector<NamedConfig> grid() {
  std::vector<NamedConfig> out;
  for (int w : {1, 2, 3, 4}) {
    for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
      ParityConfig c;
      c.world = w;
      c.strategy = s;
      out.push_back({std::string(strategy_name(s)) + "_w" + std::to_string(w), c});
    }
  }
  ParityConfig hybrid;
  hybrid.world = 4;
  hybrid.replicate = 2;
  hybrid.strategy = ShardingStrategy::kHybridShard;
  out.push_back({"HYBRID_SHARD_w4_2x2", hybrid});
  // Three micro-batches under hybrid sharding, each way of accumulating them.
  for (auto a : {Accumulation::kNoSync, Accumulation::kReduceScatter, Accumulation::kReduce}) {
    ParityConfig c = hybrid;
    c.microbatches = 3;
    c.accumulation = a;
    out.push_back({std::string("HYBRID_SHARD_w4_2x2_accum3_") + accumulation_name(a), c});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Strategies, Parity, ::testing::ValuesIn(grid()),
                         [](const auto& info) { return info.param.name; });

void PrintTo(const NamedConfig& c, std::ostream* os) { *os << c.name; }

// The same check with ranks as separate processes, rendezvous through the environment.
TEST(ParityProcesses, FullShardThreeRanks) {
  auto results = testing::run_processes(3, [](int) {
    at::set_num_threads(1);
    auto dist = init_from_env(InitOptions().timeout(std::chrono::seconds(20)));
    ParityConfig c;
    c.world = 3;
    parity_on_rank(dist, c);
  });
  testing::expect_all_ok(results);
}

TEST(ParityFeatures, MixedPrecisionBf16) {
  ParityConfig c;
  c.world = 2;
  c.param_dtype = at::kBFloat16;
  c.reduce_dtype = at::kFloat;
  c.lr = 1e-3;
  c.loss_rtol = 2e-2;
  c.param_atol = 1.5e-2;
  run_parity(c);
}

TEST(ParityFeatures, GradientAccumulationWithoutSync) {
  ParityConfig c;
  c.world = 2;
  c.microbatches = 3;
  run_parity(c);
}

// Note [The first gradient is copied]: a unit whose gradient first arrives in a later micro-batch
// gets it copied in then, on top of nothing (not on the buffer's old bytes).
TEST(ParityFeatures, GradientAccumulationWithABlockUnusedInTheFirstMicroBatch) {
  ParityConfig c;
  c.world = 2;
  c.microbatches = 3;
  c.skip_block_first_micro = 1;
  run_parity(c);
}

TEST(ParityFeatures, FrozenParamsHaveNoGradsOrState) {
  ParityConfig c;
  c.world = 3;
  c.freeze_first = true;
  run_parity(c);
}

TEST(ParityFeatures, ClipByGlobalNorm) {
  ParityConfig c;
  c.world = 4;
  c.clip = 0.05;
  c.sgd = true;
  run_parity(c);
}

TEST(ParityFeatures, UnitRunTwiceInOneForward) {
  ParityConfig c;
  c.world = 2;
  c.net.reuse_block = true;
  run_parity(c);
}

TEST(ParityFeatures, UnitWithoutGradient) {
  ParityConfig c;
  c.world = 2;
  c.net.skip_block = 1;
  run_parity(c);
}

TEST(ParityFeatures, ActivationCheckpointedBlock) {
  ParityConfig c;
  c.world = 2;
  c.net.checkpoint_block = 1;
  run_parity(c);
}

TEST(ParityFeatures, DeferredInitEqualsEagerInit) {
  ParityConfig c;
  c.world = 3;
  c.deferred_init = true;
  run_parity(c);
}

// FULL_SHARD and SHARD_GRAD_OP shard over every rank of a 1-D mesh; on a 2-D mesh they would
// shard within rows and replicate across them, which is HYBRID_SHARD, so fully_shard refuses them
// on every rank, naming the strategy, the mesh's shape and the way out.
TEST(StrategyMesh, FullShardAndShardGradOpRefuseA2DMesh) {
  testing::run_threads(4, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist, /*replicate_size=*/2, /*shard_size=*/2);
    for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      Net model = make_net(NetOptions(), 42);
      try {
        fully_shard(model, mesh, FullyShardOptions().strategy(s));
        ADD_FAILURE() << strategy_name(s) << " on a 2x2 mesh did not throw on rank " << dist->rank();
      } catch (const ConfigError& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find(strategy_name(s)), std::string::npos) << what;
        EXPECT_NE(what.find("replicate_size=2, shard_size=2"), std::string::npos) << what;
        EXPECT_NE(what.find("use HYBRID_SHARD"), std::string::npos) << what;
        EXPECT_NE(what.find("DeviceMesh(dist)"), std::string::npos) << what;
      }
      EXPECT_EQ(detail::unit_of(*model), nullptr);  // nothing half-applied
    }
  });
}

// Tied embedding / output projection: one owner, gathered once and reduced once per step, and the
// training matches the unsharded reference where the tie is kept too.
TEST(ParityFeatures, TiedWeights) {
  constexpr int64_t kVocab = 11, kDim = 15, kTokens = 12;
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto make = [&] {
      std::lock_guard<std::mutex> lock(g_seed_mutex);
      at::manual_seed(5);
      return testing::TiedNet(kVocab, kDim, 2);
    };
    testing::TiedNet ref = make(), model = make();
    ASSERT_TRUE(model->embed->weight.is_same(model->out->weight));
    for (auto& b : model->blocks) fully_shard(b, mesh);
    auto root = fully_shard(model, mesh);
    AdamW optim(root, AdamWOptions(1e-2).weight_decay(0.1));
    ParityConfig cfg;
    ReferenceOptimizer ref_optim{cfg};
    std::vector<at::Tensor> ref_params;
    for (auto& p : ref->parameters()) {
      bool dup = false;
      for (auto& q : ref_params) dup = dup || q.is_same(p);
      if (!dup) ref_params.push_back(p);
    }
    // The tied tensor is one entry of the root's flat params, with the second name as an alias.
    int entries = 0;
    for (const auto& unit : fsdp::testing::units(*root)) {
      for (auto& fp : unit->flat_params()) {
        for (auto& e : fp->entries()) {
          if (e.name == "embed.weight") {
            ++entries;
            ASSERT_EQ(e.aliases, std::vector<std::string>{"out.weight"});
          }
          EXPECT_NE(e.name, "out.weight");
        }
      }
    }
    EXPECT_EQ(entries, 1);
    const int64_t local = kTokens / 2;
    for (int step = 0; step < 8; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + step);
      auto tokens = at::randint(kVocab, {kTokens, 3}, gen);
      auto targets = at::randint(kVocab, {kTokens, 3}, gen);
      auto ce = [&](const at::Tensor& logits, const at::Tensor& t) {
        return at::cross_entropy_loss(logits.reshape({-1, kVocab}), t.reshape({-1}));
      };
      const auto before = dist->world().stats();
      auto loss = ce(fsdp::call(model, tokens.narrow(0, dist->rank() * local, local)),
                     targets.narrow(0, dist->rank() * local, local));
      loss.backward();
      optim.step();  // collects the last reductions (they finish behind backward)
      const auto d = dist->world().stats() - before;
      auto ref_loss = ce(ref->forward(tokens), targets);
      ref_loss.backward();
      auto l = at::full({1}, loss.item<double>(), at::kDouble);
      dist->world().all_reduce(l, ReduceOp::kAvg, "loss").wait();
      EXPECT_NEAR(l.item<double>(), ref_loss.item<double>(), 1e-5 * ref_loss.item<double>()) << "step " << step;
      int64_t padded = 0, root_padded = 0, last_padded = 0;
      for (const auto& unit : fsdp::testing::units(*root)) {
        for (auto& fp : unit->flat_params()) {
          padded += fp->padded_numel();
          if (unit->is_root()) root_padded += fp->padded_numel();
          if (unit->module().lock().get() == model->blocks.back().ptr().get()) last_padded += fp->padded_numel();
        }
      }
      ASSERT_GT(last_padded, 0);
      // Gathered once in forward (twice for the blocks, which reshard, except the last one from the
      // second step: Note [The last unit keeps its params]), reduced once: no doubles.
      const int64_t gathered = 2 * padded - root_padded - (step > 0 ? last_padded : 0);
      EXPECT_EQ(d.of(CollectiveKind::kAllGather).bytes_sent, 4ull * gathered / 2);
      EXPECT_EQ(d.of(CollectiveKind::kReduceScatter).bytes_sent, 4ull * padded / 2);
      optim.zero_grad();
      ref_optim.apply(ref_params);
      for (auto& p : ref_params) p.mutable_grad() = at::Tensor();
    }
  });
}

}  // namespace
}  // namespace fsdp
