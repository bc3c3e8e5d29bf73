// Collectives by name and their counters, and collective identities as the ranks compare them
// (Note [Collective identity in the framing] in ring.cpp).
#include <algorithm>
#include <cstring>
#include <sstream>

#include <c10/core/ScalarType.h>

#include "comm/transport.h"

namespace fsdp {
namespace {

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

std::string kind_name(int kind) {
  if (kind < 0) return "the communicator's own exchange";
  if (kind >= kNumCollectiveKinds) return "an unknown collective (kind " + std::to_string(kind) + ")";
  return collective_name(static_cast<CollectiveKind>(kind));
}

std::string dtype_name(int dtype) {
  if (dtype < 0 || dtype >= static_cast<int>(c10::ScalarType::NumOptions)) return "";
  return std::string(" of ") + c10::toString(static_cast<c10::ScalarType>(dtype));
}

std::string describe_parts(int kind, const std::string& tag, bool truncated, uint64_t bytes, int dtype, uint64_t seq) {
  std::ostringstream s;
  s << kind_name(kind) << " '" << tag << (truncated ? "..." : "") << "' (" << bytes << " bytes" << dtype_name(dtype)
    << ") as collective #" << seq;
  return s.str();
}

}  // namespace

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kBarrier: return "barrier";
  }
  return "unknown";
}

uint64_t CommStats::total_bytes_sent() const {
  uint64_t total = 0;
  for (const auto& op : ops) total += op.bytes_sent;
  return total;
}

double CommStats::total_wait_s() const {
  double total = 0;
  for (const auto& op : ops) total += op.wait_s;
  return total;
}

CommStats CommStats::operator-(const CommStats& earlier) const {
  CommStats d;
  for (int i = 0; i < kNumCollectiveKinds; ++i) {
    d.ops[i].calls = ops[i].calls - earlier.ops[i].calls;
    d.ops[i].bytes_sent = ops[i].bytes_sent - earlier.ops[i].bytes_sent;
    d.ops[i].bytes_received = ops[i].bytes_received - earlier.ops[i].bytes_received;
    d.ops[i].busy_s = ops[i].busy_s - earlier.ops[i].busy_s;
    d.ops[i].wait_s = ops[i].wait_s - earlier.ops[i].wait_s;
  }
  return d;
}

std::string CollectiveId::describe() const { return describe_parts(kind, tag, false, bytes, dtype, seq); }

WireId WireId::of(const CollectiveId& id) {
  WireId w;
  w.seq = id.seq;
  w.bytes = id.bytes;
  w.tag_hash = fnv1a(id.tag);
  w.kind = id.kind;
  w.dtype = id.dtype;
  w.tag_len = static_cast<uint32_t>(id.tag.size());
  std::memcpy(w.tag, id.tag.data(), std::min(id.tag.size(), sizeof(w.tag)));
  return w;
}

bool WireId::same_collective(const WireId& o) const {
  return seq == o.seq && bytes == o.bytes && tag_hash == o.tag_hash && kind == o.kind && dtype == o.dtype &&
         tag_len == o.tag_len;
}

std::string WireId::describe() const {
  // The bytes came from a peer: never read past the field, whatever tag_len says.
  const size_t n = std::min<size_t>(tag_len, sizeof(tag));
  return describe_parts(kind, std::string(tag, n), tag_len > sizeof(tag), bytes, dtype, seq);
}

const char* const kLikelyMismatchCause =
    "The ranks no longer issue the same collectives in the same order: most likely one rank skipped or repeated a "
    "forward or backward (or ran another number of micro-batches, steps or evaluations). Forwards that differ "
    "between ranks (uneven eval or generation, a unit one rank's batch skips) must run inside an fsdp::Join "
    "(fsdp/join.h)";

std::string mismatch_text(int rank, const WireId& mine, int peer, const WireId& theirs) {
  std::ostringstream s;
  s << "collective mismatch: this rank (rank " << rank << ") runs " << mine.describe() << " but rank " << peer
    << " runs " << theirs.describe() << ". " << kLikelyMismatchCause
    << ". Nothing of the mismatched collective was used. FSDP_CHECK_COLLECTIVES=1 reports what every rank issued";
  return s.str();
}

}  // namespace fsdp
