// Links against the installed fsdp package and runs a one-rank collective, with the umbrella header
// (each public header is also compiled on its own: see CMakeLists.txt).
#include <ATen/ATen.h>
#include <fsdp/fsdp.h>

#include <cstdio>

int main() {
  auto dist = fsdp::init_from_env();
  fsdp::DeviceMesh mesh(dist);
  auto in = at::arange(4, at::kFloat);
  auto out = at::empty({4 * mesh.shard_size()});
  mesh.shard_group().all_gather(out, in, "consumer").wait();
  if (!at::equal(out, in)) return 1;
  // The checkpoint API (and the JSON type of its TrainState::extra) is public too.
  fsdp::checkpoint::TrainState state;
  state.extra["consumer"] = true;
  if (!state.extra.at("consumer").get<bool>()) return 1;
  std::printf("consumer ok: world %d\n", dist->world_size());
  return 0;
}
