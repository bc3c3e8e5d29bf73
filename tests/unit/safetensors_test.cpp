// Tests for src/checkpoint/safetensors and index: plan -> write -> read round trips, byte-exact
// determinism of plans, and one case per malformed-input check, each asserting a CheckpointError
// whose message names the file and the tensor at fault. Malformed files are crafted byte by byte
// and read through read_header, the path loading takes.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <sys/stat.h>
#include <unistd.h>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "base/file_io.h"
#include "safetensors/index.h"
#include "safetensors/safetensors.h"
#include "safetensors/torch_dtypes.h"
#include "fsdp/errors.h"

namespace fsdp::safetensors {
namespace {

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A whole file: length prefix, header text as given, data.
std::string file_bytes(const std::string& json, const std::string& data) { return le64(json.size()) + json + data; }

// Runs `f` and checks that it throws CheckpointError whose message holds every one of `needles`.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
  } catch (const CheckpointError& e) {
    const std::string msg = e.what();
    for (const std::string& n : needles) {
      EXPECT_NE(msg.find(n), std::string::npos) << "message lacks \"" << n << "\": " << msg;
    }
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than CheckpointError: " << e.what();
    return;
  }
  ADD_FAILURE() << "did not throw";
}

#define EXPECT_CHECKPOINT_ERROR(stmt, ...)      \
  do {                                          \
    SCOPED_TRACE(#stmt);                        \
    expect_error([&] { stmt; }, {__VA_ARGS__}); \
  } while (0)

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/safetensors_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { io::remove_tree(dir_); }

  std::string write(const std::string& name, const std::string& bytes) {
    const std::string path = dir_ + "/" + name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    EXPECT_TRUE(out.good());
    return path;
  }

  static std::string slurp(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  // Writes a file from a plan the way ranks do: header at 0, each tensor's bytes at its offset,
  // in reverse order so nothing depends on sequential writing. Tensor i holds bytes (i + 1).
  std::string write_planned(const std::string& name, const FilePlan& plan) {
    const std::string path = dir_ + "/" + name;
    { std::ofstream create(path, std::ios::binary | std::ios::trunc); }
    if (::truncate(path.c_str(), static_cast<off_t>(plan.file_size)) != 0) throw std::runtime_error("truncate " + path);
    std::fstream out(path, std::ios::binary | std::ios::in | std::ios::out);
    out.seekp(0);
    out.write(plan.header_bytes.data(), static_cast<std::streamsize>(plan.header_bytes.size()));
    for (size_t i = plan.header.tensors.size(); i-- > 0;) {
      const TensorEntry& e = plan.header.tensors[i];
      const std::string bytes(e.nbytes(), static_cast<char>(i + 1));
      out.seekp(static_cast<std::streamoff>(plan.header.data_start() + e.begin));
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
    EXPECT_TRUE(out.good());
    return path;
  }

  std::string dir_;
};

// A valid one-tensor header for hand-made variations: tensor "w", F32 [2], bytes [0, 8).
const char* kOneTensor = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

const std::vector<TensorSpec> kSpecs = {
    {"model.embed.weight", DType::BF16, {7, 3}},
    {"model.norm.weight", DType::F32, {5}},
    {"scalar", DType::F64, {}},
    {"empty", DType::F32, {0, 4}},
    {"flags", DType::BOOL, {3}},
    {"steps", DType::I64, {2}},
    {"fp8", DType::F8_E4M3, {3}},
};

// ---- dtypes ------------------------------------------------------------------------------------

TEST_F(Safetensors, DTypeNamesAndSizes) {
  const std::vector<std::pair<DType, size_t>> all = {
      {DType::BOOL, 1}, {DType::U8, 1},   {DType::I8, 1},  {DType::I16, 2},     {DType::U16, 2},
      {DType::F16, 2},  {DType::BF16, 2}, {DType::I32, 4}, {DType::U32, 4},     {DType::F32, 4},
      {DType::F64, 8},  {DType::I64, 8},  {DType::U64, 8}, {DType::F8_E4M3, 1}, {DType::F8_E5M2, 1}};
  for (const auto& [dtype, size] : all) {
    EXPECT_EQ(itemsize(dtype), size) << dtype_name(dtype);
    EXPECT_EQ(parse_dtype(dtype_name(dtype)), dtype);
    EXPECT_EQ(from_scalar_type(to_scalar_type(dtype)), dtype);
    EXPECT_EQ(c10::elementSize(to_scalar_type(dtype)), size) << dtype_name(dtype);
  }
  EXPECT_EQ(to_scalar_type(DType::BF16), c10::ScalarType::BFloat16);
  EXPECT_EQ(to_scalar_type(DType::F8_E4M3), c10::ScalarType::Float8_e4m3fn);
  EXPECT_CHECKPOINT_ERROR(parse_dtype("F128"), "'F128'");
  EXPECT_CHECKPOINT_ERROR(parse_dtype("f32"), "'f32'");
  EXPECT_CHECKPOINT_ERROR(from_scalar_type(c10::ScalarType::ComplexFloat), "ComplexFloat");
}

// ---- plan and round trip -----------------------------------------------------------------------

TEST_F(Safetensors, PlanWriteReadRoundTrip) {
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "12"}};
  const FilePlan plan = plan_file(kSpecs, meta);
  EXPECT_EQ(plan.header.data_start() % kDataAlignment, 0u);
  EXPECT_EQ(plan.header_bytes.size(), plan.header.data_start());
  // Laid out contiguously in the given order.
  uint64_t offset = 0;
  for (const TensorSpec& s : kSpecs) {
    const TensorEntry* e = plan.header.find(s.name);
    ASSERT_NE(e, nullptr) << s.name;
    EXPECT_EQ(e->begin, offset) << s.name;
    offset = e->end;
  }
  EXPECT_EQ(plan.file_size, plan.header.data_start() + offset);

  const std::string path = write_planned("model.safetensors", plan);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), plan.file_size);
  const Header back = read_header(path);
  EXPECT_EQ(back.header_len, plan.header.header_len);
  EXPECT_EQ(back.metadata, meta);
  ASSERT_EQ(back.tensors.size(), kSpecs.size());
  for (size_t i = 0; i < back.tensors.size(); ++i) {
    const TensorEntry& a = back.tensors[i];
    const TensorEntry& b = plan.header.tensors[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.dtype, b.dtype) << a.name;
    EXPECT_EQ(a.shape, b.shape) << a.name;
    EXPECT_EQ(a.begin, b.begin) << a.name;
    EXPECT_EQ(a.end, b.end) << a.name;
    if (i > 0) {
      EXPECT_LE(back.tensors[i - 1].begin, a.begin);
    }
  }
  // The bytes land where the header says.
  const std::string all = slurp(path);
  const TensorEntry* norm = back.find("model.norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->nbytes(), 20u);
  const size_t norm_index = static_cast<size_t>(norm - back.tensors.data());
  EXPECT_EQ(all.substr(back.data_start() + norm->begin, norm->nbytes()),
            std::string(20, static_cast<char>(norm_index + 1)));
  EXPECT_EQ(back.find("missing"), nullptr);
}

TEST_F(Safetensors, PlanWithoutTensorsOrMetadata) {
  const FilePlan plan = plan_file({}, {});
  EXPECT_EQ(plan.header_bytes, le64(8) + "{}      ");
  const Header back = read_header(write("empty.safetensors", plan.header_bytes));
  EXPECT_TRUE(back.tensors.empty());
  EXPECT_TRUE(back.metadata.empty());
}

TEST_F(Safetensors, PlanIsDeterministic) {
  const FilePlan a = plan_file(kSpecs, {{"format", "pt"}, {"b", "2"}});
  const FilePlan b = plan_file(kSpecs, {{"b", "2"}, {"format", "pt"}});
  EXPECT_EQ(a.header_bytes, b.header_bytes);
  EXPECT_EQ(a.file_size, b.file_size);
  // The exact bytes, so that a change of format is a visible decision.
  const FilePlan c = plan_file({{"a", DType::F32, {2}}, {"b", DType::BF16, {1, 3}}}, {{"format", "pt"}});
  const std::string json = R"({"__metadata__":{"format":"pt"},"a":{"data_offsets":[0,8],"dtype":"F32","shape":[2]},)"
                           R"("b":{"data_offsets":[8,14],"dtype":"BF16","shape":[1,3]}})";
  const std::string padded = json + std::string((8 - json.size() % 8) % 8, ' ');
  EXPECT_EQ(c.header_bytes, le64(padded.size()) + padded);
  EXPECT_EQ(c.file_size, 8 + padded.size() + 14);
}

TEST_F(Safetensors, PlanRejectsBadSpecs) {
  EXPECT_CHECKPOINT_ERROR(plan_file({{"w", DType::F32, {2}}, {"w", DType::F32, {3}}}, {}), "'w'", "twice");
  EXPECT_CHECKPOINT_ERROR(plan_file({{"__metadata__", DType::F32, {2}}}, {}), "'__metadata__'", "reserved");
  EXPECT_CHECKPOINT_ERROR(plan_file({{"neg", DType::F32, {2, -1}}}, {}), "'neg'", "negative");
  EXPECT_CHECKPOINT_ERROR(plan_file({{"big", DType::F32, {int64_t{1} << 62, 8}}}, {}), "'big'", "overflows");
  EXPECT_CHECKPOINT_ERROR(plan_file({{"a", DType::U8, {int64_t{1} << 62}},
                                     {"b", DType::U8, {int64_t{1} << 62}},
                                     {"c", DType::U8, {int64_t{1} << 62}},
                                     {"d", DType::U8, {int64_t{1} << 62}}},
                                    {}),
                          "'d'", "2^64");
  EXPECT_CHECKPOINT_ERROR(plan_file({{"bad\xff", DType::F32, {1}}}, {}), "UTF-8");
  EXPECT_CHECKPOINT_ERROR(plan_file({}, {{"k", "\xc0\xaf"}}), "'k'", "UTF-8");
}

TEST_F(Safetensors, ReadsForeignLayouts) {
  // Entries in any key order, padding, an empty tensor sharing an offset: as Python writes them.
  const std::string json = R"({"b":{"dtype":"I16","shape":[3],"data_offsets":[8,14]},"__metadata__":{"format":"pt"},)"
                           R"( "z_empty":{"dtype":"F64","shape":[0],"data_offsets":[8,8]},)"
                           R"( "a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},"s":{"dtype":"U8","shape":[],)"
                           R"("data_offsets":[14,15]}}    )";
  const Header h = read_header(write("x.safetensors", file_bytes(json, std::string(15, 'x'))));
  ASSERT_EQ(h.tensors.size(), 4u);
  EXPECT_EQ(h.tensors[0].name, "a");
  EXPECT_EQ(h.tensors[1].name, "z_empty");
  EXPECT_EQ(h.tensors[2].name, "b");
  EXPECT_EQ(h.tensors[3].name, "s");
  EXPECT_TRUE(h.tensors[3].shape.empty());
  EXPECT_EQ(h.metadata.at("format"), "pt");
  EXPECT_EQ(h.data_start(), 8 + json.size());
}

// ---- malformed files ---------------------------------------------------------------------------

TEST_F(Safetensors, RejectsFilesShorterThanTheLengthPrefix) {
  for (size_t n = 0; n < 8; ++n) {
    const std::string path = write("short" + std::to_string(n) + ".safetensors", std::string(n, '\0'));
    EXPECT_CHECKPOINT_ERROR(read_header(path), path, "too short");
  }
  EXPECT_CHECKPOINT_ERROR(parse_header("f.safetensors", "", 0, 7), "f.safetensors", "too short");
}

TEST_F(Safetensors, RejectsTruncationAtEveryByte) {
  const FilePlan plan = plan_file(kSpecs, {{"format", "pt"}});
  const std::string full = slurp(write_planned("full.safetensors", plan));
  ASSERT_EQ(full.size(), plan.file_size);
  for (size_t cut = 0; cut < full.size(); ++cut) {
    SCOPED_TRACE("cut at " + std::to_string(cut));
    const std::string path = write("cut.safetensors", full.substr(0, cut));
    if (cut < 8) {
      EXPECT_CHECKPOINT_ERROR(read_header(path), path, "too short");
    } else if (cut < plan.header.data_start()) {
      EXPECT_CHECKPOINT_ERROR(read_header(path), path, "runs past the end of the file");
    } else {
      // Some tensor now ends past the data; the message must name one of those.
      const uint64_t data_len = cut - plan.header.data_start();
      std::string message;
      try {
        read_header(path);
      } catch (const CheckpointError& e) {
        message = e.what();
      }
      ASSERT_NE(message.find(path), std::string::npos) << message;
      EXPECT_NE(message.find("runs past the end of the data buffer"), std::string::npos) << message;
      bool names_a_cut_tensor = false;
      for (const TensorEntry& e : plan.header.tensors) {
        if (e.end > data_len && message.find("'" + e.name + "'") != std::string::npos) {
          names_a_cut_tensor = true;
        }
      }
      EXPECT_TRUE(names_a_cut_tensor) << message;
    }
  }
}

TEST_F(Safetensors, RejectsHeaderLengthOverTheLimit) {
  const std::string over = write("over.safetensors", le64(kMaxHeaderLen + 1) + kOneTensor);
  EXPECT_CHECKPOINT_ERROR(read_header(over), over, "100000001", "limit");
  const std::string huge = write("huge.safetensors", le64(~uint64_t{0}) + kOneTensor);
  EXPECT_CHECKPOINT_ERROR(read_header(huge), huge, "limit");
  // parse_header checks it too, whatever the caller says the file size is.
  EXPECT_CHECKPOINT_ERROR(parse_header("f.safetensors", "{}", kMaxHeaderLen + 1, ~uint64_t{0}), "f.safetensors",
                          "limit");
  const std::string past = write("past.safetensors", le64(1000) + kOneTensor);
  EXPECT_CHECKPOINT_ERROR(read_header(past), past, "header length 1000 runs past the end");
  EXPECT_CHECKPOINT_ERROR(parse_header("f.safetensors", "{}", 3, 100), "f.safetensors", "header text is 2 bytes");
}

TEST_F(Safetensors, RejectsHeadersThatAreNotJsonObjects) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "does not start with '{'"},
      {"[1,2]", "does not start with '{'"},
      {" {}", "does not start with '{'"},
      {"{", "not valid JSON"},
      {"{} x", "not valid JSON"},
      {"{\"w\":{\"dtype\":\"F32\",", "not valid JSON"},
      {"{\"a\xff\":1}", "not valid UTF-8"},
      {"{\"\xc0\xaf\":1}", "not valid UTF-8"},          // overlong '/'
      {"{\"\xed\xa0\x80\":1}", "not valid UTF-8"},      // a UTF-16 surrogate
      {"{\"\xf4\x90\x80\x80\":1}", "not valid UTF-8"},  // above U+10FFFF
  };
  int i = 0;
  for (const auto& [json, needle] : cases) {
    const std::string path = write("h" + std::to_string(i++) + ".safetensors", file_bytes(json, ""));
    EXPECT_CHECKPOINT_ERROR(read_header(path), path, needle);
  }
  // A NUL byte after the JSON: nlohmann's lexer takes it for the end of input and would accept
  // anything after it, the reference refuses it.
  const std::string nul = write("nul.safetensors", file_bytes(std::string("{}\0 junk", 8), ""));
  EXPECT_CHECKPOINT_ERROR(read_header(nul), nul, "NUL byte at header offset 2");
}

TEST_F(Safetensors, RejectsMalformedEntries) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {R"({"w":5})", {"'w'", "entry is a number"}},
      {R"({"w":[]})", {"'w'", "entry is an array"}},
      {R"({"w":{"dtype":"F32","shape":[2]}})", {"'w'", "'data_offsets' is missing"}},
      {R"({"w":{"shape":[2],"data_offsets":[0,8]}})", {"'w'", "'dtype' is missing"}},
      {R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", {"'w'", "'shape' is missing"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1}})", {"'w'", "'extra'"}},
      {R"({"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", {"'w'", "'dtype' appears twice"}},
      {R"({"w":{"dtype":5,"shape":[2],"data_offsets":[0,8]}})", {"'w'", "'dtype' is a number"}},
      {R"({"w":{"dtype":"F128","shape":[2],"data_offsets":[0,8]}})", {"'w'", "unknown dtype 'F128'"}},
      {R"({"w":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", {"'w'", "unknown dtype 'f32'"}},
      {R"({"w":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", {"'w'", "'shape' is a string"}},
      {R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", {"'w'", "2.0", "not a non-negative integer"}},
      {R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", {"'w'", "-2 is negative"}},
      {R"({"w":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}})", {"'w'", "-0 is negative"}},
      {R"({"w":{"dtype":"F32","shape":[true],"data_offsets":[0,8]}})", {"'w'", "shape holds a boolean"}},
      {R"({"w":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", {"'w'", "shape holds an array"}},
      {R"({"w":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,0]}})", {"'w'", "does not fit in int64"}},
      {R"({"w":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]}})",
       {"'w'", "not a non-negative integer"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", {"'w'", "has 1 values, not 2"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", {"'w'", "more than 2"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,-8]}})", {"'w'", "-8 is negative"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":{"a":0}}})", {"'w'", "'data_offsets' is an object"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,null]}})", {"'w'", "data_offsets holds null"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       {"'w'", "appears twice"}},
  };
  int i = 0;
  for (const auto& [json, needles] : cases) {
    SCOPED_TRACE(json);
    const std::string path = write("e" + std::to_string(i++) + ".safetensors", file_bytes(json, std::string(8, 0)));
    std::vector<std::string> all = needles;
    all.push_back(path);
    EXPECT_CHECKPOINT_ERROR(read_header(path), all);
  }
}

TEST_F(Safetensors, RejectsInconsistentSizesAndOffsets) {
  struct Case {
    std::string json;
    size_t data_len;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {R"({"model.norm.weight":{"dtype":"F32","shape":[32],"data_offsets":[0,64]}})",
       64,
       {"'model.norm.weight'", "data span [0, 64) is 64 bytes but shape [32] x F32 needs 128"}},
      {R"({"big":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}})", 8, {"'big'", "overflows"}},
      // Overflow of a partial product counts even when a later dimension is 0.
      {R"({"big":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}})", 0, {"'big'", "overflows"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, {"'w'", "end before they begin"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4, {"'w'", "runs past the end of the data buffer"}},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551608,0]}})",
       8,
       {"'w'", "end before they begin"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12,
       {"'b'", "overlaps tensor 'a'"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8,
       {"'b'", "overlaps tensor 'a'"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
       8,
       {"'e'", "overlaps tensor 'a'"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
       20,
       {"'b'", "bytes [8, 12)", "gap"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12, {"'a'", "bytes [0, 4)", "gap"}},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 9, {"'a'", "1 bytes of trailing data"}},
      {R"({})", 3, {"no tensors", "3 bytes"}},
      {R"({"__metadata__":{"k":1}})", 0, {"'k'", "is a number, not a string"}},
      {R"({"__metadata__":{"k":{}}})", 0, {"'k'", "is an object, not a string"}},
      {R"({"__metadata__":["k"]})", 0, {"__metadata__ is an array"}},
      {R"({"__metadata__":null})", 0, {"__metadata__ is null"}},
      {R"({"__metadata__":{"k":"1","k":"2"}})", 0, {"'k'", "appears twice"}},
      {R"({"__metadata__":{},"__metadata__":{}})", 0, {"__metadata__ appears twice"}},
  };
  int i = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.json);
    const std::string path =
        write("o" + std::to_string(i++) + ".safetensors", file_bytes(c.json, std::string(c.data_len, 0)));
    std::vector<std::string> all = c.needles;
    all.push_back(path);
    EXPECT_CHECKPOINT_ERROR(read_header(path), all);
  }
}

TEST_F(Safetensors, RejectsTrailingBytesAfterAPlannedFile) {
  const FilePlan plan = plan_file(kSpecs, {});
  const std::string path = write("t.safetensors", slurp(write_planned("ok.safetensors", plan)) + "x");
  // The last tensor by offset is "fp8".
  EXPECT_CHECKPOINT_ERROR(read_header(path), path, "'fp8'", "trailing");
}

TEST_F(Safetensors, QuotesHostileNames) {
  const std::string json = "{\"a\\nb\\u001b[31m\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}";
  const std::string path = write("q.safetensors", file_bytes(json, std::string(8, 0)));
  EXPECT_CHECKPOINT_ERROR(read_header(path), "'a\\x0ab\\x1b[31m'");
  const std::string long_name(5000, 'n');
  EXPECT_CHECKPOINT_ERROR(plan_file({{long_name, DType::F32, {1}}, {long_name, DType::F32, {1}}}, {}), "(5000 bytes)");
}

TEST_F(Safetensors, RejectsUnreadablePaths) {
  EXPECT_CHECKPOINT_ERROR(read_header(dir_ + "/absent.safetensors"), "absent.safetensors", "cannot open");
  EXPECT_CHECKPOINT_ERROR(read_header(dir_), dir_, "not a regular file");
}

// ---- index -------------------------------------------------------------------------------------

const char* kIndexText = R"({
  "metadata": {"total_size": 28, "nested": {"a": [1, 2]}},
  "weight_map": {"a": "model-00001.safetensors", "b": "model-00002.safetensors",
                 "c": "model-00001.safetensors"}
})";

TEST_F(Safetensors, IndexParsesAndRoundTrips) {
  const Index index = parse_index("model.safetensors.index.json", kIndexText);
  EXPECT_EQ(index.metadata.at("total_size"), 28);
  EXPECT_EQ(index.weight_map.size(), 3u);
  EXPECT_EQ(index.files(), (std::vector<std::string>{"model-00001.safetensors", "model-00002.safetensors"}));
  const std::string text = index_to_json(index);
  EXPECT_EQ(text, index_to_json(parse_index("again", text)));
  const Index back = parse_index("again", text);
  EXPECT_EQ(back.weight_map, index.weight_map);
  EXPECT_EQ(back.metadata, index.metadata);
  // No metadata is an empty object; the pretty form is pinned.
  Index small;
  small.weight_map["w"] = "m.safetensors";
  EXPECT_EQ(index_to_json(small),
            "{\n  \"metadata\": {},\n  \"weight_map\": {\n    \"w\": \"m.safetensors\"\n  }\n}\n");
  EXPECT_TRUE(parse_index("x", R"({"weight_map":{}})").metadata.is_object());
}

TEST_F(Safetensors, IndexRejectsUnsafeFileNames) {
  const std::vector<std::string> bad = {"../x", "/abs", "a/b", "a\\b", "..\\x", "", ".", "..", std::string("a\0b", 3)};
  for (const std::string& file : bad) {
    SCOPED_TRACE(file);
    const std::string text = nlohmann::json{{"weight_map", {{"layer.w", file}}}}.dump();
    EXPECT_CHECKPOINT_ERROR(parse_index("idx.json", text), "idx.json", "'layer.w'", "file name");
    Index index;
    index.weight_map["layer.w"] = file;
    EXPECT_CHECKPOINT_ERROR(index_to_json(index), "'layer.w'", "file name");
  }
  EXPECT_CHECKPOINT_ERROR(parse_index("idx.json", R"({"weight_map":{"w":"../../etc/passwd"}})"), "'../../etc/passwd'",
                          "is a path");
}

TEST_F(Safetensors, IndexRejectsMalformedText) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"weight_map":{"w":"a.safetensors","w":"b.safetensors"}})", "'w' appears twice"},
      {R"({"weight_map":{},"weight_map":{}})", "'weight_map' appears twice"},
      {R"({"metadata":{"k":1,"k":2},"weight_map":{}})", "'k' appears twice"},
      {R"([1])", "is an array, not a JSON object"},
      {R"("x")", "is a string, not a JSON object"},
      {R"({"metadata":{}})", "has no weight_map"},
      {R"({"weight_map":[]})", "weight_map is an array"},
      {R"({"weight_map":{"w":1}})", "'w': file is a number"},
      {R"({"metadata":[],"weight_map":{}})", "metadata is an array"},
      {R"({"weight_map":{},"extra":1})", "unexpected key 'extra'"},
      {R"({"weight_map":{})", "not valid JSON"},
      {"{\"weight_map\":{\"w\xff\":\"a\"}}", "not valid UTF-8"},
      {std::string("{\"weight_map\":{}}\0{\"weight_map\":1}", 34), "NUL byte at offset 17"},
      {std::string(65, '[') + std::string(65, ']'), "nested deeper than 64"},
      {R"({"metadata":)" + std::string(64, '[') + std::string(64, ']') + R"(,"weight_map":{}})",
       "nested deeper than 64"},
  };
  for (const auto& [text, needle] : cases) {
    SCOPED_TRACE(text);
    EXPECT_CHECKPOINT_ERROR(parse_index("idx.json", text), "idx.json", needle);
  }
  // 64 levels in all (root, metadata, 62 arrays) is fine.
  EXPECT_NO_THROW(parse_index(
      "idx.json", R"({"metadata":{"x":)" + std::string(62, '[') + std::string(62, ']') + R"(},"weight_map":{}})"));
}

Header header_of(const std::vector<std::string>& names) {
  std::vector<TensorSpec> specs;
  for (const std::string& n : names) specs.push_back({n, DType::F32, {2}});
  return plan_file(specs, {}).header;
}

TEST_F(Safetensors, IndexAgreesWithHeaders) {
  const Index index = parse_index("idx", kIndexText);
  std::map<std::string, Header> headers = {{"model-00001.safetensors", header_of({"a", "c"})},
                                           {"model-00002.safetensors", header_of({"b"})}};
  EXPECT_NO_THROW(check_index_against_headers("ckpt", index, headers));

  auto missing = headers;
  missing.erase("model-00002.safetensors");
  EXPECT_CHECKPOINT_ERROR(check_index_against_headers("ckpt", index, missing), "ckpt",
                          "'model-00002.safetensors' is missing", "'b'");

  auto lacks = headers;
  lacks["model-00002.safetensors"] = header_of({});
  EXPECT_CHECKPOINT_ERROR(check_index_against_headers("ckpt", index, lacks), "ckpt", "'b'",
                          "'model-00002.safetensors', which does not hold it");

  auto extra = headers;
  extra["model-00002.safetensors"] = header_of({"b", "stray"});
  EXPECT_CHECKPOINT_ERROR(check_index_against_headers("ckpt", index, extra), "ckpt", "'stray'",
                          "'model-00002.safetensors'", "not in the index");

  auto twice = headers;
  twice["model-00002.safetensors"] = header_of({"b", "c"});
  EXPECT_CHECKPOINT_ERROR(check_index_against_headers("ckpt", index, twice), "ckpt", "'c'", "two files",
                          "'model-00001.safetensors'", "'model-00002.safetensors'");

  auto moved = headers;
  moved["model-00001.safetensors"] = header_of({"a"});
  moved["model-00002.safetensors"] = header_of({"b", "c"});
  EXPECT_CHECKPOINT_ERROR(check_index_against_headers("ckpt", index, moved), "ckpt", "'c'",
                          "under file 'model-00001.safetensors' but is held by file "
                          "'model-00002.safetensors'");
}

}  // namespace
}  // namespace fsdp::safetensors
