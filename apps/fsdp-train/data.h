// Training data as one globally ordered stream of samples, independent of the world size.
//
// Sample k of a split is a window of seq_len + 1 tokens that is a pure function of (seed, split,
// k): no state, no shuffle buffer, no per-rank files. The global batch that starts at sample s
// holds samples [s, s + G) with G = batch_size_per_rank * world_size, and rank r takes the
// contiguous slice [s + r*B, s + (r+1)*B). A run therefore resumes from one number (samples_seen)
// on any world size, and runs on 1, 2 or 4 ranks with the same G see exactly the same batches.
//
// Sources:
//  - "synthetic": built in, needs no download. A fixed sparse Markov chain over the vocabulary
//    (each token has 4 possible successors, p = .55/.25/.12/.08, ~1.1 nats) generates the first half
//    of each window and the second half repeats the first. A bigram model gets the loss from
//    log(vocab) to ~1.2 within a few hundred steps; attending back to the first half (an
//    induction head) takes the copied half to ~0 and the mean towards ~0.6.
//  - "file": `.bin` files of little-endian tokens of data.token_dtype, uint16 or uint32 (nanoGPT's
//    raw format, or llm.c's with its 1024-byte header: see token_file.h, which parses them from
//    bytes); any other file is raw bytes (a byte-level vocabulary of 256). Windows start at
//    pseudo-random offsets derived from (seed, split, k). With data.eval_path the eval split reads
//    that file and the train split the whole of data.path; without it the last 10% of the file is
//    held out for evaluation when both parts can hold a window, and a shorter file serves both
//    splits from the whole file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "config.h"

namespace train {

enum class Split { kTrain = 0, kEval = 1 };

// Where the windows come from.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // Writes the `window` tokens of sample `index` of `split` to out[0 .. window).
  virtual void fill(int64_t index, Split split, int64_t window, int64_t* out) const = 0;
  virtual std::string describe() const = 0;
};

class Dataset {
 public:
  // Opens and validates the source (and data.eval_path): a missing, empty or too-short file, a
  // token id >= vocab_size or a layout that disagrees with data.token_dtype throws
  // std::invalid_argument naming the file, the config key and the fix.
  Dataset(const DataConfig& data, int64_t vocab_size, uint64_t seed);

  int64_t seq_len() const { return seq_len_; }
  // Samples [first, first + count) of `split`: int64 [count, seq_len + 1].
  at::Tensor samples(int64_t first, int64_t count, Split split) const;
  std::string describe() const { return source_->describe(); }

 private:
  std::shared_ptr<const TokenSource> source_;
  int64_t seq_len_;
};

struct Batch {
  at::Tensor inputs;   // int64 [B, seq_len]
  at::Tensor targets;  // int64 [B, seq_len]: inputs shifted left by one
};

// Rank `rank`'s slice of the global batch that starts at global sample `first`.
Batch rank_batch(const Dataset& data, int64_t first, int64_t batch_size_per_rank, int rank, Split split);
// With gradient accumulation each rank's slice of the global batch (accum * batch_size_per_rank
// samples) is cut into `accum` micro-batches; this is micro-batch `micro` of rank `rank`: samples
// first + (rank * accum + micro) * B, ... So a rank's micro-batches together are its slice of the
// run with a batch `accum` times larger, and accum = 1 is rank_batch.
Batch micro_batch(const Dataset& data, int64_t first, int64_t batch_size_per_rank, int rank, Split split, int64_t micro,
                  int64_t accum);

// The 64-bit mixer behind every pseudo-random choice here (splitmix64's finaliser).
uint64_t mix64(uint64_t x);

}  // namespace train
