// Note [Identity check in the queue]
// NCCL's messages cannot carry a collective's identity the way the CPU ring's do (Note [Collective
// identity in the framing] in ring.cpp), so for such a transport the communicator's worker keeps
// the identities of the collectives it runs and, every kWindow collectives and whenever asked
// (Communicator::verify_collectives, which the end of backward calls before any optimizer step),
// all-gathers them: a fixed-size record (a count and kWindow identities), so the exchange pairs up
// whenever the ranks have run as many collectives, and a mismatch names every rank's collective at
// the first position where they differ. What it cannot promise: a collective whose sizes differ
// between ranks may hang NCCL itself until the collective timeout, and the step in backward steps
// units before the end of backward, so there only the periodic check guards the gradients.
// FSDP_COLLECTIVE_IDS=queue runs this check on the CPU ring too (which then carries no identity):
// the tests exercise this path on CPU.
#include "comm/id_check.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include <ATen/ATen.h>

#include "comm/order_check.h"

namespace fsdp {
namespace {

constexpr int64_t kRecordBytes = 8 + QueueIdCheck::kWindow * static_cast<int64_t>(sizeof(WireId));

struct Record {
  int64_t count = 0;
  std::vector<WireId> ids;
};

Record decode(const uint8_t* bytes) {
  Record r;
  std::memcpy(&r.count, bytes, 8);
  // The count came from a peer: bounded before it sizes anything.
  r.count = std::clamp<int64_t>(r.count, 0, QueueIdCheck::kWindow);
  r.ids.resize(r.count);
  std::memcpy(r.ids.data(), bytes + 8, r.count * sizeof(WireId));
  return r;
}

}  // namespace

QueueIdCheck::QueueIdCheck(int rank, int size, std::string group, int every)
    : rank_(rank), size_(size), group_(std::move(group)), every_(std::clamp(every, 1, kWindow)) {
  window_.reserve(every_);
}

bool QueueIdCheck::record(const CollectiveId& id) {
  window_.push_back(WireId::of(id));
  return static_cast<int>(window_.size()) >= every_;
}

void QueueIdCheck::check(Transport& transport, uint64_t seq) {
  auto mine = at::zeros({kRecordBytes}, at::kByte);
  const int64_t count = static_cast<int64_t>(window_.size());
  std::memcpy(mine.data_ptr(), &count, 8);
  std::memcpy(mine.data_ptr<uint8_t>() + 8, window_.data(), window_.size() * sizeof(WireId));
  window_.clear();
  CollectiveId self;
  self.seq = seq;
  self.tag = "collective identity check";
  self.bytes = kRecordBytes;
  transport.begin(self);
  const c10::Device device = transport.device();
  auto all = at::empty({size_ * kRecordBytes}, at::TensorOptions().dtype(at::kByte).device(device));
  TransferCount ignored;
  transport.all_gather(all, mine.to(device), ignored);
  all = all.cpu();
  std::vector<Record> records;
  for (int r = 0; r < size_; ++r) records.push_back(decode(all.data_ptr<uint8_t>() + r * kRecordBytes));
  const Record& me = records[rank_];
  int64_t first = -1;
  for (int r = 0; r < size_ && first < 0; ++r) {
    const int64_t n = std::max(me.count, records[r].count);
    for (int64_t i = 0; i < n; ++i) {
      const bool both = i < me.count && i < records[r].count;
      if (!both || !records[r].ids[i].same_collective(me.ids[i])) {
        first = first < 0 ? i : std::min(first, i);
        break;
      }
    }
  }
  if (first < 0) return;
  std::ostringstream msg;
  msg << "collective mismatch on group '" << group_ << "' (found by the identity check in the queue):";
  for (int r = 0; r < size_; ++r) {
    msg << (r ? ";" : "") << " rank " << r << " ran ";
    if (first < records[r].count) {
      msg << records[r].ids[first].describe();
    } else {
      msg << "no collective there (it ran " << records[r].count << " since the last check)";
    }
  }
  msg << ". " << kLikelyMismatchCause;
  throw OrderMismatch(msg.str());
}

}  // namespace fsdp
