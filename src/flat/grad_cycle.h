// GradCycle: one flat param's gradient from its unit's backward to the optimizer. Before the
// backward the gradient buffer exists and the parameters' .grad are (or become) views of it; each
// gradient lands in it; the buffer is reduce-scattered, the result added to the fp32 gradient
// shard, and the buffer freed. Between backwards the parameters' .grad are guards. Part of a
// FlatParam (flat_param.h): it reads the flat param's layout and gathered buffer, and hands the
// reduced shard to its residency.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "fsdp/comm.h"

namespace fsdp {

class FlatLayout;
class GatheredParams;
namespace offload {
class Residency;
}

class GradCycle {
 public:
  // A trainable flat param's parameters get gradient guards (Note [Guarded gradients]).
  GradCycle(FlatLayout& layout, offload::Residency& residency, const GatheredParams& gathered);

  // Before the unit's backward: the gradient buffer exists and params' .grad are views of it,
  // after collecting a reduction still in flight (Note [Lazy gradient collection]).
  void prepare();
  bool prepared() const { return prepared_; }
  void landed(size_t k);  // AccumulateGrad is done with entry k's gradient (Note [The first gradient is copied])
  // After a backward the parameters' .grad are guards; unguard(), at the root's next forward,
  // points them back at the gradient buffer while gradients accumulate (no sync), else leaves them
  // undefined.
  void guard();
  void unguard();
  // Issues the reduction of the gradient buffer (reduce-scatter over the shard group).
  void reduce_scatter();
  // FSDPModule::set_requires_all_reduce: read when the reduce-scatter is issued.
  void set_requires_all_reduce(bool on) { requires_all_reduce_ = on; }
  bool requires_all_reduce() const { return requires_all_reduce_; }
  // Waits for the reduction, all-reduces across replicas when hybrid, and adds the result to the
  // fp32 gradient shard, then frees the gradient buffer.
  void finalize();
  void zero();  // the gradient shard's values to zero (keeps the buffer)
  // UsageError when partial sums wait for an all-reduce that never came, naming `what` read them.
  void check_no_partial(const std::string& what) const;
  at::Tensor& shard() { return shard_; }  // fp32 gradient shard, undefined until the first reduction
  bool reduced_since_zero() const { return reduced_since_zero_; }  // a reduction was issued since zero()
  int64_t buffer_bytes() const;
  // Partial sums, or a reduction in flight that will add to them.
  // (A reduction in flight decides: a deferred one adds to the sums, another all-reduces them.)
  bool holds_partial() const { return reduce_issued_ ? defer_all_reduce_ : partial_.defined(); }
  int64_t partial_bytes() const;
  // Sums left waiting by micro-batches whose last one did not reduce this flat param (it got no
  // gradient): all-reduced and added into the gradient shard now.
  void flush_partial();

 private:
  bool can_alias_shard() const;
  void point_at_buffer();
  void finalize_deferred();  // Note [Accumulation without the all-reduce]
  void fill_uncopied();      // zeroes what no gradient reached, and the padding

  FlatLayout& layout_;
  offload::Residency& residency_;
  const GatheredParams& gathered_;
  bool requires_all_reduce_ = true;
  at::Tensor shard_;
  at::Tensor buffer_;  // [padded] compute dtype; storage freed between backwards
  // The buffer is the gradient shard itself (Note [One-rank gradients] in grad_cycle.cpp).
  bool aliases_shard_ = false;
  at::Tensor reduce_input_;   // buffer_ or its cast to reduce dtype
  at::Tensor reduce_output_;  // [shard] reduce dtype
  CommHandle reduce_handle_;
  bool reduce_issued_ = false;
  bool reduced_since_zero_ = false;
  // Note [Accumulation without the all-reduce]: this reduction skips the replicas' all-reduce, and
  // the fp32 sum of the reductions that skipped it so far (undefined when none did).
  bool defer_all_reduce_ = false;
  bool all_reduce_issued_ = false;  // a replicated flat param's all-reduce went with the reduce-scatter
  at::Tensor partial_;
  bool prepared_ = false;
  bool guarded_ = false;  // the parameters' .grad are guards_
  // Note [The first gradient is copied]: per entry, whether its part of the buffer holds its
  // gradient yet; empty when the buffer was zeroed (the parameters add into it).
  std::vector<char> copied_;
  std::vector<at::Tensor> guards_;  // per entry of a trainable flat param
};

}  // namespace fsdp
