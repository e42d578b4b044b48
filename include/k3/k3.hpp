// k3/k3.hpp — the whole user API in one include (docs/architecture.md, "Source tree").
//
// Per-op headers can be included alone; this umbrella is for programs that want all of it. The
// tools' support (case tables, comparison, benchmark workloads and limits, the run files of the
// `k3` tool, synthetic checkpoints) is under k3/harness/ and is not included here. No header here
// includes a CUDA header: the CUDA entry points are host functions that report kUnavailable in a
// build without CUDA.
#pragma once

// Status, machine facts, number formats
#include "k3/config.hpp"
#include "k3/formats.hpp"
#include "k3/memory.hpp"
#include "k3/mx.hpp"
#include "k3/portable_math.hpp"
#include "k3/status.hpp"
#include "k3/system.hpp"

// Ops: problem types, checks and FP64 definitions
#include "k3/activation.hpp"
#include "k3/kda.hpp"
#include "k3/kda_ops.hpp"
#include "k3/layout.hpp"
#include "k3/linear.hpp"
#include "k3/moe.hpp"
#include "k3/moe_ref.hpp"
#include "k3/routing.hpp"

// Backends: the registry (prepare / run by name), and each backend's own plan / prepack / run
#include "k3/backend.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/cpu_linear.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_kda.hpp"
#include "k3/cuda_kda_ops.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/cuda_routing.hpp"
#include "k3/cuda_sm120.hpp"

// Checkpoints
#include "k3/checkpoint.hpp"
#include "k3/safetensors.hpp"

// Many ranks: communicators, expert parallelism, tensor-parallel all-reduce
#include "k3/allreduce.hpp"
#include "k3/comm.hpp"
#include "k3/comm_ipc.hpp"
#include "k3/comm_nccl.hpp"
#include "k3/cuda_ep.hpp"
#include "k3/ep.hpp"
#include "k3/ep_route.hpp"
#include "k3/expert_map.hpp"
