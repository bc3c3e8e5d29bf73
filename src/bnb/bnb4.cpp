// Note [bitsandbytes 4-bit weights]
// A transformers save of a model quantized with BitsAndBytesConfig(load_in_4bit=True) keeps each
// quantized Linear weight W (n values, row-major) as tensors named after it:
//   W                                  the codes: ceil(n / 2) bytes (any dtype: bnb_4bit_quant_storage),
//                                      value 2i in the high nibble of byte i, 2i + 1 in the low
//   W.quant_map                        F32 [16]: the levels a code indexes (NF4's, ascending)
//   W.absmax                           one absmax per block of 64 values: F32, or with double
//                                      quantization U8 codes of a second, 8-bit blockwise quantization:
//   W.nested_absmax, W.nested_quant_map  F32: its absmax per 256 absmax codes, its 256 levels
//   W.quant_state.bitsandbytes__nf4    U8: a JSON object (quant_type, blocksize, dtype, shape,
//                                      nested_blocksize, nested_dtype, nested_offset)
// bitsandbytes' dequantize_4bit reads it back as: absmax[b] = nested_quant_map[code_b] *
// nested_absmax[b / 256] + nested_offset (each rounded to fp32), then value = quant_map[q] *
// absmax[i / 64] in fp32, cast to the compute dtype. NF4 with blocks of 64 is fsdp's own NF4 stored
// form (Note [Frozen storage] in kernels/cpu/blocks.cpp: the same levels, the same nibble order, an
// fp32 absmax per block), so the codes are copied as they are and each absmax decoded once, by the
// same fp32 operations: fsdp's decode then gives bitsandbytes' values bit for bit. FP4, other
// blocksizes and 8-bit weights are refused by name.
#include "bnb/bnb4.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstring>

#include "base/file_io.h"
#include "frozen/frozen_storage.h"
#include "safetensors/torch_dtypes.h"

namespace fsdp::bnb {
namespace {

namespace st = safetensors;
using nlohmann::json;

const st::TensorEntry* entry_of(const st::FileSet& src, const std::string& name, std::string* file = nullptr) {
  const auto it = src.index.weight_map.find(name);
  if (it == src.index.weight_map.end()) return nullptr;
  if (file != nullptr) *file = it->second;
  return src.headers.at(it->second).find(name);
}

at::Tensor read_entry(const st::FileSet& src, const std::string& dir, const std::string& name) {
  std::string file;
  const st::TensorEntry* e = entry_of(src, name, &file);
  at::Tensor t = at::empty({static_cast<int64_t>(e->nbytes() / st::itemsize(e->dtype))}, st::to_scalar_type(e->dtype));
  io::File::open_read(io::join(dir, file))
      .pread_all(t.data_ptr(), e->nbytes(), src.headers.at(file).data_start() + e->begin);
  return t;
}

std::string shape_of(const st::TensorEntry& e) {
  std::string s;
  for (const int64_t d : e.shape) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return std::string(st::dtype_name(e.dtype)) + " [" + s + "]";
}

// "" when the companion `suffix` of the weight is there with `dtype` and `numel` elements.
std::string companion_problem(const st::FileSet& src, const Weight4& w, const std::string& suffix, st::DType dtype,
                              int64_t numel) {
  const st::TensorEntry* e = entry_of(src, w.name + suffix);
  const std::string want = std::string(st::dtype_name(dtype)) + " with " + std::to_string(numel) + " elements";
  if (e == nullptr) return "its '" + w.name + suffix + "' is missing (" + want + ")";
  if (e->dtype != dtype || static_cast<int64_t>(e->nbytes()) != numel * static_cast<int64_t>(st::itemsize(dtype)))
    return "'" + w.name + suffix + "' is " + shape_of(*e) + ", not " + want;
  return "";
}

// The quant_state's settings against what the import reads; "" when they fit.
std::string state_problem(const json& q, Weight4& w, const std::vector<int64_t>& want) {
  const std::string tensor = "tensor '" + w.name + "'";
  if (!q.is_object() || !q.contains("quant_type") || !q.contains("blocksize") || !q.contains("shape"))
    return tensor + ": its quant_state is not a bitsandbytes 4-bit state (quant_type, blocksize, shape)";
  if (q["quant_type"] != "nf4")
    return tensor + " is bitsandbytes quant_type=" + q["quant_type"].dump() +
           " (bnb_4bit_quant_type); the import reads \"nf4\" only";
  if (q["blocksize"] != kBlock)
    return tensor + " has blocksize=" + q["blocksize"].dump() + "; the import reads NF4 in blocks of 64 only";
  w.shape = q["shape"].get<std::vector<int64_t>>();
  if (w.shape != want) return tensor + " has shape " + q["shape"].dump() + " but the model's differs";
  w.numel = 1;
  for (const int64_t d : w.shape) w.numel *= d;
  w.nested = q.contains("nested_blocksize");
  if (!w.nested) return "";
  if (q["nested_blocksize"] != kNestedBlock || q.value("nested_dtype", "") != "float32")
    return tensor + " has nested_blocksize=" + q["nested_blocksize"].dump() +
           ", nested_dtype=" + q.value("nested_dtype", json()).dump() +
           "; the import reads double quantization in blocks of 256, float32";
  w.offset = static_cast<float>(q.value("nested_offset", 0.0));  // an fp32 value, written as a double
  return "";
}

// The checked weight, or null with `problem` set (see find_weight4).
std::shared_ptr<const Weight4> check_weight4(const st::FileSet& src, const std::string& dir, const std::string& name,
                                             const std::vector<int64_t>& want, std::string& problem) {
  const std::string nf4 = name + ".quant_state.bitsandbytes__nf4", fp4 = name + ".quant_state.bitsandbytes__fp4";
  if (entry_of(src, name + ".SCB") != nullptr) {
    problem = "tensor '" + name + "' is bitsandbytes 8-bit (load_in_8bit, with its '" + name +
              ".SCB'); the import reads bitsandbytes 4-bit NF4 (load_in_4bit, bnb_4bit_quant_type \"nf4\") only";
    return nullptr;
  }
  const bool is_fp4 = entry_of(src, fp4) != nullptr;
  if (entry_of(src, nf4) == nullptr && !is_fp4) return nullptr;
  auto w = std::make_shared<Weight4>();
  w->name = name;
  if (entry_of(src, is_fp4 ? fp4 : nf4)->nbytes() > (1u << 16)) {
    problem = "tensor '" + name + "': its quant_state is larger than 64 KiB, not a bitsandbytes state";
    return nullptr;
  }
  try {
    const at::Tensor text = read_entry(src, dir, is_fp4 ? fp4 : nf4);
    problem = state_problem(json::parse(std::string(static_cast<const char*>(text.const_data_ptr()), text.nbytes())),
                            *w, want);
  } catch (const json::exception& e) {
    problem = "tensor '" + name + "': its quant_state is not a bitsandbytes 4-bit state: " + e.what();
  }
  if (!problem.empty()) return nullptr;
  const int64_t blocks = (w->numel + kBlock - 1) / kBlock;
  w->tensors = {name, nf4, name + ".quant_map", name + ".absmax"};
  const st::TensorEntry* codes = entry_of(src, name);
  if (static_cast<int64_t>(codes->nbytes()) != (w->numel + 1) / 2) {
    problem = "tensor '" + name + "' holds " + std::to_string(codes->nbytes()) + " bytes of codes, not the " +
              std::to_string((w->numel + 1) / 2) + " of its shape's values at 4 bits";
    return nullptr;
  }
  problem = companion_problem(src, *w, ".quant_map", st::DType::F32, 16);
  if (problem.empty()) {
    problem = companion_problem(src, *w, ".absmax", w->nested ? st::DType::U8 : st::DType::F32, blocks);
  }
  if (problem.empty() && w->nested) {
    w->tensors.insert(w->tensors.end(), {name + ".nested_absmax", name + ".nested_quant_map"});
    problem = companion_problem(src, *w, ".nested_absmax", st::DType::F32, (blocks + kNestedBlock - 1) / kNestedBlock);
    if (problem.empty()) problem = companion_problem(src, *w, ".nested_quant_map", st::DType::F32, 256);
  }
  if (problem.empty() &&
      std::memcmp(read_entry(src, dir, name + ".quant_map").const_data_ptr(), frozen::nf4_levels(), 16 * 4) != 0) {
    problem = "tensor '" + name + "': its quant_map is not bitsandbytes' NF4 levels";
  }
  if (!problem.empty()) problem = problem.rfind("tensor", 0) == 0 ? problem : "tensor '" + name + "': " + problem;
  return problem.empty() ? w : nullptr;
}

}  // namespace

std::shared_ptr<Reader4> find_weight4(const st::FileSet& src, const std::string& dir, const std::string& name,
                                      const std::vector<int64_t>& want, std::string& problem,
                                      std::set<std::string>& claimed) {
  problem.clear();
  std::shared_ptr<const Weight4> w = check_weight4(src, dir, name, want, problem);
  if (w) {
    claimed.insert(w->tensors.begin(), w->tensors.end());
    return std::make_shared<Reader4>(src, dir, w);
  }
  const auto& all = src.index.weight_map;  // refused as a whole: its companions are not listed again
  for (auto it = all.lower_bound(name + ".");
       !problem.empty() && it != all.end() && it->first.rfind(name + ".", 0) == 0; ++it) {
    claimed.insert(it->first);
  }
  return nullptr;
}

Reader4::Reader4(const st::FileSet& src, std::string dir, std::shared_ptr<const Weight4> w)
    : src_(src), dir_(std::move(dir)), w_(std::move(w)) {
  if (w_->nested) {
    nested_absmax_ = read_entry(src_, dir_, w_->name + ".nested_absmax");
    nested_map_ = read_entry(src_, dir_, w_->name + ".nested_quant_map");
  }
}

at::Tensor Reader4::read(const std::string& tensor, uint64_t offset, uint64_t bytes) {
  std::string file;
  const st::TensorEntry* e = entry_of(src_, tensor, &file);
  at::Tensor out = at::empty({static_cast<int64_t>(bytes)}, at::kByte);
  io::File::open_read(io::join(dir_, file))
      .pread_all(out.data_ptr(), bytes, src_.headers.at(file).data_start() + e->begin + offset);
  bytes_read_ += bytes;
  return out;
}

at::Tensor Reader4::absmax(int64_t block0, int64_t blocks) {
  const std::string name = w_->name + ".absmax";
  if (!w_->nested)
    return read(name, static_cast<uint64_t>(block0) * 4, static_cast<uint64_t>(blocks) * 4).view(at::kFloat);
  // bitsandbytes' dequantize_blockwise, then the offset: two fp32 operations, each rounded.
  const at::Tensor codes = read(name, static_cast<uint64_t>(block0), static_cast<uint64_t>(blocks)).to(at::kLong);
  const at::Tensor scale =
      nested_absmax_.index_select(0, at::arange(block0, block0 + blocks, at::kLong).div(kNestedBlock, "floor"));
  return nested_map_.index_select(0, codes).mul(scale).add(at::scalar_tensor(w_->offset, at::kFloat));
}

at::Tensor Reader4::stored(int64_t begin, int64_t count) {
  const int64_t blocks = count / kBlock;
  at::Tensor out = at::empty({blocks * (kBlock / 2 + 4)}, at::kByte);
  out.narrow(0, 0, count / 2).copy_(read(w_->name, static_cast<uint64_t>(begin / 2), static_cast<uint64_t>(count / 2)));
  out.narrow(0, count / 2, blocks * 4).view(at::kFloat).copy_(absmax(begin / kBlock, blocks));
  return out;
}

at::Tensor Reader4::values(int64_t begin, int64_t count) {
  const int64_t b0 = begin / kBlock, b1 = (begin + count + kBlock - 1) / kBlock;
  const int64_t first = b0 * kBlock, n = std::min(b1 * kBlock, w_->numel) - first;
  const at::Tensor packed = read(w_->name, static_cast<uint64_t>(first / 2), static_cast<uint64_t>((n + 1) / 2));
  const at::Tensor q = at::stack({packed.__rshift__(4), packed.bitwise_and(15)}, 1).reshape({-1}).narrow(0, 0, n);
  const at::Tensor levels = at::from_blob(const_cast<float*>(frozen::nf4_levels()), {16}, at::kFloat);
  const at::Tensor scale = absmax(b0, b1 - b0).repeat_interleave(kBlock).narrow(0, 0, n);
  return levels.index_select(0, q.to(at::kLong)).mul(scale).narrow(0, begin - first, count);
}

}  // namespace fsdp::bnb
