// Links against the installed fsdp package and runs a one-rank collective.
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
  std::printf("consumer ok: world %d\n", dist->world_size());
  return 0;
}
