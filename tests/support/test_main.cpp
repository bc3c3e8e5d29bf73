// GoogleTest entry point for fsdp tests: one intra-op thread per process, so ranks running as
// threads or processes on a 2-core machine do not oversubscribe it. The math library's CPU
// detection runs here, on one thread, before any test starts threads of its own (Note [The math
// library's first call] in src/comm/rendezvous.cpp: the library does the same when a Dist is made).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  (void)at::tanh(at::zeros({1}));
  (void)at::mm(at::zeros({1, 1}), at::zeros({1, 1}));
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
