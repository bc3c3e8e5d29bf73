# Locates LibTorch (from the torch wheel) and defines the interface target `fsdp_torch`.
#
# With CUDA on, the wheel's own TorchConfig is used (it needs the CUDA toolkit). With CUDA off,
# TorchConfig cannot be used because the wheel is a CUDA build whose config insists on a CUDA
# toolkit; we then import the CPU libraries of the same wheel directly, so a CPU-only configure
# never needs nvcc. Inputs: FSDP_TORCH_PREFIX (the wheel's `torch` folder), FSDP_CUDA_ENABLED.
include_guard(GLOBAL)

if(NOT FSDP_TORCH_PREFIX)
  message(FATAL_ERROR "FSDP_TORCH_PREFIX is not set: pass -DFSDP_TORCH_PREFIX=<site-packages>/torch "
                      "or run scripts/setup, which configures build/ for you.")
endif()
if(NOT EXISTS "${FSDP_TORCH_PREFIX}/lib/libtorch_cpu.so")
  message(FATAL_ERROR "FSDP_TORCH_PREFIX=${FSDP_TORCH_PREFIX} holds no lib/libtorch_cpu.so: "
                      "it must be the `torch` folder of an installed torch wheel.")
endif()

if(FSDP_CUDA_ENABLED)
  find_package(Torch REQUIRED PATHS "${FSDP_TORCH_PREFIX}/share/cmake/Torch" NO_DEFAULT_PATH)
  if(NOT TARGET fsdp_torch)
    add_library(fsdp_torch INTERFACE IMPORTED)
    set_target_properties(fsdp_torch PROPERTIES INTERFACE_LINK_LIBRARIES "${TORCH_LIBRARIES}")
  endif()
else()
  if(NOT TARGET fsdp_torch)
    add_library(fsdp_torch INTERFACE IMPORTED)
    set_target_properties(fsdp_torch PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES
        "${FSDP_TORCH_PREFIX}/include;${FSDP_TORCH_PREFIX}/include/torch/csrc/api/include"
      # The definitions the wheel's torch_cpu target carries; the c10d headers need them.
      INTERFACE_COMPILE_DEFINITIONS "USE_DISTRIBUTED;USE_C10D_GLOO;USE_RPC;USE_TENSORPIPE"
      INTERFACE_LINK_LIBRARIES
        "-Wl,--no-as-needed;${FSDP_TORCH_PREFIX}/lib/libtorch_cpu.so;${FSDP_TORCH_PREFIX}/lib/libc10.so;-Wl,--as-needed")
  endif()
endif()
