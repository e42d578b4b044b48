// `k3 info`: version, build, backends, CPU and SIMD features, threads, CUDA devices.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "command.hpp"
#include "k3/build_info.hpp"
#include "k3/comm.hpp"
#include "k3/comm_nccl.hpp"
#include "k3/cuda.hpp"
#include "k3/cuda_moe.hpp"
#include "k3/cuda_sm120.hpp"
#include "k3/memory.hpp"
#include "k3/system.hpp"

namespace k3::tool {
namespace {

nlohmann::json info_json() {
  const auto& cpu = cpu_info();
  const auto& f = cpu.features;
  nlohmann::json j;
  j["version"] = build::kVersion;
  j["build_type"] = build::kBuildType;
  j["compiler"] = build::kCompiler;
  j["sanitized"] = build::kSanitized;
  j["backends"] = nlohmann::json::array({"reference", "cpu"});
  if (cuda::compiled()) j["backends"].push_back("cuda");
  j["cuda"]["compiled"] = cuda::compiled();
  j["cuda"]["archs"] = cuda::compiled_archs();
  if (cuda::compiled()) {
    // What ran where (docs/cuda_moe.md, "First GPU run"): one H200 window so far.
    j["cuda"]["moe_status"] =
        "sm_90 paths checked on an H200 on 2026-12-04 (CUDA tests and k3 validate pass; speed not tuned); "
        "sm_120 never run on a GPU";
    j["cuda"]["kda_status"] =
        "checked on an H200 (sm_90) on 2026-12-04 (recurrent prefill / decode / verify, opt-in chunked prefill, "
        "conv1d, RMSNorm: CUDA tests and k3 validate pass; speed not tuned); sm_120 never run on a GPU";
    // The MoE kernel paths in this build (the plan picks one; K3_CUDA_MOE_PATH forces one).
    std::string paths = "decode-splitk (auto up to 16 rows per local expert), prefill";
    paths += cuda::has_sm90_grouped_gemm() ? ", prefill-sm90 (CUTLASS sm_90a; auto above 16 rows on sm_90)"
                                           : "; prefill-sm90 not built (needs the CUTLASS headers: scripts/setup.sh)";
    if (cuda::has_sm120_blockscaled_gemm()) paths += ", w4a8-sm120-cutlass (CUTLASS sm_120a; forced only)";
    j["cuda"]["moe_paths"] = paths + "; the sm_90 paths ran on an H200 (2026-12-04), the sm_120 one never ran";
    // Opt-in building block only; no sm_120 machine exists here to run it.
    j["cuda"]["sm120_blockscaled_gemm"] =
        cuda::has_sm120_blockscaled_gemm()
            ? "compiled: CUTLASS sm_120a W4A8 (MXFP8 x MXFP4) block-scaled grouped GEMM, opt-in building block, "
              "UNVERIFIED: never run on a GPU"
            : "not built (needs the CUTLASS headers and sm_120a in K3_CUDA_ARCHS)";
  }
  j["cpu"]["model"] = cpu.model;
  j["cpu"]["vendor"] = cpu.vendor;
  j["cpu"]["logical_cpus"] = cpu.logical_cpus;
  j["cpu"]["features"] = {{"avx2", f.avx2},         {"fma", f.fma},
                          {"avx512f", f.avx512f},   {"avx512bw", f.avx512bw},
                          {"avx512vl", f.avx512vl}, {"avx512_bf16", f.avx512_bf16},
                          {"avx512_vnni", f.avx512_vnni}, {"avx512_vbmi", f.avx512_vbmi},
                          {"gfni", f.gfni},         {"avx_vnni", f.avx_vnni}};
  j["threads"] = default_thread_count();
  // Packed weights are advised for transparent huge pages (k3/memory.hpp); the kernel's mode says
  // whether that takes effect ("never": 4 KiB pages, slower decode streams).
  j["huge_pages"] = huge_page_mode();
  // Transports of the multi-rank ops (docs/distributed.md).
  j["transports"]["self"] = "ok (one process)";
  j["transports"]["mpi"] = comm::mpi_available().is_ok() ? "ok (" + comm::mpi_library_version() + ")"
                                                          : comm::mpi_available().message();
  const Status nccl = comm::nccl_available();
  j["transports"]["nccl"] =
      nccl.is_ok() ? "ok (ran at world size 1 on an H200, 2026-12-04; never run across GPUs)" : nccl.message();
  auto devs = cuda::devices();
  j["cuda"]["devices"] = nlohmann::json::array();
  if (devs.is_ok()) {
    for (const auto& d : devs.value()) {
      j["cuda"]["devices"].push_back({{"index", d.index},
                                      {"name", d.name},
                                      {"compute_capability", std::to_string(d.cc_major) + "." + std::to_string(d.cc_minor)},
                                      {"sm_count", d.sm_count},
                                      {"total_memory_bytes", d.total_memory},
                                      {"runnable", d.runnable}});
    }
  } else {
    j["cuda"]["devices_note"] = devs.status().message();
  }
  return j;
}

void print_text(const nlohmann::json& j) {
  std::printf("k3 %s (%s build, %s%s)\n", j["version"].get<std::string>().c_str(),
              j["build_type"].get<std::string>().c_str(), j["compiler"].get<std::string>().c_str(),
              j["sanitized"].get<bool>() ? ", ASan+UBSan" : "");
  std::string backends;
  for (const auto& b : j["backends"]) backends += (backends.empty() ? "" : ", ") + b.get<std::string>();
  std::printf("backends:      %s\n", backends.c_str());
  std::printf("cuda archs:    %s\n", j["cuda"]["compiled"].get<bool>() ? j["cuda"]["archs"].get<std::string>().c_str()
                                                                           : "(not compiled)");
  if (j["cuda"].contains("moe_status")) {
    std::printf("cuda moe:      %s\n", j["cuda"]["moe_status"].get<std::string>().c_str());
    std::printf("cuda moe paths: %s\n", j["cuda"]["moe_paths"].get<std::string>().c_str());
    std::printf("cuda kda:      %s\n", j["cuda"]["kda_status"].get<std::string>().c_str());
    std::printf("cuda sm120:    %s\n", j["cuda"]["sm120_blockscaled_gemm"].get<std::string>().c_str());
  }
  std::printf("cpu:           %s (%s), %d logical CPUs\n", j["cpu"]["model"].get<std::string>().c_str(),
              j["cpu"]["vendor"].get<std::string>().c_str(), j["cpu"]["logical_cpus"].get<int>());
  std::string feats;
  for (const auto& [name, on] : j["cpu"]["features"].items()) feats += "  " + name + (on.get<bool>() ? "+" : "-");
  std::printf("simd:         %s\n", feats.c_str());
  std::printf("threads:       %d (K3_NUM_THREADS / OMP_NUM_THREADS override)\n", j["threads"].get<int>());
  const std::string thp = j["huge_pages"].get<std::string>();
  std::printf("huge pages:    transparent huge pages '%s'%s\n", thp.c_str(),
              thp == "always" || thp == "madvise" ? " (packed weights use 2 MiB pages)"
                                                  : " (packed weights stay on 4 KiB pages)");
  for (const auto& [name, what] : j["transports"].items()) {
    std::printf("transport %-4s %s\n", (name + ":").c_str(), what.get<std::string>().c_str());
  }
  if (j["cuda"]["devices"].empty()) {
    std::printf("cuda devices:  none (%s)\n", j["cuda"].value("devices_note", std::string("none found")).c_str());
  } else {
    for (const auto& d : j["cuda"]["devices"]) {
      std::printf("cuda device %d: %s, sm_%s, %d SMs, %.1f GiB%s\n", d["index"].get<int>(),
                  d["name"].get<std::string>().c_str(), d["compute_capability"].get<std::string>().c_str(),
                  d["sm_count"].get<int>(), static_cast<double>(d["total_memory_bytes"].get<int64_t>()) / (1 << 30),
                  d["runnable"].get<bool>() ? "" : " (no compiled architecture runs on it)");
    }
  }
}

const CommandRegistration kRegistration("info", 0, [](CLI::App& app) -> CommandRun {
  auto* cmd = app.add_subcommand("info", "Show version, build, backends, CPU features and CUDA devices");
  auto json = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json, "Machine-readable output");
  return [json]() {
    const auto j = info_json();
    if (*json) std::cout << j.dump(2) << "\n";
    else print_text(j);
    return Status::ok();
  };
});

}  // namespace
}  // namespace k3::tool
