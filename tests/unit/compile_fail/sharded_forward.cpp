// Must NOT compile: fsdp::Sharded on a block whose forward cannot be deduced (a ModuleList, which
// has no forward). ctest builds it and expects the static_assert's message
// (Sharded.UndeducibleForwardIsACompileError).
#include <fsdp/sharded.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

torch::nn::Sequential run() {
  return torch::nn::Sequential(fsdp::Sharded(torch::nn::ModuleList(torch::nn::Linear(2, 2))));
}
