// Plain argument records shared by the ATen-facing dispatch (kernels/ops.cpp), the CPU twins
// (kernels/cpu/) and the CUDA launchers (kernels/cuda/). No ATen or CUDA includes, so nvcc compiles
// the .cu files that include it quickly.
#pragma once

#include <cstdint>

namespace fsdp::kernels {

// The element types the kernels read and write.
enum class ElemType : int { kFloat32, kBFloat16, kFloat16 };

inline int elem_size(ElemType t) { return t == ElemType::kFloat32 ? 4 : 2; }

// AdamW's per-step scalars, each rounded to fp32 once on the host exactly as ATen rounds the
// Scalar arguments of the reference sequence (see Note [Twin numerics] in kernels/ops.cpp).
struct AdamWScalars {
  bool apply_decay = false;  // weight_decay != 0
  float decay = 1;           // 1 - lr * weight_decay
  bool lerp_small = true;    // |1 - beta1| < 0.5: ATen's lerp takes m + w * (g - m)
  float lerp_coeff = 0;      // w = 1 - beta1 when lerp_small, else w - 1 (then g + (w - 1) * (g - m))
  float beta2 = 0;
  float one_minus_beta2 = 0;
  float sqrt_bc2 = 1;  // sqrt(1 - beta2^step)
  float eps = 0;
  float step_size = 0;  // -lr / (1 - beta1^step)
};

}  // namespace fsdp::kernels
