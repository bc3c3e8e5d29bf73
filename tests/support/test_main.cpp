// GoogleTest entry point for fsdp tests: one intra-op thread per process, so ranks running as
// threads or processes on a 2-core machine do not oversubscribe it.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
