// fsdp: fully-sharded data-parallel training on LibTorch. The umbrella header: every public header.
#pragma once

#include "fsdp/checkpoint.h"
#include "fsdp/checkpoint_activations.h"
#include "fsdp/comm.h"
#include "fsdp/device_mesh.h"
#include "fsdp/dist.h"
#include "fsdp/errors.h"
#include "fsdp/fully_shard.h"
#include "fsdp/init.h"
#include "fsdp/memory.h"
#include "fsdp/mixed_precision.h"
#include "fsdp/offload.h"
#include "fsdp/optim.h"
#include "fsdp/options.h"
#include "fsdp/stop.h"
#include "fsdp/trace.h"
