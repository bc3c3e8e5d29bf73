// Conversions between safetensors dtypes and at::ScalarType. Kept apart from safetensors.h so the
// format code compiles without LibTorch (the fuzz build links none).
#pragma once

#include <c10/core/ScalarType.h>

#include "safetensors/safetensors.h"

namespace fsdp {
namespace safetensors {

// The ScalarType that holds elements of `dtype` bit for bit (F8_E4M3 -> Float8_e4m3fn, the type
// Python safetensors uses).
c10::ScalarType to_scalar_type(DType dtype);

// The safetensors dtype for `type`. Throws CheckpointError naming the type for one the format has
// no name for (complex, quantized, the fnuz float8 variants, ...).
DType from_scalar_type(c10::ScalarType type);

}  // namespace safetensors
}  // namespace fsdp
