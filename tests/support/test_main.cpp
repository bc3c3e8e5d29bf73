// GoogleTest entry point for fsdp tests: one intra-op thread per process, so ranks running as
// threads or processes on a 2-core machine do not oversubscribe it.
//
// Note [The math library warmed up before rank threads]
// The first products and the first tanh of a process run here, on one thread, before any test
// starts rank threads. Rank threads share one process: on rare runs one rank's first forward came
// out slightly different (StepInBackward.EqualsStepAfterBackwardBitwise, 5 of 290 runs;
// CollectiveOrder.CheckChangesNothingInAHealthyRun once in CI), because MKL's vector math
// publishes its CPU detection racily (Note [The math library's first call] in
// src/comm/rendezvous.cpp, where the library settles it when a Dist is made). Tests that start
// threads without a Dist are covered here too.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  const at::Tensor a = at::ones({64, 64});
  (void)at::linear(a, a, at::ones({64})).sum().item<float>();
  (void)at::mm(a.narrow(0, 0, 7), a).sum().item<float>();
  (void)at::tanh(a).sum().item<float>();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
