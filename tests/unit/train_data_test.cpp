// fsdp-train's data stream (apps/fsdp-train/data.h): sample k is the same whatever the world size,
// batch and rank slicing; rank slices partition the global batch; the synthetic task has the
// structure it claims; .bin (nanoGPT and llm.c) and text files give contiguous windows from the
// right split; bad files fail naming the file and the fix.
#include <cstdint>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "config.h"
#include "data.h"
#include "support/ranks.h"

namespace {

using train::DataConfig;
using train::Dataset;
using train::Split;

DataConfig synthetic(int64_t seq_len) {
  DataConfig d;
  d.seq_len = seq_len;
  return d;
}

DataConfig file(const std::string& path, int64_t seq_len) {
  DataConfig d;
  d.source = train::DataSource::kFile;
  d.path = path;
  d.seq_len = seq_len;
  return d;
}

// A fresh path ending in `name`, whose extension the file source looks at.
std::string temp_file(const std::string& name) { return fsdp::testing::temp_path("train") + "-" + name; }

std::string write_bytes(const std::string& name, const std::vector<uint8_t>& bytes) {
  const std::string path = temp_file(name);
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return path;
}

void put_le(std::vector<uint8_t>& out, uint64_t v, int width) {
  for (int b = 0; b < width; ++b) out.push_back(static_cast<uint8_t>(v >> (8 * b)));
}

// uint16 tokens 0, 1, 2, ... (mod `modulo`), optionally behind llm.c's header.
std::string write_counting_bin(const std::string& name, int64_t n, bool llmc_header, int64_t modulo = 1 << 16) {
  std::vector<uint8_t> bytes;
  if (llmc_header) {
    put_le(bytes, 20240520, 4);
    put_le(bytes, 1, 4);
    put_le(bytes, static_cast<uint64_t>(n), 4);
    bytes.resize(1024, 0);
  }
  for (int64_t i = 0; i < n; ++i) put_le(bytes, static_cast<uint64_t>(i % modulo), 2);
  return write_bytes(name, bytes);
}

std::string error_of(const DataConfig& d, int64_t vocab) {
  try {
    Dataset ds(d, vocab, 0);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument for " << d.path;
  return "";
}

TEST(TrainData, SampleIsTheSameWhateverTheWorldSizeAndSlicing) {
  const Dataset data(synthetic(16), 64, /*seed=*/3);
  const int64_t global_batch = 8;
  for (int64_t first : {int64_t{0}, int64_t{8}, int64_t{1000003}}) {
    const at::Tensor global = data.samples(first, global_batch, Split::kTrain);
    // Any sample is computable directly from its global index.
    for (int64_t i = 0; i < global_batch; ++i) {
      EXPECT_TRUE(at::equal(data.samples(first + i, 1, Split::kTrain)[0], global[i])) << first + i;
    }
    // Rank slices on 1, 2, 4 and 8 ranks are contiguous, disjoint and cover the global batch.
    for (int world : {1, 2, 4, 8}) {
      const int64_t per_rank = global_batch / world;
      std::vector<at::Tensor> inputs, targets;
      for (int r = 0; r < world; ++r) {
        const auto b = train::rank_batch(data, first, per_rank, r, Split::kTrain);
        ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{per_rank, 16}));
        inputs.push_back(b.inputs);
        targets.push_back(b.targets);
      }
      EXPECT_TRUE(at::equal(at::cat(inputs), global.narrow(1, 0, 16))) << "world " << world;
      EXPECT_TRUE(at::equal(at::cat(targets), global.narrow(1, 1, 16))) << "world " << world;
    }
  }
}

TEST(TrainData, StreamDependsOnSeedAndSplitOnly) {
  const Dataset a(synthetic(32), 64, 1), b(synthetic(32), 64, 1), other_seed(synthetic(32), 64, 2);
  const auto s = a.samples(0, 16, Split::kTrain);
  EXPECT_TRUE(at::equal(s, b.samples(0, 16, Split::kTrain)));
  EXPECT_FALSE(at::equal(s, other_seed.samples(0, 16, Split::kTrain)));
  EXPECT_FALSE(at::equal(s, a.samples(0, 16, Split::kEval)));
  EXPECT_FALSE(at::equal(s, a.samples(16, 16, Split::kTrain)));
}

TEST(TrainData, SyntheticTaskIsASparseChainThenACopy) {
  const int64_t vocab = 64, window = 33;
  const Dataset data(synthetic(window - 1), vocab, 0);
  const at::Tensor s = data.samples(0, 512, Split::kTrain);
  EXPECT_EQ(s.min().item<int64_t>(), 0);
  EXPECT_LT(s.max().item<int64_t>(), vocab);
  const int64_t half = (window + 1) / 2;
  std::vector<std::set<int64_t>> successors(vocab);
  for (int64_t k = 0; k < s.size(0); ++k) {
    const auto row = s[k];
    for (int64_t i = half; i < window; ++i) ASSERT_EQ(row[i].item<int64_t>(), row[i - half].item<int64_t>());
    for (int64_t i = 1; i < half; ++i) successors[row[i - 1].item<int64_t>()].insert(row[i].item<int64_t>());
  }
  // Every token has at most 4 successors: a bigram model can get well below log(vocab).
  size_t seen = 0;
  for (const auto& next : successors) {
    EXPECT_LE(next.size(), 4u);
    seen += next.size();
  }
  EXPECT_GT(seen, static_cast<size_t>(vocab));  // and the chain does branch
}

TEST(TrainData, BinFilesGiveContiguousWindowsFromTheirSplit) {
  const int64_t n = 3000, seq_len = 31, window = seq_len + 1;
  for (bool llmc : {false, true}) {
    const auto path = write_counting_bin(llmc ? "llmc.bin" : "nanogpt.bin", n, llmc);
    const Dataset data(file(path, seq_len), /*vocab=*/n, 5);
    EXPECT_NE(data.describe().find(llmc ? "llm.c, uint16 tokens" : "uint16 tokens"), std::string::npos);
    const int64_t eval_begin = n - n / 10;  // the last 10% is held out
    for (Split split : {Split::kTrain, Split::kEval}) {
      const at::Tensor s = data.samples(0, 64, split);
      std::set<int64_t> starts;
      for (int64_t k = 0; k < 64; ++k) {
        const int64_t start = s[k][0].item<int64_t>();
        starts.insert(start);
        for (int64_t i = 0; i < window; ++i) ASSERT_EQ(s[k][i].item<int64_t>(), start + i) << "llmc=" << llmc;
        if (split == Split::kTrain) {
          EXPECT_LE(start + window, eval_begin);
        } else {
          EXPECT_GE(start, eval_begin);
        }
      }
      EXPECT_GT(starts.size(), 32u);  // offsets are spread, not one window repeated
    }
  }
}

TEST(TrainData, TextFilesAreBytes) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "the quick brown fox " + std::to_string(i) + "\n";
  const auto path = write_bytes("corpus.txt", std::vector<uint8_t>(text.begin(), text.end()));
  const int64_t seq_len = 24;
  const Dataset data(file(path, seq_len), 256, 0);
  EXPECT_NE(data.describe().find("raw bytes"), std::string::npos);
  const at::Tensor s = data.samples(7, 16, Split::kTrain);
  for (int64_t k = 0; k < 16; ++k) {
    std::string window;
    for (int64_t i = 0; i <= seq_len; ++i) window += static_cast<char>(s[k][i].item<int64_t>());
    EXPECT_NE(text.find(window), std::string::npos) << window;
  }
}

TEST(TrainData, ShortFileServesBothSplitsFromTheWholeFile) {
  const auto path = write_counting_bin("short.bin", 40, false);
  const Dataset data(file(path, 31), 40, 0);
  EXPECT_NE(data.describe().find("too short to hold out"), std::string::npos);
  EXPECT_EQ(data.samples(0, 4, Split::kEval).size(1), 32);
}

TEST(TrainData, BadFilesFailNamingTheFile) {
  const std::string missing = temp_file("missing.bin");
  EXPECT_NE(error_of(file(missing, 8), 256).find("data file '" + missing + "': cannot be opened"), std::string::npos);

  const auto empty = write_bytes("empty.txt", {});
  EXPECT_NE(error_of(file(empty, 8), 256).find("data file '" + empty + "': is empty"), std::string::npos);

  const auto tiny = write_bytes("tiny.txt", {'a', 'b', 'c'});
  EXPECT_NE(error_of(file(tiny, 8), 256)
                .find("data file '" + tiny +
                      "': holds 3 tokens (raw bytes), fewer than one "
                      "sample needs: data.seq_len + 1 = 9"),
            std::string::npos);

  const auto big_ids = write_counting_bin("big_ids.bin", 600, false);
  const std::string what = error_of(file(big_ids, 8), 512);
  EXPECT_NE(what.find("data file '" + big_ids + "': token id 512 at position 512 is >= model.vocab_size=512"),
            std::string::npos)
      << what;
  EXPECT_NE(what.find("set model.vocab_size to at least 600"), std::string::npos) << what;

  const auto odd = write_bytes("odd.bin", {1, 2, 3});
  EXPECT_NE(error_of(file(odd, 1), 256).find("'" + odd + "': has 3 bytes, not a multiple of 2"), std::string::npos);

  // llm.c header whose count does not match the file.
  std::vector<uint8_t> bad;
  put_le(bad, 20240520, 4);
  put_le(bad, 1, 4);
  put_le(bad, 100, 4);
  bad.resize(1024 + 20, 0);
  const auto truncated = write_bytes("truncated.bin", bad);
  EXPECT_NE(error_of(file(truncated, 4), 256).find("llm.c header says 100 tokens"), std::string::npos);

  // A byte file needs a byte vocabulary.
  const auto text = write_bytes("bytes.txt", std::vector<uint8_t>(100, 'z'));
  EXPECT_NE(error_of(file(text, 8), 64).find("token id 122 at position 0 is >= model.vocab_size=64"),
            std::string::npos);
}

}  // namespace
