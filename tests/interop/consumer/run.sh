#!/usr/bin/env bash
# Installs the built fsdp into a temporary prefix, checks the install tree (the three apps, every
# layer library, the public headers), then configures, builds and runs a consumer project that
# finds it with find_package(fsdp), with the Sequential example among its programs.
# Args: BUILD_DIR CONSUMER_SOURCE_DIR EXAMPLES_DIR.
set -euo pipefail
build=$1
src=$2
examples=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
missing=()
for app in fsdp-train fsdp-ckpt fsdp-run; do
  [[ -x "$prefix/bin/$app" ]] || missing+=("bin/$app")
done
for layer in fsdp_base fsdp_safetensors fsdp_comm fsdp_offload fsdp_kernels fsdp_shard fsdp_checkpoint; do
  [[ -n "$(find "$prefix" -name "lib$layer.a" -print -quit)" ]] || missing+=("lib$layer.a")
done
for file in include/fsdp/fsdp.h include/fsdp/checkpoint.h; do
  [[ -f "$prefix/$file" ]] || missing+=("$file")
done
[[ -n "$(find "$prefix" -name fsdpConfig.cmake -print -quit)" ]] || missing+=("fsdpConfig.cmake")
if ((${#missing[@]})); then
  echo "run.sh: the install tree $prefix lacks: ${missing[*]}" >&2
  (cd "$prefix" && find . -type f | sort) >&2
  exit 1
fi
# The installed apps run from the prefix (they find LibTorch without LD_LIBRARY_PATH).
for app in fsdp-train fsdp-ckpt fsdp-run; do
  "$prefix/bin/$app" --help >/dev/null || { echo "run.sh: $prefix/bin/$app --help failed" >&2; exit 1; }
done
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# Paths under the temporary folder are hashed relative to it, so a later run hits the cache.
export CCACHE_BASEDIR=$work CCACHE_NOHASHDIR=1
# The consumer is a CPU program on a machine without the CUDA toolkit: nvcc is off PATH and the
# CUDA variables unset, and a CUDA compiler that does not exist is named (CUDACXX), so any
# enable_language(CUDA) in the package would fail. The package may have been built with CUDA parts.
# LibTorch is found where the consumer's CMAKE_PREFIX_PATH says (torch's share/cmake, the way
# LibTorch's own docs set it), here a torch folder of links of its own, not the build's.
torch_real=$(sed -n 's/^set(FSDP_TORCH_BUILT_WITH "\(.*\)")$/\1/p' "$(find "$prefix" -name fsdpConfig.cmake -print -quit)")
[[ -f "$torch_real/lib/libtorch_cpu.so" ]] || { echo "run.sh: no LibTorch at '$torch_real' (from fsdpConfig.cmake)" >&2; exit 1; }
make_torch() {  # DIR VERSION: a torch folder whose libraries and headers are the real one's
  mkdir -p "$1/share"
  ln -s "$torch_real/lib" "$1/lib"
  ln -s "$torch_real/include" "$1/include"
  ln -s "$torch_real/share/cmake" "$1/share/cmake"
  echo "__version__ = '$2'" >"$1/version.py"
  [[ -d "$torch_real/../nvidia" ]] && ln -s "$torch_real/../nvidia" "$1/../nvidia"
  return 0
}
version=$(sed -n "s/^__version__ *= *['\"]\([^'\"]*\)['\"].*/\1/p" "$torch_real/version.py")
make_torch "$work/site/torch" "$version"
# PATH without nvcc: CUDA folders dropped, any other folder that holds an nvcc (a link in
# /usr/local/bin) replaced by a folder of links to everything else in it.
no_cuda_path=""
shadows=0
IFS=: read -ra path_dirs <<<"$PATH"
for dir in "${path_dirs[@]}"; do
  [[ -z "$dir" || "${dir,,}" == *cuda* ]] && continue
  if [[ -e "$dir/nvcc" ]]; then
    shadows=$((shadows + 1))
    mkdir -p "$work/path/$shadows"
    for f in "$dir"/*; do [[ "$(basename "$f")" == nvcc ]] || ln -s "$f" "$work/path/$shadows/"; done
    dir=$work/path/$shadows
  fi
  no_cuda_path+="${no_cuda_path:+:}$dir"
done
cpu_only() {
  env -u CUDA_HOME -u CUDA_PATH -u CUDAToolkit_ROOT CUDACXX=/nonexistent/nvcc PATH="$no_cuda_path" "$@"
}
if PATH="$no_cuda_path" command -v nvcc >/dev/null; then
  echo "run.sh: nvcc is still on PATH after removing the CUDA folders: $(PATH="$no_cuda_path" command -v nvcc)" >&2
  exit 1
fi
cpu_only cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$prefix;$work/site/torch/share/cmake" -DFSDP_EXAMPLES_DIR="$examples" >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
grep -q "fsdp: LibTorch $version from $work/site/torch" "$work/configure.log" || {
  echo "run.sh: the package did not take LibTorch from CMAKE_PREFIX_PATH ($work/site/torch):" >&2
  cat "$work/configure.log" >&2
  exit 1
}
if grep -q "Warning" "$work/configure.log"; then
  echo "run.sh: a plain configure of the consumer printed warnings:" >&2
  cat "$work/configure.log" >&2
  exit 1
fi
# A LibTorch of another version is refused at configure, naming both versions.
make_torch "$work/other/torch" "0.0.1"
if cpu_only cmake -S "$src" -B "$work/build-other" -G Ninja -DCMAKE_PREFIX_PATH="$prefix;$work/other/torch" \
     -DFSDP_EXAMPLES_DIR="$examples" >"$work/other.log" 2>&1; then
  echo "run.sh: a LibTorch of another version (0.0.1) was accepted" >&2
  exit 1
fi
grep -q "built against LibTorch $version" "$work/other.log" || { cat "$work/other.log" >&2; exit 1; }
echo "cpu-only consumer configure ok: LibTorch $version from CMAKE_PREFIX_PATH, no CUDA compiler, no warnings"
cpu_only cmake --build "$work/build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
env -u RANK -u WORLD_SIZE "$work/build/consumer"
# The example trains, saves and resumes on one rank.
env -u RANK -u WORLD_SIZE "$work/build/sequential_example" --steps 2 --out "$work/seq" >/dev/null
env -u RANK -u WORLD_SIZE "$work/build/sequential_example" --steps 3 --out "$work/seq" --resume >"$work/seq.out"
grep -q "^step 3 loss" "$work/seq.out" || { echo "run.sh: the Sequential example did not resume to step 3" >&2; exit 1; }
echo "sequential example ok"
