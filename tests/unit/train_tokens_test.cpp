// Token files of fsdp-train (apps/fsdp-train/token_file.h, data.h): uint16 and uint32 tokens,
// raw or behind llm.c's header, parsed from bytes; a held-out eval file (data.eval_path);
// micro-batches that together are the rank's slice of the larger batch; and every bad input
// (an id past the vocabulary, an eval file shorter than one sample, the wrong token_dtype, a size
// that is not a multiple of the token width) refused naming the file and the config field.
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "config.h"
#include "data.h"
#include "support/ranks.h"
#include "token_file.h"

namespace {

using train::DataConfig;
using train::Dataset;
using train::Split;
using train::TokenDtype;
using Bytes = std::vector<unsigned char>;

void put_le(Bytes& out, uint64_t v, int width) {
  for (int b = 0; b < width; ++b) out.push_back(static_cast<unsigned char>(v >> (8 * b)));
}

Bytes tokens(const std::vector<uint64_t>& ids, int width) {
  Bytes b;
  for (uint64_t t : ids) put_le(b, t, width);
  return b;
}

std::vector<uint64_t> counting(int64_t n, uint64_t start, uint64_t modulo) {
  std::vector<uint64_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back((start + static_cast<uint64_t>(i)) % modulo);
  return v;
}

std::string write(const std::string& name, const Bytes& bytes) {
  const std::string path = fsdp::testing::temp_path("tokens") + "-" + name;
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return path;
}

DataConfig file(const std::string& path, int64_t seq_len, TokenDtype dtype = TokenDtype::kUint16) {
  DataConfig d;
  d.source = train::DataSource::kFile;
  d.path = path;
  d.seq_len = seq_len;
  d.token_dtype = dtype;
  return d;
}

std::string layout_error(const Bytes& b, TokenDtype dtype) {
  try {
    train::parse_token_layout(b.data(), b.size(), "data file 'x.bin'", true, dtype, "data.token_dtype");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

std::string dataset_error(const DataConfig& d, int64_t vocab) {
  try {
    Dataset ds(d, vocab, 0);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

TEST(TrainTokens, Uint32TokensAboveUint16Range) {
  // Ids around 100,000: a vocabulary that uint16 cannot hold (Qwen's is 151,646).
  const auto ids = counting(400, 99990, 151646);
  const auto path = write("big.bin", tokens(ids, 4));
  Dataset data(file(path, 15, TokenDtype::kUint32), 151646, 3);
  const at::Tensor s = data.samples(0, 8, Split::kTrain);
  const auto* p = s.data_ptr<int64_t>();
  for (int64_t k = 0; k < 8; ++k) {
    for (int64_t i = 1; i < 16; ++i) EXPECT_EQ(p[k * 16 + i], (p[k * 16 + i - 1] + 1) % 151646);
    EXPECT_GE(p[k * 16], 99990);
  }
  EXPECT_HAS(data.describe(), "uint32 tokens, 400 tokens");
}

TEST(TrainTokens, LayoutFromBytes) {
  auto l = train::parse_token_layout(nullptr, 0, "f", false, TokenDtype::kUint16, "data.token_dtype");
  EXPECT_EQ(l.width, 1);
  const Bytes u16 = tokens({1, 2, 3}, 2);
  l = train::parse_token_layout(u16.data(), u16.size(), "f", true, TokenDtype::kUint16, "data.token_dtype");
  EXPECT_EQ(l.count, 3);
  EXPECT_EQ(train::token_at(u16.data(), l, 2), 3);
  // llm.c header, version 2: uint32 tokens after 1024 bytes.
  Bytes h;
  put_le(h, 20240520, 4);
  put_le(h, 2, 4);
  put_le(h, 2, 4);
  h.resize(1024, 0);
  put_le(h, 70000, 4);
  put_le(h, 5, 4);
  l = train::parse_token_layout(h.data(), h.size(), "f", true, TokenDtype::kUint32, "data.token_dtype");
  EXPECT_EQ(l.count, 2);
  EXPECT_EQ(train::token_at(h.data(), l, 0), 70000);
  // ... which is refused as uint16, naming the field and the fix.
  const auto e = layout_error(h, TokenDtype::kUint16);
  EXPECT_HAS(e, "data file 'x.bin': has llm.c's header for uint32 tokens (version 2)");
  EXPECT_HAS(e, "set data.token_dtype=\"uint32\"");
}

TEST(TrainTokens, WrongTokenDtypeIsRefusedNamingFileAndField) {
  // uint32 tokens of a small vocabulary read as uint16: every second value is 0.
  auto e = layout_error(tokens(counting(100, 1, 500), 4), TokenDtype::kUint16);
  EXPECT_HAS(e, "data file 'x.bin': every second uint16 is 0: it holds uint32 tokens");
  EXPECT_HAS(e, "set data.token_dtype=\"uint32\"");
  // A size that is not a multiple of the token width.
  e = layout_error(tokens(counting(101, 1, 500), 2), TokenDtype::kUint32);
  EXPECT_HAS(e, "data file 'x.bin': has 202 bytes, not a multiple of 4 (data.token_dtype=\"uint32\")");
  EXPECT_HAS(e, "for uint16 tokens set data.token_dtype=\"uint16\"");
  e = layout_error({1, 2, 3}, TokenDtype::kUint16);
  EXPECT_HAS(e, "has 3 bytes, not a multiple of 2");
  try {
    train::build_config(nullptr, {{"data.token_dtype", "int8"}});
    ADD_FAILURE() << "data.token_dtype=int8 was accepted";
  } catch (const std::invalid_argument& x) {
    EXPECT_HAS(std::string(x.what()), "data.token_dtype=\"int8\": must be one of \"uint16\", \"uint32\"");
  }
  // uint16 tokens read as uint32 pair into ids past the vocabulary: the fix names token_dtype too.
  const auto path = write("pairs.bin", tokens(counting(200, 1, 500), 2));
  e = dataset_error(file(path, 8, TokenDtype::kUint32), 500);
  EXPECT_HAS(e, "data file '" + path + "': token id ");
  EXPECT_HAS(e, "is >= model.vocab_size=500");
  EXPECT_HAS(e, "if the file holds uint16 tokens, set data.token_dtype=\"uint16\"");
}

TEST(TrainTokens, TokenPastTheVocabularyIsRefused) {
  auto ids = counting(300, 0, 100);
  ids[123] = 4242;
  const auto path = write("past.bin", tokens(ids, 4));
  const auto e = dataset_error(file(path, 8, TokenDtype::kUint32), 4000);
  EXPECT_HAS(e, "data file '" + path + "': token id 4242 at position 123 is >= model.vocab_size=4000");
  EXPECT_HAS(e, "set model.vocab_size to at least 4243");
}

TEST(TrainTokens, EvalFileGivesTheEvalSplitAndTheWholeTrainFileTrains) {
  const auto train_path = write("train.bin", tokens(counting(200, 0, 100), 2));
  const auto eval_path = write("eval.bin", tokens(counting(50, 100, 1000), 2));  // ids 100..149
  DataConfig d = file(train_path, 7);
  d.eval_path = eval_path;
  Dataset data(d, 1000, 1);
  const at::Tensor ev = data.samples(0, 16, Split::kEval);
  EXPECT_GE(ev.min().item<int64_t>(), 100);
  const at::Tensor tr = data.samples(0, 64, Split::kTrain);
  EXPECT_LT(tr.max().item<int64_t>(), 100);
  // Without the eval file the train split stops before the held-out tail (positions >= 180).
  EXPECT_HAS(data.describe(), "eval: file " + eval_path);
  EXPECT_EQ(data.describe().find("held out"), std::string::npos) << data.describe();
}

TEST(TrainTokens, EvalFileShorterThanOneSampleIsRefused) {
  const auto train_path = write("train2.bin", tokens(counting(200, 0, 100), 2));
  const auto eval_path = write("short.bin", tokens(counting(5, 0, 100), 2));
  DataConfig d = file(train_path, 8);
  d.eval_path = eval_path;
  const auto e = dataset_error(d, 100);
  EXPECT_HAS(e, "eval file '" + eval_path + "' (data.eval_path): holds 5 tokens (uint16 tokens)");
  EXPECT_HAS(e, "data.seq_len + 1 = 9");
  // A missing eval file names the field too.
  d.eval_path = eval_path + ".missing";
  EXPECT_HAS(dataset_error(d, 100), "(data.eval_path): cannot be opened");
}

TEST(TrainTokens, MicroBatchesAreTheRankSliceOfTheLargerBatch) {
  DataConfig d;
  d.seq_len = 8;
  Dataset data(d, 64, 2);
  for (int rank = 0; rank < 2; ++rank) {
    const auto big = train::rank_batch(data, 32, 8, rank, Split::kTrain);
    for (int64_t m = 0; m < 4; ++m) {
      const auto micro = train::micro_batch(data, 32, 2, rank, Split::kTrain, m, 4);
      EXPECT_TRUE(at::equal(micro.inputs, big.inputs.narrow(0, 2 * m, 2))) << rank << " " << m;
      EXPECT_TRUE(at::equal(micro.targets, big.targets.narrow(0, 2 * m, 2)));
    }
  }
}

TEST(TrainTokens, ConfigKeysAreCheckedAgainstSourceAndFiles) {
  using nlohmann::json;
  auto err = [](const json& j) {
    try {
      train::TrainConfig::from_json(j);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_HAS(err({{"data", {{"token_dtype", "uint8"}}}}), "config: data.token_dtype=\"uint8\": must be one of");
  EXPECT_HAS(err({{"data", {{"source", "file"}, {"path", "a.txt"}, {"token_dtype", "uint32"}}}}),
             "data.token_dtype=\"uint32\": applies to .bin token files");
  EXPECT_HAS(err({{"data", {{"eval_path", "e.bin"}}}}), "data.eval_path=\"e.bin\": needs data.source=\"file\"");
  EXPECT_HAS(err({{"data", {{"source", "file"}, {"path", "a.bin"}, {"eval_path", "e.txt"}}}}),
             "data.eval_path=\"e.txt\": must have the same format as data.path");
  EXPECT_HAS(err({{"train", {{"activation_checkpointing", "some"}}}}), "train.activation_checkpointing=\"some\"");
  EXPECT_HAS(err({{"train", {{"grad_accum_steps", 0}}}}), "train.grad_accum_steps=0: must be >= 1");
  EXPECT_HAS(err({{"fsdp", {{"loss_scale", "static"}}}}), "fsdp.loss_scale=\"static\"");
  EXPECT_HAS(err({{"train", {{"async_save", 1}}}}), "train.async_save=1: must be true or false");
  const auto c = train::TrainConfig::from_json(
      {{"data", {{"source", "file"}, {"path", "a.bin"}, {"token_dtype", "uint32"}, {"eval_path", "e.bin"}}},
       {"train", {{"activation_checkpointing", 2}, {"grad_accum_steps", 4}, {"async_save", true}}},
       {"fsdp", {{"param_dtype", "float16"}}}});
  EXPECT_EQ(c.train.activation_checkpointing, 2);
  EXPECT_TRUE(c.fsdp.loss_scaling());  // "auto" with float16
  EXPECT_EQ(train::TrainConfig::from_json(c.to_json()).to_json(), c.to_json());
  EXPECT_EQ(train::TrainConfig::from_json({{"train", {{"activation_checkpointing", "every"}}}})
                .train.activation_checkpointing,
            1);
  // token_dtype changes the sample stream, so the hash; the default leaves older hashes alone.
  auto d16 = c;
  d16.data.token_dtype = TokenDtype::kUint16;
  EXPECT_NE(c.config_hash(), d16.config_hash());
}

}  // namespace
