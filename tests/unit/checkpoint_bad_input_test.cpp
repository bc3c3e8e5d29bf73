// Bad checkpoints through checkpoint::load, the way a user meets them: a committed checkpoint
// whose model file is truncated at every boundary (length prefix, header, each tensor's first and
// last byte), whose header claims a length over the limit, has overlapping, gapped or out-of-bounds
// offsets, a shape whose size overflows, an unknown dtype, a duplicate name, another dtype than
// the model's (retyped), whose index points outside the directory, or whose train_state.json is
// malformed in each field load reads. Each must throw CheckpointError naming the file (and the
// tensor or field), and leave the model's and optimizer's state as it was: load validates before
// it changes anything. (safetensors_test.cpp covers the parsers byte by byte; this covers load.)
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>

#include <nlohmann/json.hpp>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"
#include "shard/testing.h"
#include "support/models.h"
#include "support/ranks.h"
#include "support/sharded_model.h"

namespace fsdp {
namespace {
using io::join;
using nlohmann::json;
using testing::Net;
using testing::NetOptions;

NetOptions small_net() {
  NetOptions o;
  o.in = 5, o.dim = 6, o.hidden = 7, o.out = 3, o.blocks = 2;
  return o;
}

using Sharded = testing::ShardedModel;

// A sharded net, initialised from `seed`, after one step.
Sharded make(DeviceMesh& mesh, uint64_t seed) {
  testing::ShardedModelOptions o;
  o.net = small_net();
  o.shard.init(init::normal(0.3, seed));
  auto s = testing::make_sharded_model(mesh, o);
  auto x = at::randn({4, small_net().in}), y = at::randn({4, small_net().out});
  testing::train_on_batch(s, x, y);
  return s;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The shards and optimizer state of a model, to check a failed load changed nothing.
std::vector<at::Tensor> state_of(Sharded& s) {
  std::vector<at::Tensor> out;
  for (const auto& unit : fsdp::testing::units(*s.root)) {
    for (auto& fp : unit->flat_params()) out.push_back(fp->sharded_param().clone());
  }
  return out;
}

class CheckpointBadInput : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    good_ = new std::string(testing::temp_path("ckpt-bad-input-good"));
    io::make_dirs(*good_);
    auto dist = Dist::single();
    DeviceMesh mesh(dist);
    auto s = make(mesh, 1);
    checkpoint::TrainState st;
    st.step = 1;
    checkpoint::save(*good_, "good", *s.root, s.optim.get(), st);
  }
  static void TearDownTestSuite() {
    io::remove_tree(*good_);
    delete good_;
  }
  void SetUp() override { dir_ = testing::temp_path("ckpt-bad-input"); }
  void TearDown() override { io::remove_tree(dir_); }

  // A fresh copy of the good checkpoint at dir_, then `corrupt(dir_)`.
  void copy_good() {
    io::make_dirs(dir_);
    const std::string src = join(*good_, "good");
    for (const auto& name : io::list_dir(src)) write_all(join(dir_, name), read_all(join(src, name)));
  }

  // Loading dir_ fails with CheckpointError carrying every needle, and the model is unchanged.
  void expect_rejected(const std::vector<std::string>& needles) {
    auto dist = Dist::single();
    DeviceMesh mesh(dist);
    auto s = make(mesh, 2);
    const auto before = state_of(s);
    try {
      checkpoint::load(dir_, *s.root, s.optim.get());
      ADD_FAILURE() << "loaded a bad checkpoint; expected an error with '" << needles.front() << "'";
    } catch (const CheckpointError& e) {
      for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a CheckpointError: " << e.what();
    }
    const auto after = state_of(s);
    for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i], after[i])) << "flat param " << i;
  }

  std::string model_path() const { return join(dir_, "model.safetensors"); }

  // Rewrites model.safetensors' header JSON text with `edit` (the data bytes stay as they are).
  void edit_header_text(const std::function<void(std::string&)>& edit) {
    std::string bytes = read_all(model_path());
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    std::string header = bytes.substr(8, n);
    const std::string data = bytes.substr(8 + n);
    edit(header);
    const uint64_t m = header.size();
    std::string out(8, '\0');
    std::memcpy(out.data(), &m, 8);
    write_all(model_path(), out + header + data);
  }
  void edit_header(const std::function<void(json&)>& edit) {
    edit_header_text([&](std::string& text) {
      json j = json::parse(text);
      edit(j);
      text = j.dump();
    });
  }
  // The first and last tensors of the model file by data offset.
  std::pair<std::string, std::string> first_and_last() {
    json j = json::parse(read_all(model_path()).substr(8, header_len()));
    std::string first, last;
    uint64_t lo = UINT64_MAX, hi = 0;
    for (auto& [k, v] : j.items()) {
      if (k == "__metadata__") continue;
      const uint64_t b = v["data_offsets"][0], e = v["data_offsets"][1];
      if (b < lo) lo = b, first = k;
      if (e > hi) hi = e, last = k;
    }
    return {first, last};
  }
  uint64_t header_len() {
    uint64_t n = 0;
    std::memcpy(&n, read_all(model_path()).data(), 8);
    return n;
  }

  static std::string* good_;
  std::string dir_;
};
std::string* CheckpointBadInput::good_ = nullptr;

TEST_F(CheckpointBadInput, GoodCopyLoads) {
  copy_good();
  auto dist = Dist::single();
  DeviceMesh mesh(dist);
  auto s = make(mesh, 2);
  EXPECT_EQ(checkpoint::load(dir_, *s.root, s.optim.get()).step, 1);
}

TEST_F(CheckpointBadInput, ModelFileTruncatedAtEveryBoundary) {
  copy_good();
  const std::string whole = read_all(model_path());
  const uint64_t n = header_len();
  std::vector<uint64_t> cuts = {0, 1, 7, 8, 9, 8 + n / 2, 8 + n - 1, 8 + n, whole.size() - 1};
  json j = json::parse(whole.substr(8, n));
  for (auto& [k, v] : j.items()) {
    if (k == "__metadata__") continue;
    const uint64_t b = v["data_offsets"][0], e = v["data_offsets"][1];
    for (uint64_t c : {8 + n + b, 8 + n + b + 1, 8 + n + e - 1}) cuts.push_back(c);
  }
  for (uint64_t cut : cuts) {
    if (cut >= whole.size()) continue;
    SCOPED_TRACE("truncated to " + std::to_string(cut) + " of " + std::to_string(whole.size()) + " bytes");
    write_all(model_path(), whole.substr(0, cut));
    expect_rejected({"model.safetensors"});
  }
}

TEST_F(CheckpointBadInput, HeaderLengthOverTheLimit) {
  copy_good();
  std::string bytes = read_all(model_path());
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(bytes.data(), &huge, 8);
  write_all(model_path(), bytes);
  expect_rejected({"model.safetensors", "header"});
}

TEST_F(CheckpointBadInput, OverlappingOffsets) {
  copy_good();
  const auto [first, last] = first_and_last();
  edit_header([&, first = first, last = last](json& j) {
    auto& f = j[first]["data_offsets"];
    auto& l = j[last]["data_offsets"];
    const uint64_t size = l[1].get<uint64_t>() - l[0].get<uint64_t>();
    l[0] = f[0].get<uint64_t>();
    l[1] = f[0].get<uint64_t>() + size;
  });
  expect_rejected({"model.safetensors", "overlaps"});
}

TEST_F(CheckpointBadInput, GappedOffsets) {
  copy_good();
  const auto [first, last] = first_and_last();
  // The first tensor starts 4 bytes late and the file grows by 4: a hole before it.
  edit_header([&, first = first](json& j) {
    for (auto& [k, v] : j.items()) {
      if (k == "__metadata__") continue;
      v["data_offsets"][0] = v["data_offsets"][0].get<uint64_t>() + 4;
      v["data_offsets"][1] = v["data_offsets"][1].get<uint64_t>() + 4;
    }
  });
  write_all(model_path(), read_all(model_path()) + std::string(4, '\0'));
  expect_rejected({"model.safetensors", "gap"});
}

TEST_F(CheckpointBadInput, OffsetsPastTheEnd) {
  copy_good();
  const auto last = first_and_last().second;
  edit_header([&](json& j) { j[last]["data_offsets"][1] = j[last]["data_offsets"][1].get<uint64_t>() + 64; });
  expect_rejected({"model.safetensors", last});
}

TEST_F(CheckpointBadInput, ShapeOverflow) {
  copy_good();
  const auto last = first_and_last().second;
  edit_header([&](json& j) { j[last]["shape"] = {uint64_t{1} << 62, 16}; });
  expect_rejected({"model.safetensors", last, "overflows"});
}

TEST_F(CheckpointBadInput, UnknownDtype) {
  copy_good();
  const auto last = first_and_last().second;
  edit_header([&](json& j) { j[last]["dtype"] = "F33"; });
  expect_rejected({"model.safetensors", last, "unknown dtype 'F33'"});
}

TEST_F(CheckpointBadInput, DuplicateName) {
  copy_good();
  const auto last = first_and_last().second;
  edit_header_text([&](std::string& text) {
    const json j = json::parse(text);
    text.insert(1, json(last).dump() + ":" + j[last].dump() + ",");
  });
  expect_rejected({"model.safetensors", last, "appears twice"});
}

TEST_F(CheckpointBadInput, RetypedTensor) {
  copy_good();
  const auto last = first_and_last().second;
  edit_header([&](json& j) { j[last]["dtype"] = "I32"; });  // same size: only the type differs
  expect_rejected({"model.safetensors", last, "is I32 but the model's master copy is F32"});
}

TEST_F(CheckpointBadInput, IndexPathTraversal) {
  copy_good();
  const std::string index = join(dir_, "model.safetensors.index.json");
  json j = json::parse(read_all(index));
  const std::string name = j["weight_map"].begin().key();
  for (const char* bad : {"../good/model.safetensors", "/etc/passwd", "..", "sub/model.safetensors"}) {
    SCOPED_TRACE(bad);
    j["weight_map"][name] = bad;
    write_all(index, j.dump());
    expect_rejected({"model.safetensors.index.json", name});
  }
}

// The schema reports every problem of a document (fsdp-ckpt verify prints them all), each naming
// the field; a document save() writes has none.
TEST(CheckpointTrainStateSchema, ListsEveryProblemNamingTheField) {
  const json good = {{"format_version", checkpoint::kFormatVersion},
                     {"step", 3},
                     {"samples_seen", 96},
                     {"world_size", 1},
                     {"strategy", "FULL_SHARD"},
                     {"rng_states", {"AAAA"}},
                     {"extra", json::object()},
                     {"optimizer", {{"type", "AdamW"}, {"state_names", {"exp_avg"}}, {"steps", {{"w", 3}}}}},
                     {"files", {"model.safetensors"}}};
  EXPECT_TRUE(checkpoint::check_train_state(good, "x: ").empty());
  json bad = good;
  bad.erase("step");
  bad["world_size"] = 0;
  bad["strategy"] = "ZERO3";
  bad["optimizer"]["steps"]["w"] = -1;
  const auto problems = checkpoint::check_train_state(bad, "x: ");
  ASSERT_EQ(problems.size(), 4u);
  EXPECT_EQ(problems[0], "x: field 'step' is missing");
  EXPECT_NE(problems[1].find("field 'world_size' is 0, not a positive integer"), std::string::npos);
  EXPECT_NE(problems[2].find("field 'strategy' is \"ZERO3\""), std::string::npos);
  EXPECT_NE(problems[3].find("field 'optimizer.steps['w']' is -1"), std::string::npos);
}

TEST_F(CheckpointBadInput, MalformedTrainState) {
  const std::vector<std::pair<std::function<void(json&)>, std::string>> cases = {
      {[](json& j) { j["format_version"] = 99; }, "format_version 99"},
      {[](json& j) { j["format_version"] = "1"; }, "'format_version' is \"1\", not an integer"},
      {[](json& j) { j.erase("step"); }, "field 'step' is missing"},
      {[](json& j) { j["step"] = "seven"; }, "'step' is \"seven\""},
      {[](json& j) { j["strategy"] = 1; }, "'strategy' is 1"},
      {[](json& j) { j["rng_states"] = 5; }, "'rng_states' is 5"},
      {[](json& j) { j["rng_states"] = {"not base64 !!"}; }, "RNG state"},
      {[](json& j) { j["rng_states"] = {"AAAA"}; }, "RNG state"},
      {[](json& j) { j["optimizer"] = 5; }, "'optimizer' is 5, not an object"},
      {[](json& j) { j["optimizer"]["type"] = 5; }, "'optimizer.type' is 5"},
      {[](json& j) { j["optimizer"]["type"] = "SGD"; }, "holds SGD optimizer state but the optimizer is AdamW"},
      {[](json& j) { j["optimizer"]["steps"] = "many"; }, "'optimizer.steps' is \"many\""},
      {[](json& j) {
         for (auto& [k, v] : j["optimizer"]["steps"].items()) v = "x";
       },
       "not a non-negative integer"},
      {[](json& j) {
         for (auto& [k, v] : j["optimizer"]["steps"].items()) v = -3;
       },
       "not a non-negative integer"},
      {[](json& j) { j = json::array(); }, "is not a JSON object"},
  };
  for (const auto& [edit, needle] : cases) {
    copy_good();
    const std::string path = join(dir_, "train_state.json");
    json j = json::parse(read_all(path));
    edit(j);
    SCOPED_TRACE(j.dump().substr(0, 200));
    write_all(path, j.dump());
    // Another optimizer's state is a mismatch of the checkpoint, named by its directory.
    if (needle.find("SGD") != std::string::npos) {
      expect_rejected({dir_, needle});
    } else {
      expect_rejected({"train_state.json", needle});
    }
    io::remove_tree(dir_);
  }
  copy_good();
  write_all(join(dir_, "train_state.json"), "{\"step\": ");
  expect_rejected({"train_state.json", "not valid JSON"});
}

}  // namespace
}  // namespace fsdp
