// fsdp: fully-sharded data-parallel training on LibTorch. The umbrella header: every public header.
//
// Memory: three questions, three calls, each answering one of them per rank.
//   - Before a run, will it fit, and with which choices? fsdp::plan (fsdp/plan.h): a prediction of
//     the whole process's peak (device, host, disk) from a model's shape, which allocates nothing;
//     it chooses the strategy, offload tiers, checkpointing and micro-batch that fit a budget.
//   - At the start of a run, what will the offload tiers hold and move each step?
//     fsdp::offload_plan (fsdp/offload.h): the sharded states of the flat params as placed, by tier,
//     and the steady-state I/O per step. The planner's sharded-state items are the same figures
//     (the same placement rules: a test compares them).
//   - During a run, what is held now? fsdp::memory_report (fsdp/memory.h): measured from the
//     buffers themselves: the sharded states by tier and the gathered buffers alive (and their peak).
#pragma once

#include "fsdp/checkpoint.h"
#include "fsdp/checkpoint_activations.h"
#include "fsdp/comm.h"
#include "fsdp/device_mesh.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "fsdp/frozen_storage.h"
#include "fsdp/fully_shard.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/init.h"
#include "fsdp/join.h"
#include "fsdp/launcher_error.h"
#include "fsdp/lora.h"
#include "fsdp/loss.h"
#include "fsdp/measure.h"
#include "fsdp/memory.h"
#include "fsdp/meta.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/offload.h"
#include "fsdp/offload_io.h"
#include "fsdp/offload_policy.h"
#include "fsdp/optim.h"
#include "fsdp/param_init.h"
#include "fsdp/plan.h"
#include "fsdp/torch_optim.h"
#include "fsdp/options.h"
#include "fsdp/sharded.h"
#include "fsdp/stop.h"
#include "fsdp/trace.h"
#include "fsdp/vocab_parallel.h"
