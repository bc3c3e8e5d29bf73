# Locates LibTorch (from the torch wheel) and defines the interface target `fsdp_torch`.
#
# Building fsdp: FSDP_TORCH_PREFIX (the wheel's `torch` folder) is required. With CUDA on, the
# wheel's own TorchConfig is used (the build has the CUDA toolkit). With CUDA off, TorchConfig
# cannot be used (the wheel is a CUDA build whose config insists on a toolkit): the CPU libraries
# of the same wheel are imported directly, so a CPU-only configure never needs nvcc.
#
# A consumer of the installed package (FSDP_TORCH_FROM_PACKAGE): LibTorch is FSDP_TORCH_PREFIX when
# given, else the first entry of CMAKE_PREFIX_PATH that holds it (a `torch` folder, a libtorch
# folder, torch's share/cmake, or a site-packages folder), else the one fsdp was built with
# (FSDP_TORCH_BUILT_WITH). Its libraries are always imported directly, the CUDA ones and the CUDA
# runtime of LibTorch's own environment included when fsdp was built with CUDA parts: a consumer
# needs no CUDA toolkit and no CUDA language, and its configure prints nothing of TorchConfig's.
include_guard(GLOBAL)

# The version of the LibTorch in `prefix` (the wheel's version.py, or libtorch's build-version), or "".
function(fsdp_torch_version prefix out)
  set(version "")
  if(EXISTS "${prefix}/version.py")
    file(STRINGS "${prefix}/version.py" line REGEX "^__version__ *=")
    string(REGEX REPLACE "^__version__ *= *['\"]([^'\"]*)['\"].*" "\\1" version "${line}")
  elseif(EXISTS "${prefix}/build-version")
    file(STRINGS "${prefix}/build-version" version LIMIT_COUNT 1)
  endif()
  set(${out} "${version}" PARENT_SCOPE)
endfunction()

if(FSDP_TORCH_FROM_PACKAGE AND NOT FSDP_TORCH_PREFIX)
  foreach(entry IN LISTS CMAKE_PREFIX_PATH)
    foreach(candidate IN ITEMS "${entry}" "${entry}/../.." "${entry}/torch")
      if(EXISTS "${candidate}/lib/libtorch_cpu.so")
        get_filename_component(FSDP_TORCH_PREFIX "${candidate}" ABSOLUTE)  # lexically: links kept
        break()
      endif()
    endforeach()
    if(FSDP_TORCH_PREFIX)
      break()
    endif()
  endforeach()
  if(NOT FSDP_TORCH_PREFIX)
    set(FSDP_TORCH_PREFIX "${FSDP_TORCH_BUILT_WITH}")
  endif()
endif()
if(NOT FSDP_TORCH_PREFIX)
  message(FATAL_ERROR "FSDP_TORCH_PREFIX is not set: pass -DFSDP_TORCH_PREFIX=<site-packages>/torch "
                      "or run scripts/setup, which configures build/ for you.")
endif()
if(NOT EXISTS "${FSDP_TORCH_PREFIX}/lib/libtorch_cpu.so")
  message(FATAL_ERROR "FSDP_TORCH_PREFIX=${FSDP_TORCH_PREFIX} holds no lib/libtorch_cpu.so: "
                      "it must be the `torch` folder of an installed torch wheel (or a libtorch folder). A consumer "
                      "of the installed fsdp package may instead put that folder (or torch's share/cmake) on "
                      "CMAKE_PREFIX_PATH.")
endif()
fsdp_torch_version("${FSDP_TORCH_PREFIX}" FSDP_TORCH_VERSION)
if(FSDP_TORCH_FROM_PACKAGE AND FSDP_TORCH_BUILT_VERSION AND FSDP_TORCH_VERSION
   AND NOT FSDP_TORCH_VERSION STREQUAL FSDP_TORCH_BUILT_VERSION)
  message(FATAL_ERROR "fsdp was built against LibTorch ${FSDP_TORCH_BUILT_VERSION}, but the LibTorch found at "
                      "${FSDP_TORCH_PREFIX} is ${FSDP_TORCH_VERSION}: C++ libraries must match exactly. Point "
                      "CMAKE_PREFIX_PATH (or FSDP_TORCH_PREFIX) at a LibTorch ${FSDP_TORCH_BUILT_VERSION}, or rebuild fsdp "
                      "against this one.")
endif()

# The definitions the wheel's torch_cpu target carries; the c10d headers need them.
set(FSDP_TORCH_DEFINITIONS "USE_DISTRIBUTED;USE_C10D_GLOO;USE_RPC;USE_TENSORPIPE")
if(TARGET fsdp_torch)
  # Already defined in this configure.
elseif(FSDP_CUDA_ENABLED AND NOT FSDP_TORCH_FROM_PACKAGE)
  find_package(Torch REQUIRED PATHS "${FSDP_TORCH_PREFIX}/share/cmake/Torch" NO_DEFAULT_PATH)
  add_library(fsdp_torch INTERFACE IMPORTED)
  set_target_properties(fsdp_torch PROPERTIES INTERFACE_LINK_LIBRARIES "${TORCH_LIBRARIES}")
else()
  # LibTorch's libraries imported directly: a CPU build, or any consumer of the package.
  set(torch_libs "-Wl,--no-as-needed;${FSDP_TORCH_PREFIX}/lib/libtorch_cpu.so")
  if(FSDP_CUDA_ENABLED)
    # The CUDA runtime LibTorch itself loads: the wheel's (site-packages/nvidia/.../lib), else a
    # system one. fsdp's CUDA kernels need it; nothing needs the toolkit.
    file(GLOB cudart LIST_DIRECTORIES false "${FSDP_TORCH_PREFIX}/lib/libcudart.so*"
         "${FSDP_TORCH_PREFIX}/../nvidia/*/lib/libcudart.so*" "${FSDP_TORCH_PREFIX}/../nvidia/cuda_runtime/lib/libcudart.so*")
    if(NOT cudart)
      find_library(FSDP_CUDART_LIBRARY cudart PATHS /usr/local/cuda/lib64 /usr/local/cuda/lib)
      set(cudart "${FSDP_CUDART_LIBRARY}")
    endif()
    if(NOT cudart)
      message(FATAL_ERROR "fsdp was built with CUDA parts, which link the CUDA runtime (libcudart.so), found neither "
                          "beside LibTorch (${FSDP_TORCH_PREFIX}/../nvidia/*/lib) nor on the system: install the "
                          "torch wheel's CUDA packages, or use an fsdp built without CUDA (-DFSDP_WITH_CUDA=OFF).")
    endif()
    list(GET cudart 0 cudart)
    list(APPEND torch_libs "${FSDP_TORCH_PREFIX}/lib/libtorch_cuda.so" "${FSDP_TORCH_PREFIX}/lib/libc10_cuda.so"
         "${cudart}" "${FSDP_TORCH_PREFIX}/lib/libtorch.so")
  endif()
  list(APPEND torch_libs "${FSDP_TORCH_PREFIX}/lib/libc10.so" "-Wl,--as-needed")
  add_library(fsdp_torch INTERFACE IMPORTED)
  set_target_properties(fsdp_torch PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${FSDP_TORCH_PREFIX}/include;${FSDP_TORCH_PREFIX}/include/torch/csrc/api/include"
    INTERFACE_COMPILE_DEFINITIONS "${FSDP_TORCH_DEFINITIONS}"
    INTERFACE_LINK_LIBRARIES "${torch_libs}")
  if(FSDP_TORCH_FROM_PACKAGE)
    message(STATUS "fsdp: LibTorch ${FSDP_TORCH_VERSION} from ${FSDP_TORCH_PREFIX}")
  endif()
endif()
