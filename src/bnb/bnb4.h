// bitsandbytes' 4-bit weights as a transformers "bnb-4bit" save holds them in safetensors files
// (Note [bitsandbytes 4-bit weights] in bnb4.cpp): a weight's packed NF4 codes beside its blocks'
// absmax, plain or double-quantized. The import reads them through this layer: the codes and the
// absmax become fsdp's NF4 stored form as they are (Note [Frozen storage] in kernels/cpu/blocks.cpp,
// the same block format), or its values are decoded exactly as bitsandbytes dequantizes them.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "safetensors/file_set.h"

namespace fsdp::bnb {

constexpr int64_t kBlock = 64;         // values per absmax: the only blocksize imported
constexpr int64_t kNestedBlock = 256;  // absmax values per nested absmax (double quantization)

// One 4-bit weight of a file set, checked: where its tensors are and what its quant_state says.
struct Weight4 {
  std::string name;            // the weight's tensor, e.g. "model.layers.0.mlp.up_proj.weight"
  std::vector<int64_t> shape;  // quant_state's "shape": the weight's own
  int64_t numel = 0;
  bool nested = false;               // double-quantized absmax
  float offset = 0.0f;               // nested_offset, added to each decoded absmax
  std::vector<std::string> tensors;  // every tensor of the file set that belongs to it
};

// Reads a 4-bit weight's elements, a range at a time (each read opens its file: a model's thousands
// of readers hold no descriptors). Throws CheckpointError naming the file on an I/O error.
class Reader4 {
 public:
  Reader4(const safetensors::FileSet& src, std::string dir, std::shared_ptr<const Weight4> w);
  int64_t numel() const { return w_->numel; }
  // The NF4 stored form ([codes | absmax as fp32 bytes], Note [Frozen storage]) of elements
  // [begin, begin + count), whole blocks (begin and count multiples of kBlock).
  at::Tensor stored(int64_t begin, int64_t count);
  // The fp32 values of elements [begin, begin + count): level[code] * absmax, as bitsandbytes'
  // dequantize_4bit computes them before its cast to the compute dtype.
  at::Tensor values(int64_t begin, int64_t count);
  // stored(begin, count) when `whole_blocks`, else values(begin, count).
  at::Tensor chunk(int64_t begin, int64_t count, bool whole_blocks) {
    return whole_blocks ? stored(begin, count) : values(begin, count);
  }
  // The fp32 absmax of blocks [block0, block0 + blocks), decoded as bitsandbytes does.
  at::Tensor absmax(int64_t block0, int64_t blocks);
  uint64_t bytes_read() const { return bytes_read_; }
  const Weight4& weight() const { return *w_; }

 private:
  at::Tensor read(const std::string& tensor, uint64_t offset, uint64_t bytes);
  const safetensors::FileSet& src_;
  std::string dir_;
  std::shared_ptr<const Weight4> w_;
  at::Tensor nested_absmax_, nested_map_;  // read once
  uint64_t bytes_read_ = 0;
};

// A reader of the 4-bit weight stored under `name` in `src` (a file set in `dir`, which must outlive
// it), or null when `name` is an ordinary tensor (it has no quant_state companion). `problem` is set
// (and null returned) when it is a 4-bit weight this import does not read: FP4, 8-bit, another
// blocksize, companions missing or of another shape, a quant_map that is not NF4's levels, a shape
// other than `want`. Every tensor of the file set that belongs to the weight is added to `claimed`
// (all of them named "<name>.*" when it is refused). Reads the quant_state JSON.
std::shared_ptr<Reader4> find_weight4(const safetensors::FileSet& src, const std::string& dir, const std::string& name,
                                      const std::vector<int64_t>& want, std::string& problem,
                                      std::set<std::string>& claimed);

}  // namespace fsdp::bnb
