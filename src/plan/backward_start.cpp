// The start of backward, of the planner's arithmetic (plan_cost.h): the activations and the
// backward's transients, and which of the start's two moments is the larger (Note [Two moments of
// backward] in plan_cost.cpp).
#include <algorithm>

#include "plan/plan_cost.h"

namespace fsdp::planning {

std::vector<bool> layers_of(const ModelShape& shape) {
  const bool any_checkpointable =
      std::any_of(shape.units.begin(), shape.units.end(), [](const UnitShape& u) { return u.checkpointable; });
  std::vector<bool> out;
  for (const auto& u : shape.units) out.push_back(!u.is_root && (u.checkpointable || !any_checkpointable));
  return out;
}

// Note [The heap's slack]
// On the CPU glibc serves a block under its mmap threshold (4 MiB: Note [Host malloc settings]) from
// the heap, and a freed block there stays resident until a later allocation fits it; only the
// heap's top beyond 512 MiB goes back to the system. A step's activations at these sizes (a
// hidden state of 128 tokens at Qwen2.5-0.5B: 224 KiB in bf16) are heap blocks, and the forward's
// transients, freed between the activations it keeps, and the last backward's freed blocks stay
// resident beside them: at Qwen2.5-0.5B with an NF4 LoRA base (seq_len 128, 2 ranks, no
// checkpointing) the steps measured 105-120 MiB per rank above the plan's live bytes, 0.55-0.63 of
// the kept activations (188.8 MiB), from the second step on; with blocks over 128 KiB mapped apart
// (glibc's default threshold) 0.98x of the plan without it, at a step about 1.5x as long; with trim
// after every step 1,030-1,049 MiB against 1,041-1,061. Counted: half the activations a layer keeps,
// at the start of backward, where its input (one hidden state: its blocks' size) is under the
// threshold; the units that are not layers keep the logits and their like, mapped apart.
ActivationBytes activations(const ModelShape& shape, const PlanRequest& req, const Choices& c) {
  ActivationBytes a;
  const std::vector<bool> is_layer = layers_of(shape);
  int64_t layer = 0;
  for (size_t i = 0; i < shape.units.size(); ++i) {
    const UnitShape& u = shape.units[i];
    if (!u.activations) continue;
    const bool ckpt = c.checkpoint_every > 0 && u.checkpointable && layer % c.checkpoint_every == 0;
    if (u.checkpointable) ++layer;
    const std::string what = "the activations of " + u.name;
    const int64_t full = add_bytes(0, u.activations(c.micro_batch, req.seq_len, req.param_dtype, false), what);
    const int64_t input = u.checkpointable ? u.activations(c.micro_batch, req.seq_len, req.param_dtype, true) : 0;
    a.kept = add_bytes(a.kept, ckpt ? input : full, what);
    // A layer's input (its checkpointed activations) stands for its blocks' size.
    if (req.device == c10::kCPU && u.checkpointable && input < kHeapBlockLimit)
      a.heap_slack += (ckpt ? input : full) / 2;
    if (ckpt) a.rebuilt = std::max(a.rebuilt, full);
    const int64_t extra =
        u.backward_peak ? add_bytes(0, u.backward_peak(c.micro_batch, req.seq_len, req.param_dtype), what) : full;
    int64_t& into = is_layer[i] ? a.layer_extra : a.first_extra;
    into = std::max(into, extra);
  }
  return a;
}

// The start of backward's larger moment (Note [Two moments of backward]).
void add_backward_start(const LayersGathered& g, const ActivationBytes& a, Plan& p) {
  PlanTier& ram = p.device;
  ram.add("activations kept from forward", a.kept, PlanTier::kBackwardStart);
  if (a.heap_slack > 0) {
    ram.add("the heap's freed blocks among them, resident (half the activations kept)", a.heap_slack,
            PlanTier::kBackwardStart);
  }
  const int64_t loss = g.at_loss + a.first_extra;
  const int64_t layer = g.at_peak + a.rebuilt + a.layer_extra;
  if (loss > layer) {
    if (g.at_loss > 0) {
      ram.add("in the loss's backward: layers' gathered params kept or prefetched", g.at_loss,
              PlanTier::kBackwardStart);
    }
    ram.add("in the loss's backward: its transient (the units that are not layers')", a.first_extra,
            PlanTier::kBackwardStart);
    return;
  }
  if (g.at_peak > 0) {
    ram.add("in a layer's backward: gathered params beyond those, at their peak (" + g.what + ")", g.at_peak,
            PlanTier::kBackwardStart);
  }
  if (a.rebuilt > 0) {
    ram.add("in a layer's backward: one checkpointed unit's activations rebuilt", a.rebuilt, PlanTier::kBackwardStart);
  }
  ram.add("in a layer's backward: its transient", a.layer_extra, PlanTier::kBackwardStart);
}

}  // namespace fsdp::planning
