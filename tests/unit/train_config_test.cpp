// fsdp-train's config and command line (apps/fsdp-train/config.h, flags.h): the built-in defaults,
// file + override precedence, strict rejection naming the dotted key and value, flag errors, and
// the stability of config_hash.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config.h"
#include "config_fields.h"
#include "flags.h"
#include "base/strings.h"
#include "run_plan.h"
#include "shape.h"
#include "support/ranks.h"

namespace {

using nlohmann::json;
using train::TrainConfig;

// Runs parse_flags + config_from_flags on argv (without the program name).
TrainConfig from_args(std::vector<std::string> args) {
  args.insert(args.begin(), "fsdp-train");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return train::config_from_flags(train::parse_flags(static_cast<int>(argv.size()), argv.data()));
}

train::Flags flags_of(std::vector<std::string> args) {
  args.insert(args.begin(), "fsdp-train");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  return train::parse_flags(static_cast<int>(argv.size()), argv.data());
}

std::string write_file(const std::string& stem, const std::string& text) {
  const std::string path = fsdp::testing::temp_path(stem);
  std::ofstream(path) << text;
  return path;
}

// The message of the std::invalid_argument `fn` throws ("" and a test failure when none).
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument";
  return "";
}

std::string config_error(const json& doc) {
  return error_of([&] { TrainConfig::from_json(doc); });
}

std::string args_error(const std::vector<std::string>& args) {
  return error_of([&] { from_args(args); });
}

TEST(TrainConfig, DefaultsAreTheSmallBuiltInJob) {
  const TrainConfig c;
  EXPECT_EQ(c.model.vocab_size, 256);
  EXPECT_EQ(c.model.hidden_size, 128);
  EXPECT_EQ(c.model.num_hidden_layers, 4);
  EXPECT_EQ(c.data.source, train::DataSource::kSynthetic);
  EXPECT_EQ(c.data.seq_len, 64);
  EXPECT_EQ(c.data.batch_size_per_rank, 16);
  EXPECT_EQ(c.fsdp.strategy, fsdp::ShardingStrategy::kFullShard);
  EXPECT_EQ(c.fsdp.param_dtype, at::kFloat);
  EXPECT_EQ(c.optim.schedule, train::Schedule::kCosine);
  EXPECT_EQ(c.train.steps, 200);
  // An empty document and no flags at all are the defaults.
  EXPECT_EQ(TrainConfig::from_json(json::object()).to_json(), c.to_json());
  EXPECT_EQ(from_args({}).to_json(), c.to_json());
}

TEST(TrainConfig, ToJsonListsEveryKeyAndRoundTrips) {
  TrainConfig c =
      from_args({"--set", "fsdp.strategy=HYBRID_SHARD", "--set", "fsdp.replicate=2", "--set", "fsdp.param_dtype=bf16",
                 "--set", "optim.schedule=constant", "--set", "fsdp.device=cuda", "--seed", "7"});
  const json j = c.to_json();
  for (const char* section : {"model", "data", "optim", "fsdp", "train"}) EXPECT_TRUE(j.contains(section)) << section;
  EXPECT_EQ(j["fsdp"]["strategy"], "HYBRID_SHARD");
  EXPECT_EQ(j["fsdp"]["param_dtype"], "bfloat16");
  EXPECT_EQ(j["fsdp"]["offload"]["params"], "none");
  EXPECT_EQ(j["fsdp"]["device"], "cuda");
  EXPECT_EQ(j["optim"]["betas"], json::array({0.9, 0.95}));
  EXPECT_EQ(j["train"]["seed"], 7);
  EXPECT_EQ(j["model"]["num_hidden_layers"], 4);
  EXPECT_EQ(TrainConfig::from_json(j).to_json(), j);
}

TEST(TrainConfig, FileThenOverridesInCommandLineOrder) {
  const auto path = write_file("train_cfg.json", R"({
    "model": {"num_hidden_layers": 2},
    "optim": {"lr": 0.01, "warmup_steps": 3},
    "train": {"steps": 5, "seed": 11}
  })");
  // --set before --config still applies after the file; later overrides win over earlier ones.
  const TrainConfig c =
      from_args({"--set", "optim.lr=0.02", "--config", path, "--steps", "7", "--set", "optim.betas=[0.8, 0.9]", "--set",
                 "fsdp.strategy=SHARD_GRAD_OP", "--set", "train.steps=9", "--data", "corpus.txt"});
  EXPECT_DOUBLE_EQ(c.optim.lr, 0.02);
  EXPECT_EQ(c.optim.warmup_steps, 3);  // from the file
  EXPECT_EQ(c.train.steps, 9);         // the last override
  EXPECT_EQ(c.train.seed, 11u);
  EXPECT_DOUBLE_EQ(c.optim.betas[0], 0.8);
  EXPECT_DOUBLE_EQ(c.optim.betas[1], 0.9);
  EXPECT_EQ(c.fsdp.strategy, fsdp::ShardingStrategy::kShardGradOp);
  EXPECT_EQ(c.data.source, train::DataSource::kFile);
  EXPECT_EQ(c.data.path, "corpus.txt");
  // The model section is laid over the trainer's defaults, not transformers' 7B ones.
  EXPECT_EQ(c.model.num_hidden_layers, 2);
  EXPECT_EQ(c.model.hidden_size, 128);
}

TEST(TrainConfig, SetValuesAreJsonWhenTheyParseElseStrings) {
  json doc = json::object();
  train::set_dotted(doc, "optim.lr", "3e-4");
  train::set_dotted(doc, "fsdp.strategy", "NO_SHARD");
  train::set_dotted(doc, "fsdp.offload.dir", "/tmp/x");
  train::set_dotted(doc, "model.tie_word_embeddings", "true");
  EXPECT_TRUE(doc["optim"]["lr"].is_number_float());
  EXPECT_EQ(doc["fsdp"]["strategy"], "NO_SHARD");
  EXPECT_EQ(doc["fsdp"]["offload"]["dir"], "/tmp/x");
  EXPECT_EQ(doc["model"]["tie_word_embeddings"], true);
  // A file name that looks like a number is still a path through --data.
  EXPECT_EQ(from_args({"--data", "123"}).data.path, "123");
}

TEST(TrainConfig, HeadCountWithoutKvHeadsMeansPlainMultiHead) {
  const TrainConfig c = from_args({"--set", "model.num_attention_heads=8"});
  EXPECT_EQ(c.model.num_key_value_heads, 8);
  const TrainConfig g = from_args({"--set", "model.num_attention_heads=8", "--set", "model.num_key_value_heads=2"});
  EXPECT_EQ(g.model.num_key_value_heads, 2);
}

// fsdp.split_root auto splits an untied embedding and head out of the root only when the plan's
// peak falls by kSplitRootMinGain (16 MiB) or more: a small model whose tables weigh little stays whole (its
// choice flipped with settings that move the peak by a few hundred KiB, and with it the losses'
// last bits), a Llama-3.1-8B-shaped one splits, a tied one cannot.
TEST(TrainConfig, SplitRootAutoNeedsAGainWorthTheExtraGather) {
  const std::vector<std::string> small = {"--set", "model.vocab_size=256",
                                          "--set", "model.hidden_size=64",
                                          "--set", "model.intermediate_size=128",
                                          "--set", "model.num_hidden_layers=4",
                                          "--set", "model.num_attention_heads=4",
                                          "--set", "model.num_key_value_heads=4",
                                          "--set", "data.seq_len=64",
                                          "--set", "data.batch_size_per_rank=8",
                                          "--set", "model.tie_word_embeddings=false"};
  for (const char* group : {"fsdp.reshard_after_forward_group=0", "fsdp.reshard_after_forward_group=2"}) {
    std::vector<std::string> args = small;
    args.insert(args.end(), {"--set", group});
    const TrainConfig c = from_args(args);
    EXPECT_FALSE(train::resolve(c, 4, 1).split_root) << group;
  }
  const TrainConfig big = from_args({"--set", "model.vocab_size=128256",
                                     "--set", "model.hidden_size=4096",
                                     "--set", "model.intermediate_size=14336",
                                     "--set", "model.num_hidden_layers=32",
                                     "--set", "model.num_attention_heads=32",
                                     "--set", "model.num_key_value_heads=8",
                                     "--set", "model.tie_word_embeddings=false",
                                     "--set", "data.seq_len=128",
                                     "--set", "data.batch_size_per_rank=1",
                                     "--set", "lora.r=16",
                                     "--set", "lora.base_dtype=nf4"});
  // A LoRA run keeps its frozen tables vocab-parallel (fsdp.vocab_parallel auto): nothing to split.
  EXPECT_FALSE(train::resolve(big, 2, 1).split_root);
  TrainConfig gathered = big;
  gathered.fsdp.vocab_parallel = train::Switch::kOff;
  EXPECT_TRUE(train::resolve(gathered, 2, 1).split_root);
  TrainConfig tied = gathered;
  tied.model.tie_word_embeddings = true;
  EXPECT_FALSE(train::resolve(tied, 2, 1).split_root);
}

// fsdp.vocab_parallel: auto is on exactly when the tables are frozen (LoRA without lm_head among its
// targets); "on" otherwise, or beside fsdp.split_root=on, is refused naming the keys. The plan of a
// vocab-parallel run gathers no table.
TEST(TrainConfig, VocabParallelAutoWhenTheTablesAreFrozen) {
  using train::resolve;
  const TrainConfig lora = from_args({"--set", "lora.r=8", "--set", "model.tie_word_embeddings=false"});
  EXPECT_TRUE(resolve(lora, 2, 1).vocab_parallel);
  TrainConfig head_trained = lora;
  head_trained.lora.targets.push_back("lm_head");
  EXPECT_FALSE(resolve(head_trained, 2, 1).vocab_parallel);
  TrainConfig head_by_pattern = lora;  // a regular expression reaches the head too
  head_by_pattern.lora.targets = {".*_proj", "lm_he[a]d"};
  EXPECT_FALSE(resolve(head_by_pattern, 2, 1).vocab_parallel);
  const TrainConfig full = from_args({});
  EXPECT_FALSE(resolve(full, 2, 1).vocab_parallel);
  TrainConfig forced = full;
  forced.fsdp.vocab_parallel = train::Switch::kOn;
  try {
    resolve(forced, 2, 1);
    ADD_FAILURE() << "fsdp.vocab_parallel=on without a frozen base was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fsdp.vocab_parallel=on"), std::string::npos) << e.what();
  }
  TrainConfig both = lora;
  both.fsdp.split_root = train::Switch::kOn;
  try {
    resolve(both, 2, 1);
    ADD_FAILURE() << "fsdp.split_root=on beside vocab-parallel tables was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fsdp.split_root=on"), std::string::npos) << e.what();
  }
  auto plan_of = [](const TrainConfig& c) {
    const train::Resolved r = resolve(c, 2, 1);
    return fsdp::plan(train::plan_shape(c, r), train::plan_request(c, r, 2, 1));
  };
  TrainConfig off = lora;
  off.fsdp.vocab_parallel = train::Switch::kOff;
  const fsdp::Plan plan = plan_of(lora), gathered = plan_of(off);
  EXPECT_LT(plan.all_gather_bytes, gathered.all_gather_bytes);
  EXPECT_LT(plan.device.total(), gathered.device.total());
}

// The "auto / on / off" keys are read into an enum (a misspelt value is refused naming the key) and
// resolved once; train.save_in_step auto follows the disk tier, on is kept, off is off.
TEST(TrainConfig, SwitchesAreReadOnceAndResolved) {
  EXPECT_EQ(from_args({"--set", "fsdp.split_root=off"}).fsdp.split_root, train::Switch::kOff);
  EXPECT_EQ(from_args({}).to_json()["train"]["save_in_step"], "auto");
  try {
    from_args({"--set", "fsdp.vocab_parallel=yes"});
    ADD_FAILURE() << "fsdp.vocab_parallel=yes was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fsdp.vocab_parallel=\"yes\""), std::string::npos) << e.what();
  }
  const TrainConfig disk = from_args({"--set", "fsdp.offload.optimizer_state=disk", "--set", "fsdp.offload.dir=/tmp"});
  EXPECT_TRUE(train::resolve(disk, 1, 1).save_in_step);
  EXPECT_FALSE(train::resolve(from_args({}), 1, 1).save_in_step);
  EXPECT_TRUE(train::resolve(from_args({"--set", "train.save_in_step=on"}), 1, 1).save_in_step);
  TrainConfig off = disk;
  off.train.save_in_step = train::Switch::kOff;
  EXPECT_FALSE(train::resolve(off, 1, 1).save_in_step);
}

// The end-of-run report sets each lever measured beside the library's plan of the run: its items,
// not formulas of fsdp-train's own. With 4 micro-batches every gradient buffer (the step's and the
// unreduced rest) is alive between them: the whole model's gradients in the compute dtype.
TEST(TrainConfig, LeverReportReadsThePlansItems) {
  const TrainConfig c =
      from_args({"--set", "train.grad_accum_steps=4", "--set", "train.async_save=true", "--set",
                 "train.budget.host_bytes=1000000000000", "--set", "train.budget.disk_bytes=1000000000000"});
  const train::RunPlan run = train::plan_run(c, fsdp::LoadKind::kInit, true);
  ASSERT_TRUE(run.plan.has_value());
  train::MeasuredLevers got;
  got.activations = got.accum_grads = got.async_snapshot = 1 << 20;
  got.partial_grads = 1 << 20;  // no replicas: the plan has no partial sums, so none is reported
  const auto report = train::lever_report(*run.plan, got);
  ASSERT_TRUE(report.contains("activations") && report.contains("accumulated_gradients") &&
              report.contains("async_snapshot"))
      << report.dump();
  EXPECT_FALSE(report.contains("partial_gradient_sums")) << report.dump();
  const int64_t params = llama::param_counts(c.model).total(c.model);
  EXPECT_EQ(report["accumulated_gradients"]["plan"].get<int64_t>(), 4 * params);
  // The activations of one micro-batch of 16: the root's and every layer's (Note [Activation bytes]).
  const int64_t B = c.data.batch_size_per_rank, T = c.data.seq_len;
  EXPECT_EQ(report["activations"]["plan"].get<int64_t>(),
            llama::root_activation_bytes(c.model, B, T, at::kFloat, 0) +
                c.model.num_hidden_layers * llama::layer_activation_bytes(c.model, B, T, at::kFloat));
  // The snapshot: the fp32 master and AdamW's two moments of this (only) rank's shard.
  EXPECT_EQ(report["async_snapshot"]["plan"].get<int64_t>(), 12 * params);
  EXPECT_DOUBLE_EQ(report["activations"]["error"].get<double>(),
                   static_cast<double>((1 << 20) - report["activations"]["plan"].get<int64_t>()) /
                       report["activations"]["plan"].get<double>());
}

// train.budget keeps fsdp-plan's margin by default (fsdp::kDefaultMargin, 10%): a run whose plan
// peaks at 95% of the budget is refused, naming the budget, the plan and the margin; with
// train.budget.margin_pct=0 the same run goes on.
TEST(TrainConfig, BudgetCheckKeepsFsdpPlansMargin) {
  EXPECT_DOUBLE_EQ(TrainConfig().train.budget_margin_pct, 100 * fsdp::kDefaultMargin);
  const std::vector<std::string> disk = {"--set", "train.budget.disk_bytes=1000000000000"};
  std::vector<std::string> args = disk;
  args.insert(args.end(), {"--set", "train.budget.host_bytes=1000000000000"});
  const int64_t peak = train::plan_run(from_args(args), fsdp::LoadKind::kInit, false).plan->peak();
  const int64_t budget = static_cast<int64_t>(static_cast<double>(peak) / 0.95);
  args = disk;
  args.insert(args.end(), {"--set", "train.budget.host_bytes=" + std::to_string(budget)});
  const TrainConfig tight = from_args(args);
  const train::RunPlan run = train::plan_run(tight, fsdp::LoadKind::kInit, false);
  ASSERT_TRUE(run.plan.has_value());
  EXPECT_FALSE(run.plan->fits);
  EXPECT_EQ(run.plan->margin_bytes, static_cast<int64_t>(static_cast<double>(budget) * fsdp::kDefaultMargin));
  try {
    train::check_budget(tight, run);
    ADD_FAILURE() << "a plan at 95% of the budget was accepted with a 10% margin";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    for (const std::string& part : {fsdp::base::mib(budget, 1), fsdp::base::mib(run.plan->peak(), 1),
                                    std::string("margin of 10% held free"), std::string("train.budget.margin_pct")}) {
      EXPECT_NE(what.find(part), std::string::npos) << part << " not in: " << what;
    }
  }
  EXPECT_NE(train::plan_summary(run).find("margin held free " + fsdp::base::mib(run.plan->margin_bytes, 1)),
            std::string::npos)
      << train::plan_summary(run);
  args.insert(args.end(), {"--set", "train.budget.margin_pct=0"});
  const TrainConfig none = from_args(args);
  const train::RunPlan kept = train::plan_run(none, fsdp::LoadKind::kInit, false);
  EXPECT_TRUE(kept.plan->fits) << kept.plan->to_string();
  EXPECT_NO_THROW(train::check_budget(none, kept));
  EXPECT_THROW(from_args({"--set", "train.budget.margin_pct=91"}), std::invalid_argument);
}

// Note [fsdp-train's threads]: FSDP_THREADS, else OMP_NUM_THREADS (as fsdp-run and torchrun set it),
// else the rank's share of the cores.
TEST(TrainConfig, IntraOpThreadsFollowFsdpThreadsThenOmpThenTheRanksShare) {
  EXPECT_EQ(train::intra_op_threads("3", "2", "2", 16), 3);
  EXPECT_EQ(train::intra_op_threads(nullptr, "2", "2", 16), 2);
  EXPECT_EQ(train::intra_op_threads(nullptr, "4,2", nullptr, 16), 4);  // OpenMP's nested list: its first level
  EXPECT_EQ(train::intra_op_threads(nullptr, nullptr, "2", 16), 8);
  EXPECT_EQ(train::intra_op_threads(nullptr, nullptr, nullptr, 2), 2);  // one process: every core
  EXPECT_EQ(train::intra_op_threads(nullptr, nullptr, "4", 2), 1);      // more ranks than cores: one each
  EXPECT_EQ(train::intra_op_threads(nullptr, "0", "2", 16), 8);         // not a thread count: the share
  EXPECT_THROW(train::intra_op_threads("0", nullptr, nullptr, 2), train::UsageError);
  EXPECT_THROW(train::intra_op_threads("many", nullptr, nullptr, 2), train::UsageError);
}

TEST(TrainConfig, UnknownKeysAreRejectedNamingTheDottedKey) {
  EXPECT_NE(config_error({{"optim", {{"lrr", 0.1}}}}).find("optim.lrr=0.1: unknown key"), std::string::npos);
  EXPECT_NE(config_error({{"fsdp", {{"offload", {{"param", "host"}}}}}}).find("fsdp.offload.param=\"host\""),
            std::string::npos);
  EXPECT_NE(config_error({{"optimizer", json::object()}}).find("optimizer={}: unknown section"), std::string::npos);
  EXPECT_NE(config_error({{"model", {{"hiden_size", 64}}}}).find("model.hiden_size=64"), std::string::npos);
  EXPECT_NE(args_error({"--set", "train.stepz=3"}).find("train.stepz=3: unknown key"), std::string::npos);
}

// The model section takes a published config.json as it is (Llama-3.2-1B's, less its bulk): the keys
// every such file carries are accepted when they hold what the model implements, refused by name
// when they do not.
TEST(TrainConfig, ModelSectionTakesAPublishedConfigJson) {
  const json published = json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})");
  const TrainConfig c = TrainConfig::from_json({{"model", published}});
  EXPECT_EQ(c.model.hidden_size, 2048);
  EXPECT_EQ(c.model.num_key_value_heads, 8);
  EXPECT_EQ(c.model.rope_scaling.rope_type, "llama3");
  EXPECT_EQ(c.model.rope_scaling.factor, 32.0);
  EXPECT_EQ(c.model.dtype, "bfloat16");
  EXPECT_TRUE(c.model.tie_word_embeddings);
  // What it writes back reads back the same.
  EXPECT_EQ(TrainConfig::from_json(c.to_json()).model.to_json(), c.model.to_json());
  // Keys the model does not implement, by name, in the dotted form.
  json gelu = published;
  gelu["hidden_act"] = "gelu";
  EXPECT_NE(config_error({{"model", gelu}}).find("config: model.hidden_act=\"gelu\" is not supported"),
            std::string::npos)
      << config_error({{"model", gelu}});
  json bias = published;
  bias["mlp_bias"] = true;
  EXPECT_NE(config_error({{"model", bias}}).find("model.mlp_bias=true"), std::string::npos);
  json yarn = published;
  yarn["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_NE(config_error({{"model", yarn}}).find("rope_type=\"yarn\" is not supported"), std::string::npos);
  // The same through --set.
  EXPECT_NE(args_error({"--set", "model.hidden_act=relu"}).find("model.hidden_act=\"relu\""), std::string::npos);
  EXPECT_EQ(from_args({"--set", "model.hidden_act=silu", "--set", "model.mlp_bias=false"}).model.hidden_size, 128);
}

TEST(TrainConfig, WrongTypesAndInvalidValuesAreRejectedNamingKeyAndValue) {
  struct Case {
    std::string set, expect;
  };
  const std::vector<Case> cases = {
      {"optim.lr=fast", "optim.lr=\"fast\": must be a number"},
      {"optim.lr=-1", "optim.lr=-1: invalid learning rate"},
      {"optim.eps=-1", "optim.eps=-1: invalid eps"},
      // The library validates these (fsdp::check_options, WarmupCosine); the error names the key.
      {"optim.weight_decay=-0.5", "optim.weight_decay=-0.5: invalid weight_decay"},
      {"optim.warmup_steps=-1", "optim.warmup_steps=-1: WarmupCosine needs warmup_steps >= 0"},
      {"fsdp.loss_scale_init=0", "fsdp.loss_scale_init=0: GradScaler init_scale must be finite and > 0"},
      {"fsdp.loss_scale_growth_interval=0",
       "fsdp.loss_scale_growth_interval=0: GradScaler growth_interval must be >= 1"},
      {"fsdp.offload.memory_budget_bytes=-1",
       "fsdp.offload.memory_budget_bytes=-1: offload.memory_budget_bytes=-1 must be >= 0"},
      {"train.max_consecutive_skips=-1",
       "train.max_consecutive_skips=-1: GradScaler max_consecutive_skips must be >= 0"},
      {"optim.betas=[0.9]", "optim.betas=[0.9]: must be a list of two numbers"},
      {"optim.betas=[0.9,1.0]", "optim.betas=[0.9,1.0]: invalid beta2: 1.000000 (must be in [0, 1))"},
      {"optim.schedule=linear", "optim.schedule=\"linear\": must be one of \"cosine\", \"constant\""},
      {"optim.min_lr=1", "optim.min_lr=1.0: exceeds optim.lr=0.006"},
      {"data.seq_len=0", "data.seq_len=0: must be >= 1"},
      {"data.seq_len=4096", "data.seq_len=4096: exceeds model.max_position_embeddings=1024"},
      {"data.batch_size_per_rank=2.5", "data.batch_size_per_rank=2.5: must be an integer"},
      {"data.source=file", "data.path=\"\": must name a file"},
      {"data.source=hdf5", "data.source=\"hdf5\""},
      {"fsdp.strategy=ZERO3", "fsdp.strategy=\"ZERO3\": must be one of"},
      {"fsdp.param_dtype=int8", "fsdp.param_dtype=\"int8\""},
      {"fsdp.reduce_dtype=16", "fsdp.reduce_dtype=16"},
      {"fsdp.prefetch_depth=-1", "fsdp.prefetch_depth=-1: must be >= 0"},
      {"fsdp.timeout_s=0", "fsdp.timeout_s=0: InitOptions::timeout must be positive, got 0 ms"},
      {"fsdp.replicate=2", "fsdp.replicate=2: needs fsdp.strategy=\"HYBRID_SHARD\""},
      {"fsdp.offload.params=gpu", "fsdp.offload.params=\"gpu\""},
      {"fsdp.device=tpu", "fsdp.device=\"tpu\": must be one of"},
      {"fsdp.offload.optimizer_state=disk", "fsdp.offload: fsdp: offload.dir is empty"},
      {"train.steps=-3", "train.steps=-3: must be >= 0"},
      {"train.seed=-1", "train.seed=-1: must be a non-negative integer"},
      {"train.log_every=0", "train.log_every=0: must be >= 1"},
      {"model.hidden_size=130", "model.hidden_size=130 is not divisible by num_attention_heads=4"},
      {"model.vocab_size=big", "model.vocab_size=\"big\""},
      {"optim=3", "optim=3: must be an object"},
      {"optim.lr.x=1", "optim.lr={\"x\":1}: must be a number"},
  };
  for (const auto& c : cases) {
    const std::string what = args_error({"--set", c.set});
    EXPECT_NE(what.find(c.expect), std::string::npos) << "--set " << c.set << " gave: " << what;
  }
  EXPECT_NE(args_error({"--set", "optim.lr=1", "--set", "optim.lr.x=1"}).find("optim.lr=1: is not an object"),
            std::string::npos);
  EXPECT_NE(args_error({"--set", "fsdp.strategy=HYBRID_SHARD"}).find("fsdp.replicate=1: must be >= 2"),
            std::string::npos);
  EXPECT_NE(args_error({"--set", "optim.state_dtype=float16"}).find("optim.state_dtype=\"float16\": must be one of"),
            std::string::npos);
  EXPECT_NE(args_error({"--set", "optim.state_dtype=bfloat16", "--set", "fsdp.offload.optimizer_state=disk", "--set",
                        "fsdp.offload.dir=/tmp/x"})
                .find("optim.state_dtype=\"bfloat16\": cannot go with fsdp.offload.optimizer_state=\"disk\""),
            std::string::npos);
  EXPECT_EQ(from_args({"--set", "optim.state_dtype=bfloat16"}).optim.adamw().state_dtype(), at::kBFloat16);
  EXPECT_NE(args_error({"--set", "optim.step_in_backward=true", "--set", "train.grad_accum_steps=2", "--set",
                        "train.accumulation=reduce"})
                .find("train.accumulation=\"reduce\": cannot go with optim.step_in_backward=true"),
            std::string::npos);
  EXPECT_NE(
      args_error({"--set", "train.accumulation=sometimes"}).find("train.accumulation=\"sometimes\": must be one of"),
      std::string::npos);
}

TEST(TrainConfig, ConfigFileErrorsNameTheFile) {
  EXPECT_NE(args_error({"--config", "/nonexistent/train.json"}).find("'/nonexistent/train.json': cannot be opened"),
            std::string::npos);
  const auto broken = write_file("train_broken.json", "{\"optim\": ");
  EXPECT_NE(args_error({"--config", broken}).find("not valid JSON"), std::string::npos);
  const auto array = write_file("train_array.json", "[1, 2]");
  EXPECT_NE(args_error({"--config", array}).find("must hold a JSON object"), std::string::npos);
}

TEST(TrainFlags, ParsesEveryFlagInBothForms) {
  const auto f = flags_of({"--config", "c.json", "--save-dir=ckpt", "--resume", "latest", "--metrics", "m.jsonl",
                           "--trace=t.json", "--steps=12", "--seed", "3", "--set", "optim.lr=1e-3"});
  EXPECT_EQ(f.config_path, "c.json");
  EXPECT_EQ(f.save_dir, "ckpt");
  EXPECT_EQ(f.resume, "latest");
  EXPECT_EQ(f.metrics, "m.jsonl");
  EXPECT_EQ(f.trace, "t.json");
  ASSERT_EQ(f.overrides.size(), 3u);
  EXPECT_EQ(f.overrides[0], std::make_pair(std::string("train.steps"), std::string("12")));
  EXPECT_EQ(f.overrides[1], std::make_pair(std::string("train.seed"), std::string("3")));
  EXPECT_EQ(f.overrides[2], std::make_pair(std::string("optim.lr"), std::string("1e-3")));
  EXPECT_TRUE(flags_of({"--help"}).help);
  EXPECT_FALSE(f.init_only);
  EXPECT_TRUE(flags_of({"--init-only"}).init_only);
  EXPECT_FALSE(f.allow_schedule_change);
  EXPECT_TRUE(flags_of({"--allow-schedule-change"}).allow_schedule_change);
}

TEST(TrainFlags, BadFlagsAreRejectedNamingThem) {
  auto usage_error = [](const std::vector<std::string>& args) {
    try {
      flags_of(args);
    } catch (const train::UsageError& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << "expected a UsageError";
    return std::string();
  };
  EXPECT_NE(usage_error({"--stepz", "3"}).find("unknown flag --stepz"), std::string::npos);
  EXPECT_NE(usage_error({"-x"}).find("unknown flag -x"), std::string::npos);
  EXPECT_NE(usage_error({"stray"}).find("unexpected argument 'stray'"), std::string::npos);
  EXPECT_NE(usage_error({"--steps"}).find("flag --steps needs a value"), std::string::npos);
  EXPECT_NE(usage_error({"--steps", "ten"}).find("--steps expects a non-negative integer, got 'ten'"),
            std::string::npos);
  EXPECT_NE(usage_error({"--seed", "-1"}).find("--seed expects a non-negative integer, got '-1'"), std::string::npos);
  EXPECT_NE(usage_error({"--set", "optim.lr"}).find("expects KEY=VALUE"), std::string::npos);
  EXPECT_NE(usage_error({"--set", "=1"}).find("expects KEY=VALUE"), std::string::npos);
  EXPECT_NE(usage_error({"--init-only=1"}).find("--init-only takes no value"), std::string::npos);
  EXPECT_NE(usage_error({"--allow-schedule-change=yes"}).find("--allow-schedule-change takes no value"),
            std::string::npos);
  EXPECT_NE(usage_error({"--resume", "latest"}).find("--resume latest needs --save-dir"), std::string::npos);
  EXPECT_NE(usage_error({"--help=yes"}).find("--help takes no value"), std::string::npos);
}

TEST(TrainConfig, HashIsStableAndCoversOnlyModelAndDataStream) {
  const TrainConfig base;
  const std::string h = base.config_hash();
  ASSERT_EQ(h.size(), 16u);
  EXPECT_EQ(h.find_first_not_of("0123456789abcdef"), std::string::npos);
  // Independent of how the config was reached.
  EXPECT_EQ(TrainConfig::from_json(base.to_json()).config_hash(), h);
  EXPECT_EQ(from_args({"--set", "model.hidden_size=128"}).config_hash(), h);
  // Pinned: FNV-1a over the canonical JSON of the default model and data stream. A change here
  // means checkpoints saved before no longer resume; change it only on purpose.
  EXPECT_EQ(h, "0d63ae6f22e4ff4d");
  // Training knobs and the per-rank batch (which changes with the world size) are not identity.
  for (const char* set :
       {"optim.lr=0.01", "train.steps=9", "data.batch_size_per_rank=2", "fsdp.strategy=NO_SHARD", "train.seed=5"}) {
    EXPECT_EQ(from_args({"--set", set}).config_hash(), h) << set;
  }
  // The model and the sample stream are.
  for (const char* set : {"model.hidden_size=64", "model.rope_theta=500", "data.seq_len=32"}) {
    EXPECT_NE(from_args({"--set", set}).config_hash(), h) << set;
  }
  EXPECT_NE(from_args({"--data", "a.txt"}).config_hash(), from_args({"--data", "b.txt"}).config_hash());
}

}  // namespace

namespace {

// --help lists every key of the field table with its default, and the dump holds exactly the
// table's keys (and the model section): the one table serves both.
TEST(TrainFlags, HelpAndDumpListEveryKeyOfTheTable) {
  const std::string help = train::help_text();
  const json dump = TrainConfig().to_json();
  size_t keys = 0;
  for (const auto& f : train::config_fields()) {
    std::string pointer = "/" + f.dotted();
    for (char& ch : pointer)
      if (ch == '.') ch = '/';
    ASSERT_TRUE(dump.contains(json::json_pointer(pointer))) << f.dotted();
    const std::string line = "  " + f.dotted() + " = " + dump[json::json_pointer(pointer)].dump() + "  (";
    EXPECT_NE(help.find(line), std::string::npos) << line;
    ++keys;
  }
  size_t dumped = 0;
  for (const auto& [section, body] : dump.items()) {
    if (section == "model") continue;
    for (const auto& [k, v] : body.items()) dumped += v.is_object() ? v.size() : 1;
  }
  EXPECT_EQ(dumped, keys);
  EXPECT_NE(help.find("    model.vocab_size = 256"), std::string::npos);
}

}  // namespace
