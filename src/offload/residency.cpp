// See residency.h.
#include "offload/residency.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>

#include "fsdp/errors.h"
#include "fsdp/trace.h"
#include "kernels/ops.h"
#include "offload/device_stager.h"
#include "frozen/frozen_storage.h"

namespace fsdp::offload {
namespace {

// A zero-filled fp32 tensor of `numel` elements in `tier`.
at::Tensor zeros_in(const OffloadPlacement& p, OffloadTier tier, int64_t numel, const at::TensorOptions& options,
                    const std::string& what) {
  switch (tier) {
    case OffloadTier::kDisk: return p.disk->zeros(numel, what);
    case OffloadTier::kHost: return p.stager->host_zeros(numel);
    case OffloadTier::kNone: break;
  }
  return at::zeros({numel}, options);
}

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// The first `bytes` of a tier's fp32 words (the host tier's or the disk tier's, which hold bytes
// of any dtype) seen as `dtype`.
at::Tensor bytes_as(const at::Tensor& words, int64_t bytes, at::ScalarType dtype) {
  return words.view(at::kByte).narrow(0, 0, bytes).view(dtype);
}

}  // namespace

Residency::Residency(at::Tensor master, Config config) : master_(std::move(master)), config_(std::move(config)) {}

void Residency::place(OffloadPlacement placement, bool materialized) {
  placement_ = std::move(placement);
  c10::NoGradGuard no_grad;
  if (config_.stored) {  // the host tier at most; deferred init's fp32 values stay until encoded
    if (materialized) replace_stored(master_);
    return;
  }
  if (placement_.params != OffloadTier::kNone) {
    at::Tensor placed = zeros_in(placement_, placement_.params, master_.numel(), master_.options(),
                                 "the master shard of " + config_.tag);
    // A new placement is all zeros, padding included: deferred init fills the rest.
    if (materialized) {
      placed.copy_(master_);
      offload::release(placed);
    }
    master_ = placed;
  }
  follows_ = config_.requires_grad &&
             offload::master_follows_state(placement_.params, placement_.grads, placement_.optimizer_state);
  if (follows_) move_master_to_state_tier(materialized);
}

// See Note [The master follows the optimizer state] in flat_param.h.
void Residency::move_master_to_state_tier(bool materialized) {
  at::Tensor placed = zeros_in(placement_, placement_.optimizer_state, master_.numel(),
                               master_.options().device(at::kCPU), "the master shard of " + config_.tag);
  if (materialized) offload::copy_streamed(placed, master_.to(at::kCPU));
  // Zeros: the padding is never written, and a load may cast the rest from its values as it goes.
  working_ = at::zeros({master_.numel()}, at::TensorOptions().dtype(config_.compute_dtype).device(config_.device));
  master_ = placed;
  if (materialized) refresh_working(0, master_);
}

at::Tensor Residency::new_state_tensor(const std::string& what, at::ScalarType dtype) {
  const int64_t numel = master_.numel();
  if (dtype == at::kFloat) {
    return zeros_in(placement_, placement_.optimizer_state, numel,
                    at::TensorOptions().dtype(at::kFloat).device(master_.device()), what + " of " + config_.tag);
  }
  switch (placement_.optimizer_state) {
    case OffloadTier::kDisk:
      throw ConfigError("fsdp: " + what + " of " + config_.tag + " is kept in " + c10::toString(dtype) +
                        ", which the disk tier does not hold (it streams fp32 state); keep the optimizer state in " +
                        "RAM or the host tier (OffloadPolicy::optimizer_state), or in float32");
    case OffloadTier::kHost: {  // the stager's host memory (pinned on a device) holds bytes of any dtype
      const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
      return bytes_as(placement_.stager->host_zeros((bytes + 3) / 4), bytes, dtype);
    }
    case OffloadTier::kNone: break;
  }
  return at::zeros({numel}, at::TensorOptions().dtype(dtype).device(master_.device()));
}

bool Residency::crosses_to_device(OffloadTier tier) const {
  // Host-tier copies run on CPU runs too (as clones) so that CPU tests follow the host tier's
  // schedule; disk-tier data is already in host memory once read.
  return tier == OffloadTier::kHost || (tier == OffloadTier::kDisk && !config_.device.is_cpu());
}

// ---- the gather

// Note [A stored form in the disk tier]
// A frozen shard in a stored form (bf16, int8, NF4) with the params in the disk tier lives in a
// tier file like a master: the file holds its bytes as fp32 words (the tier streams floats), the
// master is their view in the stored dtype, and each gather reads the words through the tier's
// I/O threads (ahead of use by read_ahead(), kept for backward like a master's read), decoding
// from that host buffer; its pages leave memory after each gather and after each write. It is
// written through the mapping (an import's or a load's ranges, encoded in place), since it is
// never stepped: the page faults that would read in a stepped master's pages before each write
// happen once per load here. A base of 40 GB is then read once per forward and once per
// backward gather, at 1/N of a unit per rank, instead of kept in memory.
void Residency::replace_stored(at::Tensor stored) {
  if (placement_.params == OffloadTier::kDisk && config_.stored && !stored.is_meta()) {
    allocate_stored(stored.scalar_type(), stored.numel());
    master_.copy_(stored);
    stored_written();
    return;
  }
  if (placement_.params != OffloadTier::kHost) {
    master_ = std::move(stored);
    return;
  }
  // The stager's host memory (pinned on a device) holds bytes of any dtype.
  at::Tensor host =
      bytes_as(placement_.stager->host_zeros((nbytes(stored) + 3) / 4), nbytes(stored), stored.scalar_type());
  host.copy_(stored);
  master_ = host;
}

void Residency::allocate_stored(at::ScalarType dtype, int64_t numel) {
  if (placement_.params == OffloadTier::kDisk && config_.stored) {
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    in_place_.clear();
    stored_words_ = placement_.disk->zeros((bytes + 3) / 4, "the stored form of " + config_.tag);
    master_ = bytes_as(stored_words_, bytes, dtype);
    stored_written();
    return;
  }
  replace_stored(at::empty({numel}, at::TensorOptions().dtype(dtype).device(config_.device)));
}

void Residency::stored_written() {
  if (!stored_words_.defined()) return;
  kept_master_ = at::Tensor();
  offload::release(stored_words_);
  placement_.disk->bump_generation();
}

void Residency::encode_stored(FrozenStorage storage, const at::Tensor& values, bool in_place) {
  if (in_place && master_.defined() && !master_.is_meta() && master_.scalar_type() == frozen::stored_dtype(storage) &&
      master_.numel() == frozen::stored_numel(storage, values.numel())) {
    before_stored_write(0, nbytes(master_));
    frozen::encode_into(storage, values.to(master_.device()), master_);
    stored_written();
    return;
  }
  replace_stored(frozen::encode(storage, values.to(config_.device)));
}

at::Tensor Residency::gather_input(KeepMaster keep) {
  if (config_.stored && !stored_words_.defined()) {  // in its stored form, to the device from the host tier
    return crosses_to_device(placement_.params) ? placement_.stager->to_device(master_) : master_;
  }
  at::Tensor input;
  if (follows_) {
    input = working_;  // already in param_dtype on the compute device
  } else {
    // The master's values: kept from an earlier gather of this step when there is one (it has not
    // changed: every write of the master drops it), else read through the tier's I/O threads.
    const bool reused = kept_master_.defined();
    const at::Tensor master = reused ? kept_master_ : fetch_master();
    kept_master_ = at::Tensor();
    if (offload::is_disk_backed(master_)) {
      if (keep == KeepMaster::kForBackward) {
        kept_master_ = reused ? master : placement_.disk->count_in_budget(master);
      } else if (keep == KeepMaster::kForStep && config_.requires_grad) {
        kept_master_ = master;  // one shard's host buffer, kept until the unit's step
      }
    }
    if (config_.stored) {  // the words read: the stored form's bytes, gathered as they are
      input = bytes_as(master, nbytes(master_), master_.scalar_type());
    } else if (config_.compute_dtype == at::kFloat) {
      input = master;
    } else {  // mixed-precision copy-in (kernels/ops.h)
      input = at::empty({master.numel()}, master.options().dtype(config_.compute_dtype));
      kernels::copy_in(master, input);
    }
  }
  if (crosses_to_device(placement_.params)) input = placement_.stager->to_device(input);
  return input;
}

void Residency::gather_done() {
  if (placement_.params != OffloadTier::kDisk) return;
  offload::release(master_);
  placement_.disk->audit();
}

// The collective reads its input whole: a disk-tier master is read into host memory by the
// tier's I/O threads (ahead of use when read_ahead() ran for it), so a gather costs 1/N of a unit
// in RAM, like mixed precision's cast, and none of the budget.
at::Tensor Residency::fetch_master() {
  if (!offload::is_disk_backed(master_)) return master_;
  offload::DiskTier& tier = *placement_.disk;
  start_master_read();
  const auto t0 = std::chrono::steady_clock::now();
  offload::IoTicket ticket = std::move(pending_read_);
  pending_read_ = offload::IoTicket();
  ticket.wait();
  if (Tracer* t = tier.tracer())
    t->span("fsdp::disk_read_wait", "disk wait", t0, std::chrono::steady_clock::now(), config_.tag);
  return ticket.buffer();
}

void Residency::read_ahead() {
  if (follows_ || !offload::is_disk_backed(master_) || kept_master_.defined()) return;
  start_master_read();
}

// Issues the read of the disk-tier master unless one of its current contents is already pending.
void Residency::start_master_read() {
  offload::DiskTier& tier = *placement_.disk;
  if (pending_read_.valid() && pending_read_generation_ == tier.generation()) return;
  pending_read_generation_ = tier.generation();
  const at::Tensor& words = stored_words_.defined() ? stored_words_ : master_;
  pending_read_ = tier.read_async(words, 0, words.numel(), "the master shard of " + config_.tag, false, in_place_);
}

at::Tensor Residency::take_master_for_step() {
  at::Tensor out = std::move(kept_master_);
  kept_master_ = at::Tensor();
  return out;
}

// ---- bytes read in place

// Note [NF4 codes read in place]
// A bitsandbytes 4-bit checkpoint holds a weight's NF4 codes exactly as an NF4 stored form does
// (the same nibbles, blocks of 64: Note [bitsandbytes 4-bit weights] in bnb/bnb4.cpp). Imported
// into a stored form in the disk tier, the codes need not be copied: the tier file holds the
// absmax (decoded from double quantization at the import) and the codes' ranges are recorded
// here as ranges of the source's files, which the import leaves open. Each read of the stored
// form (a gather's, read ahead on the tier's read thread; a save's) reads the tier file between
// those ranges and the ranges from their files, so a 40 GB base is on the disk once, not twice.
// The tier file is allocated whole and its blocks under the ranges are punched out once the
// import ends (a hole reads as zeros and takes no disk). Any other write of the stored form drops
// the ranges it overlaps: one it covers whole is simply forgotten; one it covers in part is first
// copied into the tier (its blocks reserved again), so no byte is lost. The source files must not
// change while the model lives; deleting them is safe (their descriptors stay open).
void Residency::read_in_place(int64_t at, int64_t bytes, std::shared_ptr<const io::File> file, int64_t offset) {
  if (!in_place_.empty()) {  // an import's chunks of one tensor: one range
    InPlaceRange& last = in_place_.back();
    if (last.file == file && last.at + last.bytes == at && last.offset + last.bytes == offset) {
      last.bytes += bytes;
      return;
    }
  }
  in_place_.push_back({at, bytes, offset, std::move(file)});
  std::sort(in_place_.begin(), in_place_.end(),
            [](const InPlaceRange& a, const InPlaceRange& b) { return a.at < b.at; });
}

void Residency::punch_in_place() {
  for (const InPlaceRange& r : in_place_) offload::punch_hole(stored_words_, r.at, r.at + r.bytes);
}

int64_t Residency::in_place_bytes() const {
  int64_t n = 0;
  for (const InPlaceRange& r : in_place_) n += r.bytes;
  return n;
}

void Residency::before_stored_write(int64_t a, int64_t b) {
  bool reserved = false;
  for (auto it = in_place_.begin(); it != in_place_.end();) {
    if (it->at >= b || it->at + it->bytes <= a) {
      ++it;
      continue;
    }
    if (it->at < a || it->at + it->bytes > b) {  // kept in part: its bytes into the tier first
      if (!reserved) offload::reserve_blocks(stored_words_, "the stored form of " + config_.tag);
      reserved = true;
      it->file->pread_all(static_cast<char*>(master_.data_ptr()) + it->at, static_cast<uint64_t>(it->bytes),
                          static_cast<uint64_t>(it->offset));
    } else if (!reserved) {
      offload::reserve_blocks(stored_words_, "the stored form of " + config_.tag);
      reserved = true;
    }
    it = in_place_.erase(it);
  }
  if (reserved) placement_.disk->bump_generation();
}

at::Tensor Residency::stored_bytes() const {
  if (in_place_.empty()) return master_;
  offload::IoTicket t = placement_.disk->read_async(stored_words_, 0, stored_words_.numel(),
                                                    "the stored form of " + config_.tag, false, in_place_);
  t.wait();
  return bytes_as(t.buffer(), nbytes(master_), master_.scalar_type());
}

// ---- the master's writers

void Residency::part_written(const at::Tensor& part) { offload::release(part); }

void Residency::master_written() {
  kept_master_ = at::Tensor();
  if (offload::DiskTier* tier = offload::tier_of(master_)) tier->bump_generation();
  const int64_t values = config_.values < 0 ? master_.numel() : config_.values;
  if (follows_ && fresh_ < values) refresh_working(0, master_);
  fresh_ = 0;
}

void Residency::values_written(int64_t begin, const at::Tensor& part) {
  if (!follows_) return;
  cast_into_working(begin, part);
  fresh_ += part.numel();
}

std::function<void(int64_t, int64_t, const at::Tensor&)> Residency::after_update() {
  if (!follows_) return nullptr;
  return [this](int64_t a, int64_t /*b*/, const at::Tensor& updated) { refresh_working(a, updated); };
}

void Residency::refresh_working(int64_t a, const at::Tensor& master_part) {
  c10::NoGradGuard no_grad;
  // A whole disk-tier master (after deferred init or a load) comes in the tier's host chunks, read
  // ahead by its I/O threads, each cast as it lands: no fp32 copy of the whole shard exists.
  if (offload::is_disk_backed(master_part)) {
    offload::read_streamed(master_part, 0, master_part.numel(), "the master shard of " + config_.tag,
                           [&](const float* data, int64_t at, int64_t n) {
                             cast_into_working(a + at, at::from_blob(const_cast<float*>(data), {n}, at::kFloat));
                           });
    return;
  }
  cast_into_working(a, master_part);
}

void Residency::cast_into_working(int64_t a, const at::Tensor& part) {
  at::Tensor cast = part;
  if (config_.compute_dtype != at::kFloat) {  // the same copy-in as the gather's without offload
    cast = at::empty({part.numel()}, part.options().dtype(config_.compute_dtype));
    kernels::copy_in(part, cast);
  }
  at::Tensor dst = working_.narrow(0, a, part.numel());
  if (placement_.stager) {
    placement_.stager->copy_to_device(dst, cast);
  } else {
    dst.copy_(cast);
  }
}

// ---- the gradient shard

at::Tensor Residency::stage_reduced(const at::Tensor& reduce_output) {
  return crosses_to_device(placement_.grads) ? placement_.stager->to_host(reduce_output) : reduce_output;
}

void Residency::place_grad(at::Tensor& grad) {
  if (placement_.grads == OffloadTier::kNone) return;
  if (placement_.grads == OffloadTier::kDisk && !offload::is_disk_backed(grad)) {
    at::Tensor placed = placement_.disk->zeros(master_.numel(), "the gradient shard of " + config_.tag);
    placed.copy_(grad);
    grad = placed;
  } else if (placement_.grads == OffloadTier::kHost && std::string(placement_.stager->name()) != "cpu" &&
             !grad.is_pinned()) {
    at::Tensor placed = placement_.stager->host_zeros(master_.numel());
    placed.copy_(grad);
    grad = placed;
  }
  offload::release(grad);
}

void Residency::grad_written(const at::Tensor& grad) { offload::release(grad); }

at::Tensor Residency::grad_for_step(const at::Tensor& grad) {
  if (!follows_ || !grad.defined()) return grad;
  // Through pinned staging on a device; a clone on CPU runs (the same schedule, tested there).
  return placement_.stager ? placement_.stager->to_host(grad) : grad;
}

}  // namespace fsdp::offload
