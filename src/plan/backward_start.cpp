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
    a.kept = add_bytes(a.kept, ckpt ? u.activations(c.micro_batch, req.seq_len, req.param_dtype, true) : full, what);
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
