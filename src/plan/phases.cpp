// Note [The load and the save]
// Besides its steps, a run's memory has two other highs, which the plan gives as phases of their
// own (Plan::load, Plan::save; fits counts the largest):
//  - The load. Each rank holds its sharded states as they are after the load: the masters (a frozen
//    one in its stored form), a working copy where the master follows its state, and after a resume
//    the optimizer's state too; no gradient shard yet (the first reduction makes it). A frozen flat
//    param kept in a stored form (NF4, int8, bf16 beside fp32 compute) is written through an fp32
//    copy of its shard, stored and freed once its last tensor is read (Note [Importing weights]):
//    one such copy at a time, the largest counted. An import converts the source's values through
//    a staging buffer of 4M elements (fp32 and bf16: 24 MiB).
//  - The save. Every state of the step, and with the frozen params in the checkpoint
//    (SaveOptions::frozen_params) the fp32 values of every stored frozen shard at once, which the
//    checkpoint's view of the model decodes before it writes.
// Both add the process and the disk tier's mapped window. Not counted: the writer's and reader's
// page cache (not the process's memory).
#include "plan/plan_cost.h"

namespace fsdp::planning {

namespace {
constexpr int64_t kImportStaging = (int64_t{4} << 20) * (4 + 2);  // checkpoint/import.cpp's chunk, F32 and BF16
}  // namespace

void add_phases(const PlanRequest& req, const PhaseInputs& in, Plan& p) {
  p.load_kind = req.load;
  PlanTier& load = p.load;
  load.add("process (libraries, communicator, threads)", in.process);
  load.add(req.load == LoadKind::kResume ? "sharded states once loaded (masters, stored frozen, optimizer state)"
                                         : "sharded states once loaded (masters, stored frozen; no gradient yet)",
           in.loaded);
  load.add("a stored frozen shard's fp32 values until stored (the largest)", in.stored_largest);
  if (req.load != LoadKind::kInit) load.add("the conversion's staging", kImportStaging);
  load.add("disk tier's mapped window", in.disk_window);
  if (!req.saves) return;
  PlanTier& save = p.save;
  save.add("process (libraries, communicator, threads)", in.process);
  save.add("sharded states (the step's)", in.at_rest);
  if (req.save_frozen) save.add("every stored frozen shard's fp32 values (the checkpoint holds them)", in.stored_all);
  save.add("disk tier's mapped window", in.disk_window);
  save.add("async save's snapshot", in.snapshot);
}

}  // namespace fsdp::planning
