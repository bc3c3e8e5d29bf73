// safetensors_tool: a small command line over src/checkpoint/safetensors, so that
// tests/interop/safetensors_interop_test.py can check our files against the Python `safetensors` package
// in both directions.
//   safetensors_tool write OUT   writes a fixed set of tensors (values below) the way ranks do:
//                                plan_file, then the header and each tensor at its offset
//   safetensors_tool dump FILE   validates FILE with read_header, then prints one line per
//                                tensor, in offset order:
//                                  tensor <TAB> name <TAB> dtype <TAB> [d0,d1] <TAB> sum <TAB> wsum
//                                and one per metadata entry: metadata <TAB> key <TAB> value
// sum is the sum of the values as float64; wsum weights element i (row-major) by (i % 7) + 1, so a
// misplaced element changes it. Errors go to stderr with exit status 1 (2 for bad usage).
//
// Values written by `write`, element i of the row-major tensor (kept in step with the Python test):
//   float dtypes   ((i % 17) - 8) * 0.25        exact in every float format, F8 included
//   signed ints    ((i % 17) - 8) * scale       scale: I8 1, I16 256, I32 2^20, I64 2^40
//   unsigned ints  (i % 17) * scale             scale: U8 1, U16 256, U32 2^20, U64 2^40
//   BOOL           i % 3 == 0
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "safetensors/safetensors.h"
#include "safetensors/torch_dtypes.h"
#include "fsdp/errors.h"

namespace {

using fsdp::CheckpointError;
using fsdp::safetensors::DType;
using fsdp::safetensors::TensorSpec;

// Given in decreasing itemsize, as the reference writer orders them, so every tensor is aligned;
// "odd.bf16" and the F8 tensors have odd byte counts and come last.
const std::vector<TensorSpec> kTensors = {
    {"layers.0.f64", DType::F64, {4}},         {"layers.0.i64", DType::I64, {2, 3}},
    {"layers.0.u64", DType::U64, {3}},         {"layers.0.f32", DType::F32, {3, 5}},
    {"layers.0.scalar", DType::F32, {}},       {"layers.0.empty", DType::F32, {0, 3}},
    {"layers.0.i32", DType::I32, {5}},         {"layers.0.u32", DType::U32, {2, 2}},
    {"layers.0.bf16", DType::BF16, {7, 2}},    {"layers.0.f16", DType::F16, {2, 3, 1}},
    {"layers.0.i16", DType::I16, {3}},         {"layers.0.u16", DType::U16, {3}},
    {"layers.1.odd.bf16", DType::BF16, {7}},   {"layers.1.i8", DType::I8, {9}},
    {"layers.1.u8", DType::U8, {4, 4}},        {"layers.1.bool", DType::BOOL, {6}},
    {"layers.1.f8_e4m3", DType::F8_E4M3, {5}}, {"layers.1.f8_e5m2", DType::F8_E5M2, {17}},
};

double scale_of(DType dtype) {
  switch (dtype) {
    case DType::I16:
    case DType::U16: return 256.0;
    case DType::I32:
    case DType::U32: return 1048576.0;
    case DType::I64:
    case DType::U64: return 1099511627776.0;
    case DType::I8:
    case DType::U8: return 1.0;
    default: return 0.25;
  }
}

bool is_unsigned(DType dtype) {
  return dtype == DType::U8 || dtype == DType::U16 || dtype == DType::U32 || dtype == DType::U64;
}

at::Tensor values_of(const TensorSpec& spec) {
  int64_t numel = 1;
  for (int64_t d : spec.shape) numel *= d;
  const at::Tensor i = at::arange(numel, at::kDouble);
  at::Tensor v;
  if (spec.dtype == DType::BOOL) {
    v = at::remainder(i, 3).eq(0);
  } else if (is_unsigned(spec.dtype)) {
    v = at::remainder(i, 17) * scale_of(spec.dtype);
  } else {
    v = (at::remainder(i, 17) - 8) * scale_of(spec.dtype);
  }
  // Through int64 for integers: double -> uint64 casts are not implemented for every type pair.
  if (spec.dtype != DType::BOOL && scale_of(spec.dtype) >= 1.0) v = v.to(at::kLong);
  return v.to(fsdp::safetensors::to_scalar_type(spec.dtype)).reshape(spec.shape).contiguous();
}

void check_io(bool ok, const std::string& what, const std::string& path) {
  if (!ok) throw CheckpointError("safetensors_tool: " + what + " " + path + ": " + std::strerror(errno));
}

void pwrite_all(int fd, const char* data, size_t len, uint64_t offset, const std::string& path) {
  while (len > 0) {
    const ssize_t n = ::pwrite(fd, data, len, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    check_io(n > 0, "cannot write", path);
    data += n;
    len -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

void pread_all(int fd, char* data, size_t len, uint64_t offset, const std::string& path) {
  while (len > 0) {
    const ssize_t n = ::pread(fd, data, len, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    check_io(n > 0, "cannot read", path);
    data += n;
    len -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

int write_file(const std::string& path) {
  const auto plan = fsdp::safetensors::plan_file(kTensors, {{"format", "pt"}, {"writer", "safetensors_tool"}});
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  check_io(fd >= 0, "cannot create", path);
  check_io(::ftruncate(fd, static_cast<off_t>(plan.file_size)) == 0, "cannot size", path);
  pwrite_all(fd, plan.header_bytes.data(), plan.header_bytes.size(), 0, path);
  // Last tensor first: positioned writes must not depend on order, as with ranks writing at once.
  for (auto it = kTensors.rbegin(); it != kTensors.rend(); ++it) {
    const at::Tensor t = values_of(*it);
    const auto* entry = plan.header.find(it->name);
    pwrite_all(fd, static_cast<const char*>(t.const_data_ptr()), t.nbytes(), plan.header.data_start() + entry->begin,
               path);
  }
  check_io(::close(fd) == 0, "cannot close", path);
  return 0;
}

int dump_file(const std::string& path) {
  const auto header = fsdp::safetensors::read_header(path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  check_io(fd >= 0, "cannot open", path);
  for (const auto& e : header.tensors) {
    std::vector<char> bytes(std::max<uint64_t>(e.nbytes(), 1));
    pread_all(fd, bytes.data(), e.nbytes(), header.data_start() + e.begin, path);
    const at::Tensor t =
        at::from_blob(bytes.data(), e.shape, at::TensorOptions().dtype(fsdp::safetensors::to_scalar_type(e.dtype)))
            .to(at::kDouble)
            .flatten();
    const at::Tensor weights = at::remainder(at::arange(t.numel(), at::kDouble), 7) + 1;
    std::string shape = "[";
    for (size_t i = 0; i < e.shape.size(); ++i) shape += (i ? "," : "") + std::to_string(e.shape[i]);
    shape += "]";
    std::printf("tensor\t%s\t%s\t%s\t%.17g\t%.17g\n", e.name.c_str(), fsdp::safetensors::dtype_name(e.dtype),
                shape.c_str(), t.sum().item<double>(), (t * weights).sum().item<double>());
  }
  for (const auto& kv : header.metadata) {
    std::printf("metadata\t%s\t%s\n", kv.first.c_str(), kv.second.c_str());
  }
  ::close(fd);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  if (argc != 3 || (std::strcmp(argv[1], "write") != 0 && std::strcmp(argv[1], "dump") != 0)) {
    std::fprintf(stderr, "usage: safetensors_tool write OUT | safetensors_tool dump FILE\n");
    return 2;
  }
  try {
    return std::strcmp(argv[1], "write") == 0 ? write_file(argv[2]) : dump_file(argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
