// Must NOT compile: fsdp::call on a module whose forward returns a type fsdp cannot look into (a
// std::list of tensors, with no fsdp::ForwardOutput specialisation). ctest builds it and expects
// the static_assert's message (Call.UnknownReturnTypeIsACompileError).
#include <fsdp/fully_shard.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <list>

struct ListImpl : torch::nn::Module {
  std::list<at::Tensor> forward(const at::Tensor& x) { return {x}; }
};
TORCH_MODULE(List);

void run(List& m, const at::Tensor& x) { fsdp::call(m, x); }
