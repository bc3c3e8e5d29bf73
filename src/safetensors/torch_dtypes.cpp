// The table behind torch_dtypes.h: one row per safetensors dtype.
#include "safetensors/torch_dtypes.h"

#include <string>

#include "fsdp/errors.h"

namespace fsdp {
namespace safetensors {
namespace {

struct DTypePair {
  DType dtype;
  c10::ScalarType type;
};

constexpr DTypePair kPairs[] = {
    {DType::BOOL, c10::ScalarType::Bool},
    {DType::U8, c10::ScalarType::Byte},
    {DType::I8, c10::ScalarType::Char},
    {DType::I16, c10::ScalarType::Short},
    {DType::U16, c10::ScalarType::UInt16},
    {DType::F16, c10::ScalarType::Half},
    {DType::BF16, c10::ScalarType::BFloat16},
    {DType::I32, c10::ScalarType::Int},
    {DType::U32, c10::ScalarType::UInt32},
    {DType::F32, c10::ScalarType::Float},
    {DType::F64, c10::ScalarType::Double},
    {DType::I64, c10::ScalarType::Long},
    {DType::U64, c10::ScalarType::UInt64},
    {DType::F8_E4M3, c10::ScalarType::Float8_e4m3fn},
    {DType::F8_E5M2, c10::ScalarType::Float8_e5m2},
};

}  // namespace

c10::ScalarType to_scalar_type(DType dtype) {
  for (const DTypePair& p : kPairs) {
    if (p.dtype == dtype) return p.type;
  }
  throw CheckpointError("fsdp: safetensors dtype " + std::to_string(static_cast<int>(dtype)) +
                        " has no at::ScalarType");
}

DType from_scalar_type(c10::ScalarType type) {
  for (const DTypePair& p : kPairs) {
    if (p.type == type) return p.dtype;
  }
  throw CheckpointError(std::string("fsdp: tensors of dtype ") + c10::toString(type) +
                        " cannot be stored in safetensors files; convert them to a supported "
                        "dtype (e.g. float32, bfloat16, int64) first");
}

}  // namespace safetensors
}  // namespace fsdp
