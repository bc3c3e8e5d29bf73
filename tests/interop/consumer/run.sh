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
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$prefix" -DFSDP_EXAMPLES_DIR="$examples" >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
env -u RANK -u WORLD_SIZE "$work/build/consumer"
# The example trains, saves and resumes on one rank.
env -u RANK -u WORLD_SIZE "$work/build/sequential_example" --steps 2 --out "$work/seq" >/dev/null
env -u RANK -u WORLD_SIZE "$work/build/sequential_example" --steps 3 --out "$work/seq" --resume >"$work/seq.out"
grep -q "^step 3 loss" "$work/seq.out" || { echo "run.sh: the Sequential example did not resume to step 3" >&2; exit 1; }
echo "sequential example ok"
