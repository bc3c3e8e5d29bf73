// fsdp-train: trains a Llama-style decoder with fully-sharded data parallelism from a JSON config.
//
//   fsdp-run --nproc-per-node 2 -- fsdp-train --steps 200 --metrics run.jsonl
//
// The program is run.cpp's main_with_hooks with no test hooks (hooks.h).
#include "hooks.h"

int main(int argc, char** argv) { return train::main_with_hooks(argc, argv, train::TrainHooks{}); }
