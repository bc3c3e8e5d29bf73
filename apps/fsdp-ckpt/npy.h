// Minimal NumPy .npy files (format version 1.0, C order, little-endian), so that fsdp-ckpt logits
// exchanges arrays with Python through np.load / np.save: int64 tokens in, float32 logits out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace fsdp_ckpt {

// Reads an int64 ('<i8') array of any shape. Throws std::runtime_error naming the file and what
// is wrong (another dtype, Fortran order, a short file, ...).
at::Tensor read_npy_int64(const std::string& path);

// Writes a contiguous float32 tensor as '<f4'. Throws std::runtime_error naming the file.
void write_npy_float32(const std::string& path, const at::Tensor& tensor);

}  // namespace fsdp_ckpt
