// The planner's phases and its process (fsdp/plan.h): the load and the save as phases of their own,
// the process item as the process measured it, the heap's slack, and a base larger than memory
// streamed from the disk tier.
#include <gtest/gtest.h>

#include <string>

#include "fsdp/errors.h"
#include "fsdp/plan.h"
#include "llama.h"
#include "plan_support.h"
#include "shape.h"

namespace fsdp {
namespace {

// Note [The load and the save]: the load holds the states as loaded (no gradient, no optimizer
// state unless resumed), the largest stored frozen shard in fp32 while it is stored (an import
// stores each chunk as read instead: a chunk's stored form), and an import's staging; a save holds the step's states
// and, with the frozen params in the checkpoint, the largest stored frozen shard in fp32 while it is written. fits
// counts the largest phase, and the shortfall names it. The export (one process) converts a chunk of rows at a time:
// not in the peak.
TEST(Plan, TheLoadAndTheSaveArePhasesOfTheirOwn) {
  ModelShape shape;
  shape.units.push_back({"root", 1000, 0, {}, nullptr, nullptr, 0, true, false});
  for (int i = 0; i < 3; ++i) {
    shape.units.push_back({"layers." + std::to_string(i), 4000, 2000000, {{FrozenStorage::kNF4, 2000000}}});
  }
  PlanRequest r = request(int64_t{8} << 30);
  r.param_dtype = at::kFloat;
  r.micro_batch = 4;
  r.strategy = ShardingStrategy::kFullShard;
  r.offload = OffloadPolicy();
  auto item = [](const PlanTier& t, const std::string& prefix) {
    for (const auto& [n, bytes] : t.items) {
      if (n.rfind(prefix, 0) == 0) return bytes;
    }
    return int64_t{-1};
  };
  const int64_t masters = 4 * (500 + 3 * 2000);
  const int64_t nf4 = 3 * (500000 + 1000000 * 4 / 64);  // NF4: half a byte per value, an fp32 scale per 64
  const int64_t window = 4 * 1000000, staging = int64_t{24} << 20;
  const int64_t stored_chunk = (int64_t{4} << 20) * 17 / 16;  // 4M values as int8, the widest blocks

  r.load = LoadKind::kInit;
  const Plan init = plan(shape, r);
  EXPECT_EQ(item(init.load, "sharded states once loaded"), masters + nf4) << init.to_string();
  EXPECT_EQ(item(init.load, "a stored frozen shard's fp32 values"), window);
  EXPECT_EQ(init.load.total(), (100 << 20) + masters + nf4 + window);
  EXPECT_TRUE(init.save.items.empty());  // saves nothing

  r.load = LoadKind::kImport;
  r.saves = true;
  const Plan imported = plan(shape, r);
  EXPECT_EQ(item(imported.load, "a stored frozen shard's fp32 values"), -1) << imported.to_string();
  EXPECT_EQ(imported.load.total(), init.load.total() - window + stored_chunk + staging);
  // The save: the step's states (masters, gradients, two moments) and one stored shard decoded at
  // a time.
  EXPECT_EQ(item(imported.save, "sharded states"), item(imported.device, "sharded states not offloaded"));
  EXPECT_EQ(item(imported.save, "a stored frozen shard's fp32 values while written"), window);
  r.save_frozen = false;
  EXPECT_EQ(item(plan(shape, r).save, "a stored frozen shard's fp32 values"), -1);
  // The checkpoint writer's two 16 MiB buffers; with a state in the disk tier, its reads of two
  // chunks (FileTier::chunk_elements(2): a third of the budget over two fp32 tensors, in 1024s;
  // 1M elements without a budget), and never the step's window.
  EXPECT_EQ(item(imported.save, "the checkpoint writer's staging"), int64_t{32} << 20);
  EXPECT_EQ(item(imported.save, "the disk tier's reads"), -1);
  {
    PlanRequest d = r;
    d.offload = OffloadPolicy().optimizer_state(OffloadTier::kDisk).dir("/unused");
    EXPECT_EQ(item(plan(shape, d).save, "the disk tier's reads of a state (two chunks)"), 2 * 4 * (1 << 20));
    d.offload->memory_budget_bytes(int64_t{30} << 20);
    const Plan budgeted = plan(shape, d);
    EXPECT_EQ(item(budgeted.save, "the disk tier's reads of a state (two chunks)"),
              2 * 4 * ((int64_t{30} << 20) / 24 / 1024 * 1024))
        << budgeted.to_string();
    EXPECT_EQ(item(budgeted.save, "disk tier's mapped window"), -1);
  }
  // The export: a chunk of the largest tensor's rows (here a whole unit, under 64 MiB) in fp32 and
  // bf16, and a unit's adapters; never the peak of a rank.
  const int64_t chunk = 4 * 2004000;
  EXPECT_EQ(item(imported.exporting, "a chunk of a tensor's rows"), chunk + chunk / 2) << imported.to_string();
  EXPECT_EQ(item(imported.exporting, "a module's adapters in fp32"), 4 * 4000);
  EXPECT_GT(item(imported.exporting, "process"), 0);
  EXPECT_NE(imported.to_string().find("an export (fsdp-ckpt export: one process, not a rank)"), std::string::npos);
  shape.units[1].largest_param_numel = 100 << 20;  // larger than a chunk: 64 MiB of fp32 at a time
  EXPECT_EQ(item(plan(shape, r).exporting, "a chunk of a tensor's rows"), kExportChunkBytes * 3 / 2);
  shape.units[1].largest_param_numel = 0;

  r.load = LoadKind::kResume;  // the optimizer's state is loaded too
  // From checkpoints without the frozen params (r.save_frozen false), the base is imported again.
  EXPECT_EQ(plan(shape, r).load.total(), imported.load.total() + 2 * masters);
  // From checkpoints with them, a resume reads the fp32 states in place: no staging.
  r.save_frozen = true;
  EXPECT_EQ(plan(shape, r).load.total(), imported.load.total() - stored_chunk - staging + window + 2 * masters);
  // A save follows steps, whose compute libraries stay mapped (fp32 compute here).
  EXPECT_EQ(item(imported.save, "the compute libraries"), int64_t{16} << 20) << imported.to_string();

  // A small model, whose import's staging outweighs its step: with a budget between the step's
  // peak and the load's the load does not fit, and the shortfall says so.
  for (auto& u : shape.units) {
    if (!u.is_root) u.frozen_numel = u.frozen_by_storage[FrozenStorage::kNF4] = 100000;
  }
  r.load = LoadKind::kImport;
  r.saves = false;  // the checkpoint writer's staging would outweigh the load
  const Plan small = plan(shape, r);
  ASSERT_STREQ(small.peak_phase(), "load") << small.to_string();
  EXPECT_EQ(small.peak(), small.load.total());
  r.budget.host_bytes = (small.device.total() + small.load.total()) / 2;
  const Plan short_of_load = plan(shape, r);
  EXPECT_FALSE(short_of_load.fits);
  EXPECT_NE(short_of_load.shortfall.find("RAM (in the load)"), std::string::npos) << short_of_load.shortfall;
  EXPECT_NE(short_of_load.to_string().find("peak per rank: "), std::string::npos);
}

// Note [The process measured by the process]: a process's resident size when it planned, with what
// joining the job adds, stands for the process in the step and in every phase; a given size wins
// over it; without either the constant stays; on CUDA the measure (taken before the context) is not
// used. process_resident_bytes() reads VmRSS once: a later call returns the first figure.
TEST(Plan, TheProcessItemIsTheProcessMeasuredWhenItPlanned) {
  const ModelShape shape = llama::plan_shape(qwen_like(true));
  auto process_item = [](const PlanTier& t) {
    for (const auto& [name, bytes] : t.items)
      if (name.rfind("process (", 0) == 0) return bytes;
    return int64_t{-1};
  };
  PlanRequest r = request(int64_t{8} << 30);
  r.process_host_bytes.reset();
  r.load = LoadKind::kImport;
  r.saves = true;
  const int64_t fallback = process_item(plan(shape, r).device);
  EXPECT_EQ(fallback, int64_t{350} << 20);
  const int64_t measured = int64_t{611} << 20;
  r.measured_process_bytes = measured;
  const Plan p = plan(shape, r);
  const int64_t join = process_item(p.device) - measured;
  EXPECT_GT(join, 0) << "joining the job adds its communicator and threads";
  EXPECT_LE(join, int64_t{64} << 20);
  for (const PlanTier* t : {&p.load, &p.save, &p.exporting}) EXPECT_EQ(process_item(*t), measured + join);
  EXPECT_NE(p.to_string().find("resident size when it planned, 611.00 MiB"), std::string::npos) << p.to_string();
  r.process_host_bytes = int64_t{100} << 20;  // given: taken as is
  EXPECT_EQ(process_item(plan(shape, r).device), int64_t{100} << 20);
  r.process_host_bytes.reset();
  r.device = c10::kCUDA;
  r.budget.device_bytes = int64_t{80} << 30;
  r.budget.host_bytes = int64_t{64} << 30;
  EXPECT_EQ(process_item(plan(shape, r).host), int64_t{3} << 30);

  const int64_t first = process_resident_bytes();
  EXPECT_GT(first, int64_t{10} << 20) << "this process maps LibTorch";
  const std::vector<char> touched(int64_t{64} << 20, 1);  // 64 MiB more resident
  EXPECT_EQ(process_resident_bytes(), first) << int(touched[0]);
}

// Note [The heap's slack]: on the CPU, half the activations a layer keeps, where its input (a hidden
// state: its blocks' size) is a heap block, under the 4 MiB mmap threshold; none where it is mapped
// apart, none on CUDA.
TEST(Plan, TheHeapsSlackIsHalfTheLayersActivationsInHeapBlocks) {
  const llama::LlamaConfig c = qwen_like(true);
  auto at_start = [](const Plan& p, const std::string& prefix) {
    for (const auto& [name, bytes] : p.device.at_backward_start)
      if (name.rfind(prefix, 0) == 0) return bytes;
    return int64_t{-1};
  };
  PlanRequest r = request(int64_t{64} << 30);
  r.checkpoint_every = 0;
  r.micro_batch = r.batch_per_rank = 1;
  const ModelShape shape = llama::plan_shape(c);
  const int64_t layer = llama::layer_activation_bytes(c, 1, r.seq_len, r.param_dtype);
  ASSERT_LT(2 * r.seq_len * c.hidden_size, int64_t{4} << 20);  // a hidden state in bf16: a heap block
  const Plan p = plan(shape, r);
  EXPECT_EQ(at_start(p, "the heap's freed blocks"), c.num_hidden_layers * layer / 2) << p.to_string();
  EXPECT_NE(p.to_string().find("the heap's slack: half the activations kept"), std::string::npos);
  r.seq_len = (int64_t{4} << 20) / (2 * c.hidden_size);  // a hidden state of 4 MiB: mapped apart
  EXPECT_EQ(at_start(plan(shape, r), "the heap's freed blocks"), -1);
  r.seq_len = 128;
  r.device = c10::kCUDA;
  r.budget.device_bytes = int64_t{64} << 30;
  EXPECT_EQ(at_start(plan(shape, r), "the heap's freed blocks"), -1);
}

// A 70B QLoRA on a machine of 23 GiB (2 ranks of 11 GiB, 26 GiB of disk each): the NF4 base, 19.3
// GiB per rank stored, does not fit in memory; in the disk tier with the params (Note [Placement
// rules], 2) it does, read once per gather: the planner chooses it, and counts its bytes on disk
// and its reads per step. Kept in memory (the params not offloaded), the plan says it is short.
TEST(Plan, A70BQloraBaseStreamsFromTheDiskTierOnTwentyThreeGiB) {
  llama::LlamaConfig c;  // meta-llama/Llama-3.1-70B's sizes
  c.vocab_size = 128256, c.hidden_size = 8192, c.intermediate_size = 28672, c.num_hidden_layers = 80;
  c.num_attention_heads = 64, c.num_key_value_heads = 8, c.max_position_embeddings = 131072;
  const LoraOptions lora = LoraOptions().r(16).base_dtype(FrozenStorage::kNF4);
  const ModelShape shape = llama::plan_shape(c, &lora);
  PlanRequest r = request(int64_t{11} << 30);
  r.batch_per_rank = 1;
  r.budget.disk_bytes = int64_t{26} << 30;
  r.margin = 0.1;
  r.load = LoadKind::kImport;
  r.saves = true;
  r.save_frozen = false;
  const Plan p = plan(shape, r);
  ASSERT_TRUE(p.fits) << p.to_string();
  EXPECT_EQ(p.params, OffloadTier::kDisk) << p.to_string();
  // Per layer 855.6M NF4 values: 0.5 + 4/64 bytes each, half per rank.
  const int64_t layer = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 8192 * 28672;
  const int64_t base = c.num_hidden_layers * layer / 2 * 9 / 16;
  auto item = [](const PlanTier& t, const std::string& name) {
    for (const auto& [n, bytes] : t.items) {
      if (n == name) return bytes;
    }
    return int64_t{-1};
  };
  EXPECT_GE(item(p.disk, "sharded states in the disk tier"), base) << p.to_string();
  EXPECT_LT(item(p.device, "sharded states not offloaded"), int64_t{1} << 30) << p.to_string();
  // Each layer read twice a step (forward, and backward's gather with its recomputation).
  EXPECT_GE(p.io_per_step.disk_read, 2 * base) << p.to_string();
  PlanRequest in_memory = r;
  in_memory.offload = OffloadPolicy();
  const Plan q = plan(shape, in_memory);
  EXPECT_FALSE(q.fits) << q.to_string();
  EXPECT_NE(q.shortfall.find("OffloadPolicy::params"), std::string::npos) << q.shortfall;
  // Imported from a bitsandbytes 4-bit save with its codes read in place (Note [NF4 codes read in
  // place]): the tier holds the absmax alone, the codes (half a byte a value) stay in the save's
  // files, and every byte is still read each step: the same tiers fit 6 GiB of disk per rank, beside
  // the 40 GB save on this machine's 57 GB free.
  PlanRequest in_place = r;
  in_place.nf4_codes_in_place = true;
  in_place.offload = OffloadPolicy().params(p.params).grads(p.grads).optimizer_state(p.optimizer_state);
  in_place.budget.disk_bytes = int64_t{6} << 30;
  const Plan s = plan(shape, in_place);
  ASSERT_TRUE(s.fits) << s.to_string();
  const int64_t codes = c.num_hidden_layers * layer / 2 / 2;
  EXPECT_EQ(item(p.disk, "sharded states in the disk tier") - item(s.disk, "sharded states in the disk tier"), codes)
      << s.to_string();
  EXPECT_EQ(s.io_per_step.disk_read, p.io_per_step.disk_read) << s.to_string();
  PlanRequest copied = in_place;
  copied.nf4_codes_in_place = false;
  EXPECT_FALSE(plan(shape, copied).fits) << "a second copy of the codes does not fit 6 GiB of disk";
}

}  // namespace
}  // namespace fsdp
