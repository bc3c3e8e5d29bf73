// The synthetic and file token sources, and batch slicing. See data.h for the sample stream.
#include "data.h"

#include "base/strings.h"
#include "token_file.h"

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

[[noreturn]] void file_error(const std::string& label, const std::string& why) {
  throw std::invalid_argument(label + ": " + why);
}

// A read-only mapping of a whole file, unmapped when the last source using it goes.
class MappedFile {
 public:
  MappedFile(const std::string& path, const std::string& label) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) file_error(label, std::string("cannot be opened: ") + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      file_error(label, "is not a regular file");
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ == 0) {
      ::close(fd);
      file_error(label, "is empty");
    }
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);  // the mapping keeps the file
    if (p == MAP_FAILED) file_error(label, std::string("cannot be mapped: ") + std::strerror(errno));
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
  // `field` is the config key that names the file (data.path or data.eval_path); `hold_out` keeps
  // the last 10% for the eval split (see data.h), else both splits read the whole file.
  FileSource(const std::string& path, const std::string& field, const DataConfig& data, int64_t vocab, uint64_t seed,
             bool hold_out)
      : path_(path),
        label_(field == "data.path" ? "data file '" + path + "'" : "eval file '" + path + "' (" + field + ")"),
        file_(path, label_),
        seed_(seed) {
    const int64_t window = data.seq_len + 1;
    layout_ = parse_token_layout(file_.data(), file_.size(), label_, fsdp::base::ends_with(path, ".bin"),
                                 data.token_dtype, "data.token_dtype");
    if (layout_.count < window) {
      file_error(label_, "holds " + std::to_string(layout_.count) + " tokens (" + layout_.format +
                             "), fewer than one sample needs: data.seq_len + 1 = " + std::to_string(window) +
                             "; use a longer file (" + field + ") or a smaller data.seq_len");
    }
    check_token_ids(file_.data(), layout_, vocab, label_, "data.token_dtype");
    const int64_t count = layout_.count;
    // Hold out the tail for evaluation when both parts fit a window; see data.h.
    const int64_t eval = std::max<int64_t>(window, count / 10);
    if (hold_out && count - eval >= window) {
      train_len_ = count - eval;
      eval_begin_ = train_len_;
      eval_len_ = eval;
    } else {
      train_len_ = eval_len_ = count;
      eval_begin_ = 0;
    }
    hold_out_ = hold_out;
  }

  void fill(int64_t index, Split split, int64_t window, int64_t* out) const override {
    const int64_t begin = split == Split::kTrain ? 0 : eval_begin_;
    const int64_t len = split == Split::kTrain ? train_len_ : eval_len_;
    SampleRng rng(sample_key(seed_, split, index));
    const int64_t start = begin + static_cast<int64_t>(rng.below(static_cast<uint64_t>(len - window + 1)));
    for (int64_t i = 0; i < window; ++i) out[i] = token_at(file_.data(), layout_, start + i);
  }

  std::string describe() const override {
    std::string s = "file " + path_ + " (" + layout_.format + ", " + std::to_string(layout_.count) + " tokens";
    if (!hold_out_) return s + ")";
    if (eval_begin_ > 0) return s + "; last " + std::to_string(eval_len_) + " held out for eval)";
    return s + "; too short to hold out an eval part: eval samples come from the whole file)";
  }

 private:
  std::string path_, label_;
  MappedFile file_;
  uint64_t seed_;
  TokenLayout layout_;
  bool hold_out_ = true;
  int64_t train_len_ = 0, eval_begin_ = 0, eval_len_ = 0;
};

// Training windows from one source, eval windows from another (data.eval_path).
class SplitSource : public TokenSource {
 public:
  SplitSource(std::shared_ptr<const TokenSource> train, std::shared_ptr<const TokenSource> eval)
      : train_(std::move(train)), eval_(std::move(eval)) {}
  void fill(int64_t index, Split split, int64_t window, int64_t* out) const override {
    (split == Split::kTrain ? train_ : eval_)->fill(index, split, window, out);
  }
  std::string describe() const override { return "train: " + train_->describe() + "; eval: " + eval_->describe(); }

 private:
  std::shared_ptr<const TokenSource> train_, eval_;
};

}  // namespace

Dataset::Dataset(const DataConfig& data, int64_t vocab_size, uint64_t seed) : seq_len_(data.seq_len) {
  if (data.seq_len < 1)
    throw std::invalid_argument("config: data.seq_len=" + std::to_string(data.seq_len) + ": must be >= 1");
  if (data.source == DataSource::kSynthetic) {
    if (vocab_size < 8) {
      throw std::invalid_argument("config: model.vocab_size=" + std::to_string(vocab_size) +
                                  ": the synthetic task needs at least 8 tokens");
    }
    source_ = std::make_shared<SyntheticSource>(vocab_size, seed);
  } else {
    const bool eval_file = !data.eval_path.empty();
    source_ = std::make_shared<FileSource>(data.path, "data.path", data, vocab_size, seed, /*hold_out=*/!eval_file);
  }
  if (!data.eval_path.empty()) {
    auto eval = std::make_shared<FileSource>(data.eval_path, "data.eval_path", data, vocab_size, seed, false);
    source_ = std::make_shared<SplitSource>(source_, std::move(eval));
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
  return micro_batch(data, first, batch_size_per_rank, rank, split, 0, 1);
}

Batch micro_batch(const Dataset& data, int64_t first, int64_t batch_size_per_rank, int rank, Split split, int64_t micro,
                  int64_t accum) {
  at::Tensor w = data.samples(first + (rank * accum + micro) * batch_size_per_rank, batch_size_per_rank, split);
  const int64_t T = data.seq_len();
  return {w.narrow(1, 0, T).contiguous(), w.narrow(1, 1, T).contiguous()};
}

}  // namespace train
