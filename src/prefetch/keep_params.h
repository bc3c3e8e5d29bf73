// Whether a unit keeps its gathered params from the end of its forward to its backward (no
// reshard after forward, no all-gather in backward). The one rule: the state machine applies it
// at each post_forward and the offload plan to predict a step's gathers, so they cannot disagree.
#pragma once

namespace fsdp::prefetch {

// Note [The last unit keeps its params] (src/shard/sharded_unit.cpp)
struct ForwardEnd {
  bool reshard_after_forward = true;  // the unit's resolved option
  bool option_explicit = false;       // the user set it (else the defaults below apply)
  bool is_root = false;               // by default the root keeps: its backward follows at once
  bool ran_last = false;              // ExecutionOrder::ran_last: its backward comes first
  bool backward_follows = true;       // gradients on in its forward: a backward will use the params
  bool recomputing = false;           // a recomputation inside backward: its backward follows at once
};

inline bool keeps_params_after_forward(const ForwardEnd& f) {
  if (!f.reshard_after_forward || f.recomputing) return true;
  if (f.option_explicit) return false;
  return f.is_root || (f.ran_last && f.backward_follows);
}

}  // namespace fsdp::prefetch
