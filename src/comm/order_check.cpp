// The collective-order check: a fingerprint exchange before each collective. See Note
// [Collective-order check] in communicator.cpp.
#include "comm/order_check.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <sstream>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp {
namespace {

// Fingerprint words: seq, kind, bytes, dtype, tag length, then the tag's bytes (truncated).
constexpr int64_t kFingerprintWords = 40;
constexpr int64_t kFingerprintHead = 5;
constexpr size_t kFingerprintTagBytes = (kFingerprintWords - kFingerprintHead) * sizeof(int64_t);

struct Fingerprint {
  int64_t seq = 0, kind = 0, bytes = 0, dtype = -1;
  std::string tag;
  bool operator==(const Fingerprint& o) const {
    return seq == o.seq && kind == o.kind && bytes == o.bytes && dtype == o.dtype && tag == o.tag;
  }
  std::string describe() const {
    std::ostringstream s;
    s << collective_name(static_cast<CollectiveKind>(kind)) << " '" << tag << "' (" << bytes << " bytes";
    if (dtype >= 0) s << " of " << c10::toString(static_cast<at::ScalarType>(dtype));
    s << ") as collective #" << seq;
    return s.str();
  }
};

at::Tensor encode(const Fingerprint& f) {
  auto t = at::zeros({kFingerprintWords}, at::kLong);
  auto* w = t.data_ptr<int64_t>();
  w[0] = f.seq, w[1] = f.kind, w[2] = f.bytes, w[3] = f.dtype;
  const size_t n = std::min(f.tag.size(), kFingerprintTagBytes);
  w[4] = static_cast<int64_t>(n);
  std::memcpy(w + kFingerprintHead, f.tag.data(), n);
  return t;
}

Fingerprint decode(const int64_t* w) {
  Fingerprint f;
  f.seq = w[0], f.kind = w[1], f.bytes = w[2], f.dtype = w[3];
  const size_t n = std::min<size_t>(static_cast<size_t>(std::max<int64_t>(w[4], 0)), kFingerprintTagBytes);
  f.tag.assign(reinterpret_cast<const char*>(w + kFingerprintHead), n);
  if (f.kind < 0 || f.kind >= kNumCollectiveKinds) f.kind = 0;
  return f;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << (ranks.size() > 1 ? "ranks " : "rank ");
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  return s.str();
}

std::string key_prefix(const CommunicatorOptions& options) { return "fsdp/order/" + options.name + "/"; }

// Which ranks never reached collective #seq and where they are, from what each posted to the
// store; empty when every rank got there.
std::string who_is_behind(const CommunicatorOptions& options, int rank, int size, int64_t seq) {
  std::vector<int> behind;
  std::ostringstream where;
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    const auto posted = options.order_lookup(key_prefix(options) + std::to_string(r));
    if (!posted) {
      behind.push_back(r);
      where << "; rank " << r << " has run no collective on group '" << options.name << "'";
      continue;
    }
    const std::string& v = *posted;
    const auto tab = v.find('\t');
    const int64_t their = std::stoll(v.substr(0, tab));
    if (their < seq) {
      behind.push_back(r);
      where << "; rank " << r << " is at collective #" << their << ": "
            << (tab == std::string::npos ? "" : v.substr(tab + 1));
    }
  }
  if (behind.empty()) return "";
  std::ostringstream s;
  s << ": " << rank_list(behind) << " never reached collective #" << seq << where.str();
  return s.str();
}

// The fingerprint exchange failed (usually: timed out). Who never got here? Ask the store where
// every rank is.
[[noreturn]] void throw_unmatched(const CommunicatorOptions& options, int rank, int size, const OrderProbe& probe,
                                  const std::exception& e) {
  std::ostringstream msg;
  msg << "collective-order check: " << probe.description << " as collective #" << probe.seq
      << " was not matched by every rank within " << std::chrono::duration<double>(options.timeout).count() << " s";
  if (options.order_lookup) {
    try {
      msg << who_is_behind(options, rank, size, probe.seq);
    } catch (const std::exception& se) {
      msg << " (the store could not say which rank is behind: " << se.what() << ")";
    }
  }
  msg << ": " << e.what();
  throw TimeoutError(msg.str());
}

// The ranks issued different collectives: group them by what they issued, in rank order of first
// appearance.
[[noreturn]] void throw_mismatch(const std::vector<Fingerprint>& prints, const std::string& group, int64_t seq) {
  std::vector<std::pair<Fingerprint, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(prints.size()); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == prints[r]; });
    if (it == groups.end()) {
      groups.push_back({prints[r], {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::ostringstream msg;
  msg << "collective-order mismatch on group '" << group << "' at collective #" << seq << ": ";
  for (size_t i = 0; i < groups.size(); ++i) {
    msg << (i ? "; " : "") << rank_list(groups[i].second) << " issued " << groups[i].first.describe();
  }
  msg << " (every rank must issue the same collectives in the same order; forwards that differ between ranks, "
         "such as uneven eval or generation or a unit one rank's batch skips, must run inside an fsdp::Join)";
  throw OrderMismatch(msg.str());
}

}  // namespace

void check_collective_order(Transport& transport, const CommunicatorOptions& options, int rank, int size,
                            const OrderProbe& probe) {
  Fingerprint mine;
  mine.seq = probe.seq;
  mine.kind = static_cast<int64_t>(probe.kind);
  mine.bytes = static_cast<int64_t>(probe.bytes);
  mine.dtype = probe.dtype;
  mine.tag = probe.tag;
  if (options.order_post) {
    options.order_post(key_prefix(options) + std::to_string(rank),
                       std::to_string(probe.seq) + "\t" + probe.description);
  }
  // The fingerprints travel where the transport moves data (device memory for NCCL).
  const c10::Device device = transport.device();
  auto all = at::empty({size * kFingerprintWords}, at::TensorOptions().dtype(at::kLong).device(device));
  TransferCount ignored;
  try {
    transport.all_gather(all, encode(mine).to(device), ignored);
  } catch (const std::exception& e) {
    throw_unmatched(options, rank, size, probe, e);
  }
  all = all.cpu();
  const auto* w = all.data_ptr<int64_t>();
  std::vector<Fingerprint> prints;
  bool same = true;
  for (int r = 0; r < size; ++r) {
    prints.push_back(decode(w + r * kFingerprintWords));
    same = same && prints.back() == mine;
  }
  if (!same) throw_mismatch(prints, options.name, probe.seq);
}

}  // namespace fsdp
