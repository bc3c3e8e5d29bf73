// GoogleTest entry point for fsdp tests: one intra-op thread per process, so ranks running as
// threads or processes on a 2-core machine do not oversubscribe it.
//
// The math library's first use is made here, on one thread, before any test starts rank threads
// (Note [The math library's first call] in src/comm/rendezvous.cpp): rank threads share one
// process, and on rare runs one rank's first forward came out slightly different
// (StepInBackward.EqualsStepAfterBackwardBitwise, 5 of 290 runs;
// CollectiveOrder.CheckChangesNothingInAHealthyRun once in CI). Dist creation settles it too;
// this also covers tests that start threads without one.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "comm/first_use.h"

int main(int argc, char** argv) {
  at::set_num_threads(1);
  fsdp::settle_math_library();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
