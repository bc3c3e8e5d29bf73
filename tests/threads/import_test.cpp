// fsdp::checkpoint::import_weights (Note [Importing weights]): a foreign safetensors file set, as a
// Hugging Face model directory holds it, read into a sharded model. Values land exactly (BF16, F16
// and F32 sources; one file or an index over several), each rank reads only its own byte ranges
// (the ranks' reads add up to the files' size once), a tied lm_head may be absent, and every bad
// directory (missing, unexpected, mis-shaped or mistyped tensors, truncated or malformed files, no
// weights at all) is refused on every rank naming the file and the tensor. A tensor allowed to grow
// (Note [Grown rows]) keeps the source's rows and gets their mean in the added ones on any world
// size and strategy, and import_unsharded reads the same directories into an ordinary module. A
// master that follows its offloaded optimizer state gives the forward the imported weights.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "llama.h"
#include "frozen/frozen_storage.h"
#include "safetensors/index.h"
#include "safetensors/safetensors.h"
#include "safetensors/torch_dtypes.h"
#include "shard/testing.h"
#include "support/ranks.h"

namespace fsdp {
namespace {

namespace st = safetensors;
using Named = std::vector<std::pair<std::string, at::Tensor>>;

llama::LlamaConfig tiny(bool tied) {
  llama::LlamaConfig c;
  c.model_type = "qwen2";  // q/k/v biases: 1-D tensors beside the matrices
  c.vocab_size = 50, c.hidden_size = 16, c.intermediate_size = 24, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.max_position_embeddings = 32;
  c.tie_word_embeddings = tied;
  return c;
}

// The reference weights: llama_init_fn's values, rounded through `dtype`, by name (tied once).
Named reference(const llama::LlamaConfig& c, at::ScalarType dtype) {
  llama::LlamaForCausalLM ref(c, at::kMeta);
  init::materialize(*ref, llama::llama_init_fn(c, 11));
  Named out;
  std::map<const void*, bool> seen;
  for (const auto& p : ref->named_parameters()) {
    if (seen[p.value().unsafeGetTensorImpl()]) continue;
    seen[p.value().unsafeGetTensorImpl()] = true;
    out.emplace_back(p.key(), p.value().detach().to(dtype).contiguous());
  }
  return out;
}

void write_file(const std::string& path, const Named& tensors) {
  std::vector<st::TensorSpec> specs;
  for (const auto& [n, t] : tensors) specs.push_back({n, st::from_scalar_type(t.scalar_type()), t.sizes().vec()});
  const auto plan = st::plan_file(specs, {{"format", "pt"}});
  auto f = io::File::open_write(path, true);
  f.pwrite_all(plan.header_bytes.data(), plan.header_bytes.size(), 0);
  for (const auto& [n, t] : tensors) {
    f.pwrite_all(t.data_ptr(), t.nbytes(), plan.header.data_start() + plan.header.find(n)->begin);
  }
  f.close();
}

// `tensors` split round-robin over `files` files with an index, or one model.safetensors.
std::string write_dir(const std::string& stem, const Named& tensors, int files) {
  const std::string dir = testing::temp_path(stem);
  io::make_dirs(dir);
  if (files == 1) {
    write_file(io::join(dir, "model.safetensors"), tensors);
    return dir;
  }
  std::vector<Named> parts(files);
  st::Index index;
  for (size_t i = 0; i < tensors.size(); ++i) parts[i % files].push_back(tensors[i]);
  for (int f = 0; f < files; ++f) {
    const std::string name = "model-0000" + std::to_string(f + 1) + "-of-0000" + std::to_string(files) + ".safetensors";
    write_file(io::join(dir, name), parts[f]);
    for (const auto& [n, t] : parts[f]) index.weight_map[n] = name;
  }
  io::write_file_atomic(io::join(dir, "model.safetensors.index.json"), st::index_to_json(index));
  return dir;
}

struct Imported {
  llama::LlamaForCausalLM model{nullptr};
  std::shared_ptr<FSDPModule> root;
};

// Built on the meta device, by default with init::from_load(): the import writes every parameter,
// and its lazy init leaves them to it (Note [Deferred init leaves what a load writes]).
Imported sharded(const llama::LlamaConfig& c, DeviceMesh& mesh, FullyShardOptions opts = {}) {
  if (!opts.init()) opts.init(init::from_load());
  Imported m{llama::LlamaForCausalLM(c, at::kMeta), nullptr};
  for (auto& layer : m.model->model->layers) fully_shard(layer, mesh, opts);
  m.root = fully_shard(m.model, mesh, opts);
  return m;
}

// Every rank's master shards equal the reference's elements, bit for bit.
void expect_shards_equal(FSDPModule& root, const Named& ref, int rank) {
  std::map<std::string, at::Tensor> named(ref.begin(), ref.end());
  for (const auto& unit : testing::units(root)) {
    for (auto& fp : unit->flat_params()) {
      std::vector<at::Tensor> flat;
      for (const auto& e : fp->entries()) flat.push_back(named.at(unit->prefix() + e.name).to(at::kFloat).reshape(-1));
      auto full = at::constant_pad_nd(at::cat(flat), {0, fp->padded_numel() - fp->numel()});
      EXPECT_TRUE(at::equal(fp->sharded_param(), full.narrow(0, fp->shard_offset(), fp->shard_numel())))
          << fp->config().tag << " rank " << rank;
    }
  }
}

TEST(Import, ShardedBf16FilesOnTwoRanksEachReadingOnlyItsShards) {
  for (bool tied : {false, true}) {
    const auto c = tiny(tied);
    const Named ref = reference(c, at::kBFloat16);  // tied: no lm_head.weight, as transformers saves it
    const std::string dir = write_dir("import-bf16", ref, 3);
    std::vector<uint64_t> read(2);
    uint64_t total = 0;
    testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
      DeviceMesh mesh(dist);
      auto m = sharded(c, mesh);
      const auto report = checkpoint::import_weights(dir, *m.root);
      EXPECT_EQ(report.files.size(), 3u);
      EXPECT_EQ(report.dtypes, "BF16");
      EXPECT_EQ(report.tensors, static_cast<int64_t>(ref.size()));
      read[dist->rank()] = report.bytes_read;
      total = report.total_bytes;
      expect_shards_equal(*m.root, ref, dist->rank());
    });
    // Each element is read by exactly one rank: no rank reads the whole model.
    EXPECT_EQ(read[0] + read[1], total) << "tied=" << tied;
    EXPECT_LT(read[0], total);
    EXPECT_LT(read[1], total);
  }
}

TEST(Import, SingleFileF16AndF32AndATiedLmHeadStoredToo) {
  for (auto dtype : {at::kHalf, at::kFloat}) {
    const auto c = tiny(/*tied=*/true);
    Named ref = reference(c, dtype);
    ref.emplace_back("lm_head.weight", ref.front().second);  // some files hold the tied name too
    const std::string dir = write_dir("import-single", ref, 1);
    auto dist = Dist::single();
    DeviceMesh mesh(dist);
    auto m = sharded(c, mesh);
    const auto report = checkpoint::import_weights(dir, *m.root);
    EXPECT_EQ(report.dtypes, dtype == at::kHalf ? "F16" : "F32");
    expect_shards_equal(*m.root, ref, 0);
  }
}

// With only the optimizer state offloaded, the master follows the state into its tier and the
// forward gathers a bf16 working copy of it (Note [The master follows the optimizer state]): the
// import must refresh that copy, or the first step computes with the zeros of deferred init.
TEST(Import, AMasterThatFollowsItsOffloadedStateIsWhatTheForwardUses) {
  const auto c = tiny(/*tied=*/true);
  const std::string dir = write_dir("import-follows", reference(c, at::kBFloat16), 2);
  const std::string tier_dir = testing::temp_path("import-follows-tier");
  const at::Tensor tokens = at::arange(12, at::kLong).remainder(c.vocab_size).view({2, 6});
  std::map<std::string, at::Tensor> logits;
  for (const std::string tier : {"none", "host", "disk"}) {
    testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
      DeviceMesh mesh(dist);
      auto policy = OffloadPolicy().optimizer_state(parse_offload_tier(tier)).dir(io::join(tier_dir, tier));
      auto opts = FullyShardOptions()
                      .init(init::constant(0.0))
                      .mp_policy(MixedPrecisionPolicy().param_dtype(at::kBFloat16))
                      .offload(policy);
      auto [model, root] = sharded(c, mesh, opts);
      checkpoint::import_weights(dir, *root);
      if (tier == "disk") {
        // The import wrote every master once, through the tier's write thread, not page by page
        // through its mapping (whose faults read each page in first); the deferred init it
        // triggered wrote none (Note [Deferred init leaves what a load writes]).
        int64_t master_bytes = 0;
        for (FlatParam* fp : testing::flat_params(*root)) master_bytes += fp->shard_numel() * 4;
        EXPECT_EQ(offload_io(*root).disk_write, master_bytes) << "rank " << dist->rank();
        // The working copy was cast from the imported values as they were written, not read back.
        EXPECT_EQ(offload_io(*root).disk_read, 0) << "rank " << dist->rank();
      }
      const at::Tensor out = call(model, tokens).detach().to(at::kFloat);
      if (dist->rank() == 0) logits[tier] = out;
    });
  }
  io::remove_tree(tier_dir);
  EXPECT_GT(logits["none"].abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(at::equal(logits["host"], logits["none"])) << "optimizer_state=host: the forward used other weights";
  EXPECT_TRUE(at::equal(logits["disk"], logits["none"])) << "optimizer_state=disk: the forward used other weights";
}

// The message import_weights throws for `dir` (on each of two ranks, which must agree).
std::string import_error(const llama::LlamaConfig& c, const std::string& dir) {
  std::vector<std::string> messages(2);
  testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
    DeviceMesh mesh(dist);
    auto m = sharded(c, mesh);
    try {
      checkpoint::import_weights(dir, *m.root);
      messages[dist->rank()] = "(accepted)";
    } catch (const CheckpointError& e) {
      messages[dist->rank()] = e.what();
    }
  });
  EXPECT_EQ(messages[0], messages[1]);
  return messages[0];
}

Named without(Named v, const std::string& name) {
  v.erase(std::remove_if(v.begin(), v.end(), [&](const auto& p) { return p.first == name; }), v.end());
  return v;
}

TEST(Import, BadDirectoriesAreRefusedNamingFileAndTensor) {
  const auto c = tiny(false);
  const Named ref = reference(c, at::kBFloat16);
  struct Case {
    std::string what;
    std::string dir;
    std::vector<std::string> must_contain;
  };
  std::vector<Case> cases;
  cases.push_back({"missing",
                   write_dir("imp-missing", without(ref, "model.layers.1.mlp.up_proj.weight"), 2),
                   {"missing tensor 'model.layers.1.mlp.up_proj.weight' (shape [24, 16])"}});
  cases.push_back({"missing lm_head, untied",
                   write_dir("imp-nohead", without(ref, "lm_head.weight"), 1),
                   {"missing tensor 'lm_head.weight'"}});
  Named extra = ref;
  extra.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", at::zeros({2}, at::kFloat));
  cases.push_back(
      {"unexpected",
       write_dir("imp-extra", extra, 2),
       {"model-00002-of-00002.safetensors: unexpected tensor 'model.layers.0.self_attn.rotary_emb.inv_freq'"}});
  Named misshaped = ref;
  for (auto& [n, t] : misshaped) {
    if (n == "model.layers.0.self_attn.k_proj.bias") t = at::zeros({9}, at::kBFloat16);
  }
  cases.push_back({"mis-shaped",
                   write_dir("imp-shape", misshaped, 1),
                   {"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.bias' has shape [9] but the "
                    "model's has shape [8]"}});
  Named ints = ref;
  ints[1].second = ints[1].second.to(at::kLong);
  cases.push_back({"dtype", write_dir("imp-dtype", ints, 1), {"'" + ints[1].first + "' is I64"}});
  const std::string truncated = write_dir("imp-trunc", ref, 2);
  {
    const std::string f = io::join(truncated, "model-00002-of-00002.safetensors");
    std::ifstream in(f, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream(f, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size() - 3);
  }
  cases.push_back({"truncated", truncated, {"model-00002-of-00002.safetensors"}});
  const std::string garbage = write_dir("imp-garbage", ref, 1);
  io::write_file_atomic(io::join(garbage, "model.safetensors"), std::string("\x10\0\0\0\0\0\0\0{not json}", 18));
  cases.push_back({"malformed", garbage, {"model.safetensors"}});
  const std::string empty = testing::temp_path("imp-empty");
  io::make_dirs(empty);
  cases.push_back({"no weights", empty, {"has neither model.safetensors nor model.safetensors.index.json"}});
  const std::string lost = write_dir("imp-lost", ref, 2);
  std::remove(io::join(lost, "model-00001-of-00002.safetensors").c_str());
  cases.push_back(
      {"index names a missing file", lost, {"lists model-00001-of-00002.safetensors, which does not exist"}});
  for (const auto& k : cases) {
    const std::string msg = import_error(c, k.dir);
    for (const auto& s : k.must_contain) EXPECT_NE(msg.find(s), std::string::npos) << k.what << ": " << msg;
  }
}

// Note [Grown rows]: `src`'s tensors with the embedding (and the untied LM head) grown to `rows`
// rows, each added row the mean of the source's rows (in fp64, as import does).
Named grown(const Named& src, int64_t rows) {
  Named out;
  for (const auto& [n, t] : src) {
    if (n != "model.embed_tokens.weight" && n != "lm_head.weight") {
      out.emplace_back(n, t);
      continue;
    }
    const at::Tensor f = t.to(at::kDouble);
    const at::Tensor mean = f.mean(0, /*keepdim=*/true).expand({rows - t.size(0), t.size(1)});
    out.emplace_back(n, at::cat({f, mean}).to(at::kFloat));
  }
  return out;
}

// A frozen base kept in a stored form is stored chunk by chunk as the import reads it (no fp32
// copy of the shard: FlatParam::store_values); the stored bytes must be those of storing the
// shard's values whole, blocks ending inside a tensor (the 1-D biases, 8 and 16 values) and the
// padding included, whether the lazy init left the shard to the import or had filled it first.
TEST(Import, AFrozenBaseStoredAsReadEqualsItsValuesStoredWhole) {
  const auto c = tiny(false);
  const Named ref = reference(c, at::kBFloat16);
  const std::string dir = write_dir("import-frozen", ref, 2);
  std::map<std::string, at::Tensor> named(ref.begin(), ref.end());
  for (const FrozenStorage storage : {FrozenStorage::kNF4, FrozenStorage::kInt8, FrozenStorage::kBFloat16}) {
    for (const bool filled_first : {false, true}) {
      testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
        DeviceMesh mesh(dist);
        auto opts = FullyShardOptions()
                        .init(init::constant(0.5))
                        .frozen_storage([storage](const std::string&, const at::Tensor&) { return storage; });
        llama::LlamaForCausalLM model(c, at::kMeta);
        for (auto& p : model->parameters()) p.requires_grad_(false);
        for (auto& layer : model->model->layers) fully_shard(layer, mesh, opts);
        auto root = fully_shard(model, mesh, opts);
        if (filled_first) testing::flat_params(*root);  // the lazy init, without the import
        checkpoint::import_weights(dir, *root);
        for (const auto& unit : testing::units(*root)) {
          for (auto& fp : unit->flat_params()) {
            ASSERT_TRUE(fp->stores_frozen()) << fp->config().tag;
            at::Tensor full = at::zeros({fp->padded_numel()}, at::kFloat);
            for (const auto& e : fp->entries())
              full.narrow(0, e.offset, e.numel).copy_(named.at(unit->prefix() + e.name).reshape(-1));
            const at::Tensor want = frozen::encode(storage, full.narrow(0, fp->shard_offset(), fp->shard_numel()));
            EXPECT_TRUE(at::equal(fp->sharded_param(), want))
                << frozen_storage_name(storage) << (filled_first ? ", filled first: " : ": ") << fp->config().tag
                << " rank " << dist->rank();
          }
        }
        // And the model computes with them.
        const at::Tensor out = call(model, at::arange(6, at::kLong).view({1, 6})).detach();
        EXPECT_TRUE(at::isfinite(out).all().item<bool>());
      });
    }
  }
}

// The import's lazy init leaves every master it will write unfilled (Note [Deferred init leaves
// what a load writes]); an import that fails must not leave them so: the model then holds its
// init's values, in memory and with the master in the disk tier, and trains from them.
TEST(Import, AFailedImportLeavesTheModelAtItsInit) {
  const auto c = tiny(false);
  const std::string dir = write_dir("imp-fail-init", without(reference(c, at::kBFloat16), "lm_head.weight"), 2);
  const std::string tier_dir = testing::temp_path("imp-fail-init-tier");
  const at::Tensor tokens = at::arange(12, at::kLong).remainder(c.vocab_size).view({2, 6});
  std::map<std::string, at::Tensor> logits;
  for (const std::string run : {"never imported", "failed import", "failed import, disk tier"}) {
    testing::run_threads(2, [&](const std::shared_ptr<Dist>& dist) {
      DeviceMesh mesh(dist);
      auto opts = FullyShardOptions().init(init::constant(0.25));
      if (run == "failed import, disk tier")
        opts.offload(
            OffloadPolicy().optimizer_state(OffloadTier::kDisk).dir(io::join(tier_dir, std::to_string(dist->rank()))));
      auto [model, root] = sharded(c, mesh, opts);
      if (run != "never imported") {
        EXPECT_THROW(checkpoint::import_weights(dir, *root), CheckpointError);
        for (FlatParam* fp : testing::flat_params(*root)) {
          EXPECT_FALSE(fp->awaits_load()) << fp->config().tag;
          const at::Tensor values = fp->sharded_param().narrow(0, 0, fp->values_in_shard());
          EXPECT_TRUE(at::equal(values, at::full_like(values, 0.25))) << run << ": " << fp->config().tag;
        }
      }
      const at::Tensor out = call(model, tokens).detach();
      if (dist->rank() == 0) logits[run] = out;
    });
  }
  io::remove_tree(tier_dir);
  EXPECT_TRUE(at::equal(logits["failed import"], logits["never imported"]));
  EXPECT_TRUE(at::equal(logits["failed import, disk tier"], logits["never imported"]));
}

TEST(Import, GrownRowsKeepTheSourceRowsAndTakeTheirMeanOnAnyWorldSizeAndStrategy) {
  struct Case {
    int ranks;
    ShardingStrategy strategy;
  };
  for (bool tied : {false, true}) {
    auto src_config = tiny(tied), model_config = tiny(tied);
    model_config.vocab_size = 64;  // 14 rows more than the source's 50
    const Named src = reference(src_config, at::kBFloat16);
    const Named want = grown(src, 64);
    const std::string dir = write_dir("import-grow", src, 2);
    // 3 ranks split rows mid-way; NO_SHARD's replicas must not count the source rows twice.
    for (const Case k : {Case{1, ShardingStrategy::kFullShard}, Case{2, ShardingStrategy::kFullShard},
                         Case{3, ShardingStrategy::kFullShard}, Case{2, ShardingStrategy::kNoShard}}) {
      testing::run_threads(k.ranks, [&](const std::shared_ptr<Dist>& dist) {
        DeviceMesh mesh(dist);
        llama::LlamaForCausalLM model(model_config, at::kMeta);
        auto opts = FullyShardOptions().strategy(k.strategy).init(init::constant(0.0));
        for (auto& layer : model->model->layers) fully_shard(layer, mesh, opts);
        auto root = fully_shard(model, mesh, opts);
        const auto report = checkpoint::import_weights(
            dir, *root, checkpoint::ImportOptions().grow_rows({"model.embed_tokens.weight", "lm_head.weight"}));
        std::vector<std::string> expect = {"model.embed_tokens.weight: 50 -> 64 rows"};
        if (!tied) expect.push_back("lm_head.weight: 50 -> 64 rows");
        EXPECT_EQ(report.grown, expect);
        expect_shards_equal(*root, want, dist->rank());
      });
    }
  }
}

TEST(Import, GrowingIsOnlyForTheNamedTensorsAndNeverShrinks) {
  auto small = tiny(false), big = tiny(false);
  big.vocab_size = 64;
  const std::string from_small = write_dir("import-small", reference(small, at::kBFloat16), 1);
  // Without grow_rows the larger model is refused as before.
  EXPECT_NE(import_error(big, from_small)
                .find("tensor 'model.embed_tokens.weight' has shape [50, 16] but the "
                      "model's has shape [64, 16]"),
            std::string::npos);
  // A source with more rows than the model: refused, even for a tensor that may grow.
  const std::string from_big = write_dir("import-big", reference(big, at::kBFloat16), 1);
  std::string message;
  auto dist = Dist::single();
  DeviceMesh mesh(dist);
  auto m = sharded(small, mesh);
  try {
    checkpoint::import_weights(from_big, *m.root,
                               checkpoint::ImportOptions().grow_rows({"model.embed_tokens.weight", "lm_head.weight"}));
  } catch (const CheckpointError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("'lm_head.weight' has shape [64, 16] but the model's has shape [50, 16]: its rows can grow "
                         "(a larger vocabulary), not shrink"),
            std::string::npos)
      << message;
}

TEST(Import, UnshardedModuleFromAHuggingFaceDirectory) {
  for (bool tied : {false, true}) {
    const auto c = tiny(tied);
    const Named ref = reference(c, at::kBFloat16);
    const std::string dir = write_dir("import-unsharded", ref, 2);
    llama::LlamaForCausalLM model(c, at::kCPU);
    const auto report = checkpoint::import_unsharded(dir, *model);
    EXPECT_EQ(report.tensors, static_cast<int64_t>(ref.size()));
    EXPECT_EQ(report.bytes_read, report.total_bytes);
    const auto params = model->named_parameters();
    for (const auto& [name, t] : ref) EXPECT_TRUE(at::equal(params[name], t.to(at::kFloat))) << name;
    EXPECT_EQ(model->lm_head->weight.data_ptr() == model->model->embed_tokens->weight.data_ptr(), tied);
  }
  // A bad directory is refused naming the tensor, and the module keeps its values.
  const auto c = tiny(false);
  llama::LlamaForCausalLM model(c, at::kCPU);
  const at::Tensor before = model->lm_head->weight.clone();
  const std::string dir = write_dir("import-unsharded-bad", without(reference(c, at::kBFloat16), "lm_head.weight"), 1);
  try {
    checkpoint::import_unsharded(dir, *model);
    ADD_FAILURE() << "accepted a directory without lm_head.weight";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("missing tensor 'lm_head.weight'"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(at::equal(model->lm_head->weight, before));
}

}  // namespace
}  // namespace fsdp
