// ShardedOptimizer's machinery, which include/fsdp/optim.h keeps out of sight (a pimpl): the
// model's gradient shards, the states and groups, the step's jobs over the disk tier
// (optim/streamed_step.h), the read-ahead of disk-tier state during backward (optim.cpp) and the
// step in backward on the optimizer's own thread (step_in_backward.cpp), each a post-reduce hook
// (shard/post_reduce_hook.h). The optimizer's own arithmetic stays in its virtual functions
// (init_state, step_shard), which the machinery calls through `self`.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "fsdp/optim.h"
#include "optim/streamed_step.h"
#include "shard/grad_shards.h"
#include "shard/post_reduce_hook.h"

namespace fsdp {

class Tracer;

struct ShardedOptimizer::Impl {
  // `root` is not null (the optimizer's constructor checks).
  Impl(ShardedOptimizer& optimizer, const std::shared_ptr<FSDPModule>& root);

  ShardedOptimizer& self;  // the optimizer: its arithmetic and names
  std::shared_ptr<FSDPModule> root;
  // The root's gradient shards in ShardState::flat_index order, looked up once at construction.
  GradShards shards;
  std::vector<ShardState> states;
  std::map<int, GroupOptions> groups;
  double lr = 0;
  double default_weight_decay = 0;  // group 0's unless set_group_options overrides it
  StepObserver observer;            // observe_next_step's, until the step ends

  GradShard& shard_of(const ShardState& state) { return shards.all().at(state.flat_index); }
  double group_lr(int group) const;
  double group_weight_decay(int group) const;
  // Note [Offloaded state is reserved before the first update] (optim.cpp).
  void reserve_offloaded_state();
  // One flat param's part of a step (its gradient collected when the step reaches it).
  offload::StepJob make_job(ShardState& state);
  // The optimizer's arithmetic for one flat param at the learning rate and weight decay set now.
  offload::ShardStepFn step_fn(ShardState& state);
  // step() without step_in_backward.
  void step_after_backward(Tracer* tracer);

  // The step after backward with disk-tier state (optim.cpp): the backward reads ahead.
  struct ReadAhead;
  std::shared_ptr<ReadAhead> read_ahead;  // installed, or null
  void read_ahead_for(GradShard& shard);
  void install_read_ahead();
  void remove_read_ahead();
  void settle_writes();

  // step_in_backward (step_in_backward.cpp): the backward hands each reduced flat param over.
  struct InBackward;
  std::shared_ptr<InBackward> in_backward;  // on, or null
  void start_step_in_backward();
  void stop_step_in_backward();
  void hand_over(GradShard& shard);
  void finish_step_in_backward(Tracer* tracer);
  void wait_for_backward_steps();
};

}  // namespace fsdp
