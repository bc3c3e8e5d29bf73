// The synthetic and file token sources, and batch slicing. See data.h for the sample stream.
#include "data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <ATen/ops/empty.h>

namespace train {

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

namespace {

// The seed of sample `index` of `split`: chained so that no two (seed, split, index) collide by
// simple arithmetic (e.g. seed + 1 with index - 1).
uint64_t sample_key(uint64_t seed, Split split, int64_t index) {
  return mix64(mix64(mix64(seed) ^ static_cast<uint64_t>(split)) ^ static_cast<uint64_t>(index));
}

// A tiny stream generator for the choices inside one sample (splitmix64).
class SampleRng {
 public:
  explicit SampleRng(uint64_t key) : state_(key) {}
  uint64_t next() { return mix64(state_++); }
  // Uniform in [0, n); the modulo bias is below 2^-40 for any n used here.
  uint64_t below(uint64_t n) { return next() % n; }

 private:
  uint64_t state_;
};

// ---- synthetic -----------------------------------------------------------------------------------

class SyntheticSource : public TokenSource {
 public:
  static constexpr int kSuccessors = 4;
  // Cumulative successor probabilities, in units of 1/100: .55, .25, .12, .08.
  static constexpr std::array<int, kSuccessors> kCumulative{55, 80, 92, 100};
  // The chain is part of the task, not of the run: the same for every seed, so that runs with
  // different seeds (init and sample order) learn the same thing.
  static constexpr uint64_t kTaskSeed = 0x7a5c0de5eedULL;

  SyntheticSource(int64_t vocab, uint64_t seed) : vocab_(vocab), seed_(seed), successors_(vocab * kSuccessors) {
    SampleRng rng(kTaskSeed);
    for (int64_t t = 0; t < vocab; ++t) {
      // Distinct successors, so each has exactly its listed probability.
      for (int j = 0; j < kSuccessors; ++j) {
        int64_t s;
        bool dup;
        do {
          s = static_cast<int64_t>(rng.below(vocab));
          dup = false;
          for (int i = 0; i < j; ++i) dup = dup || successors_[t * kSuccessors + i] == s;
        } while (dup);
        successors_[t * kSuccessors + j] = s;
      }
    }
  }

  void fill(int64_t index, Split split, int64_t window, int64_t* out) const override {
    SampleRng rng(sample_key(seed_, split, index));
    const int64_t half = (window + 1) / 2;
    out[0] = static_cast<int64_t>(rng.below(vocab_));
    for (int64_t i = 1; i < half; ++i) {
      const int u = static_cast<int>(rng.below(100));
      int j = 0;
      while (u >= kCumulative[j]) ++j;
      out[i] = successors_[out[i - 1] * kSuccessors + j];
    }
    for (int64_t i = half; i < window; ++i) out[i] = out[i - half];
  }

  std::string describe() const override {
    return "synthetic (sparse Markov chain over " + std::to_string(vocab_) +
           " tokens, second half of each window "
           "repeats the first)";
  }

 private:
  int64_t vocab_;
  uint64_t seed_;
  std::vector<int64_t> successors_;  // [vocab, kSuccessors]
};

// ---- file ----------------------------------------------------------------------------------------

[[noreturn]] void file_error(const std::string& path, const std::string& why) {
  throw std::invalid_argument("data file '" + path + "': " + why);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A read-only mapping of a whole file, unmapped when the last source using it goes.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) file_error(path, std::string("cannot be opened: ") + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      file_error(path, "is not a regular file");
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ == 0) {
      ::close(fd);
      file_error(path, "is empty");
    }
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);  // the mapping keeps the file
    if (p == MAP_FAILED) file_error(path, std::string("cannot be mapped: ") + std::strerror(errno));
    data_ = static_cast<const unsigned char*>(p);
  }
  ~MappedFile() { ::munmap(const_cast<unsigned char*>(data_), size_); }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

class FileSource : public TokenSource {
 public:
  // llm.c's .bin header: 256 int32, [0] magic, [1] version (1: uint16 tokens, 2: uint32), [2] count.
  static constexpr int32_t kLlmcMagic = 20240520;
  static constexpr size_t kLlmcHeaderBytes = 256 * 4;

  FileSource(const std::string& path, int64_t window, int64_t vocab, uint64_t seed)
      : path_(path), file_(path), seed_(seed) {
    if (ends_with(path, ".bin")) {
      read_bin_layout();
    } else {
      format_ = "raw bytes";
      width_ = 1;
      offset_ = 0;
      count_ = static_cast<int64_t>(file_.size());
    }
    if (count_ < window) {
      file_error(path_, "holds " + std::to_string(count_) + " tokens (" + format_ +
                            "), fewer than one sample needs: " + "data.seq_len + 1 = " + std::to_string(window) +
                            "; use a longer file or a smaller data.seq_len");
    }
    check_vocab(vocab);
    // Hold out the tail for evaluation when both parts fit a window; see data.h.
    const int64_t eval = std::max<int64_t>(window, count_ / 10);
    if (count_ - eval >= window) {
      train_len_ = count_ - eval;
      eval_begin_ = train_len_;
      eval_len_ = eval;
    } else {
      train_len_ = eval_len_ = count_;
      eval_begin_ = 0;
    }
  }

  void fill(int64_t index, Split split, int64_t window, int64_t* out) const override {
    const int64_t begin = split == Split::kTrain ? 0 : eval_begin_;
    const int64_t len = split == Split::kTrain ? train_len_ : eval_len_;
    SampleRng rng(sample_key(seed_, split, index));
    const int64_t start = begin + static_cast<int64_t>(rng.below(static_cast<uint64_t>(len - window + 1)));
    for (int64_t i = 0; i < window; ++i) out[i] = token(start + i);
  }

  std::string describe() const override {
    std::string s = "file " + path_ + " (" + format_ + ", " + std::to_string(count_) + " tokens; ";
    if (eval_begin_ > 0) return s + "last " + std::to_string(eval_len_) + " held out for eval)";
    return s + "too short to hold out an eval part: eval samples come from the whole file)";
  }

 private:
  int64_t token(int64_t i) const {
    const unsigned char* p = file_.data() + offset_ + static_cast<size_t>(i) * width_;
    // Little-endian on disk, whatever the host.
    uint64_t v = 0;
    for (int b = width_ - 1; b >= 0; --b) v = (v << 8) | p[b];
    return static_cast<int64_t>(v);
  }

  void read_bin_layout() {
    format_ = "uint16 tokens";
    width_ = 2;
    offset_ = 0;
    const unsigned char* d = file_.data();
    auto i32 = [&](size_t k) {
      return static_cast<int32_t>(d[4 * k] | (d[4 * k + 1] << 8) | (d[4 * k + 2] << 16) |
                                  (static_cast<uint32_t>(d[4 * k + 3]) << 24));
    };
    if (file_.size() >= kLlmcHeaderBytes && i32(0) == kLlmcMagic) {
      const int32_t version = i32(1);
      if (version != 1 && version != 2) {
        file_error(path_, "has llm.c's header with version " + std::to_string(version) + " (expected 1 or 2)");
      }
      width_ = version == 1 ? 2 : 4;
      format_ = version == 1 ? "llm.c, uint16 tokens" : "llm.c, uint32 tokens";
      offset_ = kLlmcHeaderBytes;
      count_ = i32(2);
      const size_t need = kLlmcHeaderBytes + static_cast<size_t>(std::max(count_, int64_t{0})) * width_;
      if (count_ < 0 || need != file_.size()) {
        file_error(path_, "llm.c header says " + std::to_string(count_) + " tokens, which needs " +
                              std::to_string(need) + " bytes, but the file has " + std::to_string(file_.size()));
      }
      return;
    }
    if (file_.size() % 2 != 0) {
      file_error(path_, "has an odd size (" + std::to_string(file_.size()) +
                            " bytes), so it is not uint16 tokens; .bin files must hold little-endian uint16 tokens");
    }
    count_ = static_cast<int64_t>(file_.size() / 2);
  }

  // One pass at start-up so a wrong vocabulary fails now, naming the token, not as an index error
  // deep inside the embedding hours later.
  void check_vocab(int64_t vocab) const {
    if (width_ < 8 && vocab >= (int64_t{1} << (8 * width_))) return;  // no id of this width can be too big
    for (int64_t i = 0; i < count_; ++i) {
      const int64_t t = token(i);
      if (t >= vocab) {
        int64_t max = t;
        for (int64_t j = i + 1; j < count_; ++j) max = std::max(max, token(j));
        file_error(path_, "token id " + std::to_string(t) + " at position " + std::to_string(i) +
                              " is >= model.vocab_size=" + std::to_string(vocab) +
                              "; set model.vocab_size to at least " + std::to_string(max + 1));
      }
    }
  }

  std::string path_;
  MappedFile file_;
  uint64_t seed_;
  std::string format_;
  int width_ = 1;
  size_t offset_ = 0;
  int64_t count_ = 0;
  int64_t train_len_ = 0, eval_begin_ = 0, eval_len_ = 0;
};

}  // namespace

Dataset::Dataset(const DataConfig& data, int64_t vocab_size, uint64_t seed) : seq_len_(data.seq_len) {
  if (data.seq_len < 1)
    throw std::invalid_argument("config: data.seq_len=" + std::to_string(data.seq_len) + ": must be >= 1");
  if (data.source == "synthetic") {
    if (vocab_size < 8) {
      throw std::invalid_argument("config: model.vocab_size=" + std::to_string(vocab_size) +
                                  ": the synthetic task needs at least 8 tokens");
    }
    source_ = std::make_shared<SyntheticSource>(vocab_size, seed);
  } else if (data.source == "file") {
    source_ = std::make_shared<FileSource>(data.path, data.seq_len + 1, vocab_size, seed);
  } else {
    throw std::invalid_argument("config: data.source=\"" + data.source + "\": must be \"synthetic\" or \"file\"");
  }
}

at::Tensor Dataset::samples(int64_t first, int64_t count, Split split) const {
  const int64_t window = seq_len_ + 1;
  at::Tensor out = at::empty({count, window}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) source_->fill(first + i, split, window, p + i * window);
  return out;
}

Batch rank_batch(const Dataset& data, int64_t first, int64_t batch_size_per_rank, int rank, Split split) {
  at::Tensor w = data.samples(first + rank * batch_size_per_rank, batch_size_per_rank, split);
  const int64_t T = data.seq_len();
  return {w.narrow(1, 0, T).contiguous(), w.narrow(1, 1, T).contiguous()};
}

}  // namespace train
