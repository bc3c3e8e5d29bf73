// Note [The load and the save]
// Besides its steps, a run's memory has two other highs, which the plan gives as phases of their
// own (Plan::load, Plan::save; fits counts the largest):
//  - The load. Each rank holds its sharded states as they are after the load: the masters (a frozen
//    one in its stored form), a working copy where the master follows its state, and after a resume
//    the optimizer's state too; no gradient shard yet (the first reduction makes it). A frozen flat
//    param kept in a stored form (NF4, int8, bf16 beside fp32 compute) is filled by deferred init,
//    or resumed, through an fp32 copy of its shard, stored and freed once written: one such copy
//    at a time, the largest counted. An import stores each chunk of it as read instead, and so
//    does a resume from checkpoints without the frozen params, which imports them again
//    (FlatParam::store_values: no fp32 shard; a tensor whose rows grow, or a flat param imported
//    in part, still goes through the copy, which the plan does not count). An import converts the
//    source's values through a staging buffer of 4M elements (fp32 and bf16: 24 MiB); a resume
//    reads fp32 RAM in place, and chunks of 4M only for a state in the disk tier or elsewhere. Into a master in the
//    disk tier it writes each chunk's fp32 values through the tier's write thread, the chunk before still being written
//    (16 MiB more), and a working copy in another dtype is cast from each chunk as it passes
//    (Residency::values_written: 8 MiB in bf16), never from the master read back whole.
//  - The save. Every state of the step, and with the frozen params in the checkpoint
//    (SaveOptions::frozen_params) the fp32 values of one stored frozen shard, which the save
//    decodes just before writing it and frees after (one at a time, the largest counted), and the
//    checkpoint writer's two staging buffers (io::DirectWriter: one fills while the other is
//    written), beside what the steps before it mapped (the compute libraries' item). A state in
//    the disk tier is read through the tier's chunks, within its window.
// Both add the process. Neither holds the streamed step's window of the disk tier: a load writes
// the tier through chunks of its own (counted above), and a save reads a state there two chunks
// at a time (read_streamed). Not counted: the writer's and reader's page cache (not the process's
// memory).
//
// A third, Plan::exporting, is not a rank's: fsdp-ckpt export, one process on the machine, after the
// run. It converts each tensor a chunk of rows at a time, kExportChunkBytes of fp32 values at most
// (less for a smaller tensor), read into a tensor of their own (a bf16 source's rows are converted
// and freed at once) and cast for writing: a chunk's fp32 values and half a chunk as bf16 or fp16
// (a float32 export writes the values themselves). A merged LoRA export adds the module's two
// adapters in fp32, read whole for each chunk's W[rows] + B[rows] A * scaling, and the fp32 matrix
// kernels those products map (against fsdp-ckpt's own process, measured by `fsdp-ckpt info`, a
// merged export of the CI's QLoRA model measured 121 MiB where chunk and adapters are 100).
#include "plan/plan_cost.h"

#include <algorithm>

#include "base/direct_writer.h"
#include "base/strings.h"

namespace fsdp::planning {

namespace {
constexpr int64_t kImportChunk = int64_t{4} << 20;          // checkpoint/import.cpp's chunk, in elements
constexpr int64_t kImportStaging = kImportChunk * (4 + 2);  // the chunk in F32 and BF16
}  // namespace

void add_phases(const PlanRequest& req, const PhaseInputs& in, Plan& p) {
  p.load_kind = req.load;
  PlanTier& load = p.load;
  load.add("process (libraries, communicator, threads)", in.process);
  load.add(req.load == LoadKind::kResume ? "sharded states once loaded (masters, stored frozen, optimizer state)"
                                         : "sharded states once loaded (masters, stored frozen; no gradient yet)",
           in.loaded);
  // An import stores each chunk of a frozen shard as it reads it (FlatParam::store_values); so does
  // a resume from checkpoints without the frozen parameters (the base imported again).
  const bool imports =
      req.load == LoadKind::kImport || (req.load == LoadKind::kResume && in.has_frozen && !req.save_frozen);
  if (!imports) load.add("a stored frozen shard's fp32 values until stored (the largest)", in.stored_largest);
  else if (in.stored_largest > 0)
    load.add("a chunk's stored form (int8 at most: 1 + 4/64 bytes a value)", kImportChunk * 17 / 16);
  if (imports) load.add("the conversion's staging", kImportStaging);
  // A resume reads fp32 RAM straight into the state; a state in the disk tier through the tier's
  // write (a chunk read, two in flight), one on a device or in bf16 through a chunk of host fp32.
  if (req.load == LoadKind::kResume && in.state_on_disk)
    load.add("the checkpoint's chunks through the disk tier's write (fp32)", 3 * kImportChunk * 4);
  else if (req.load == LoadKind::kResume && in.state_via_host)
    load.add("the checkpoint's chunk through host memory (fp32)", kImportChunk * 4);
  if (req.load == LoadKind::kImport && in.master_on_disk) {
    load.add("the disk tier's write of the chunk before (fp32)", kImportChunk * 4);
    if (in.working_cast_element > 0)
      load.add("a chunk cast for the working copy", kImportChunk * in.working_cast_element);
  }
  const int64_t chunk = std::min(kExportChunkBytes, 4 * in.largest_param);
  p.exporting.add("process (libraries)", in.process);
  p.exporting.add("a chunk of a tensor's rows in fp32 (" + base::mib(chunk, 1) + ") and in bf16 for writing",
                  chunk + chunk / 2);
  if (in.has_frozen && in.largest_trainable > 0) {
    p.exporting.add("a module's adapters in fp32 (a merged export; counted as a unit's)", 4 * in.largest_trainable);
    // The merge's products B A map the CPU's fp32 matrix kernels (Note [The compute libraries' first use]).
    p.exporting.add("the compute libraries' code and work buffers (the merge's products, fp32)", int64_t{16} << 20);
    // A PEFT adapter export reads each adapter whole in fp32 and casts it for writing (bf16 at most
    // half again; a float32 export writes the values themselves): no base row, no product.
    p.exporting_adapters.add("process (libraries)", in.process);
    p.exporting_adapters.add("an adapter in fp32 and its cast for writing (the largest)", 6 * in.largest_trainable);
  }
  if (!req.saves) return;
  PlanTier& save = p.save;
  save.add("process (libraries, communicator, threads)", in.process);
  save.add("sharded states (the step's)", in.at_rest);
  // A save follows steps, whose compute libraries stay mapped.
  if (req.device == c10::kCPU)
    save.add("the compute libraries' code and work buffers (the steps')", compute_libraries(req));
  if (req.save_frozen) save.add("a stored frozen shard's fp32 values while written (the largest)", in.stored_largest);
  save.add("the checkpoint writer's staging (two buffers)", io::DirectWriter::memory_bytes());
  if (in.disk_read_chunk > 0) save.add("the disk tier's reads of a state (two chunks)", 2 * in.disk_read_chunk);
  save.add("async save's snapshot", in.snapshot);
}

}  // namespace fsdp::planning
