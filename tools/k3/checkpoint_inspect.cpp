// `k3 checkpoint inspect PATH [--json] [--summary]`: every tensor (name, dtype, shape, bytes,
// file), the totals, the MoE layers with the experts they hold, and the config.json facts.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "checkpoint_cli.hpp"
#include "k3/harness/ep_flags.hpp"
#include "k3/checkpoint.hpp"
#include "k3/safetensors.hpp"

namespace k3::tool {

namespace {

struct Row {
  std::string name, dtype, shape, file;
  std::vector<int64_t> dims;
  int64_t bytes;
  int64_t begin;  // data offset in its file
};

struct MoeLayerSummary {
  std::map<int, int> expert_tensors;  // expert -> how many of its 6 tensors are present
  bool router_weight = false, router_bias = false;
};

// Counts a tensor toward its MoE layer's summary (the library's parser of the Kimi names).
void classify(const std::string& name, std::map<int, MoeLayerSummary>* layers) {
  const auto t = parse_kimi_moe_tensor_name(name);
  if (!t) return;
  MoeLayerSummary& l = (*layers)[t->layer];
  switch (t->kind) {
    case KimiMoeTensor::Kind::kRouterWeight: l.router_weight = true; break;
    case KimiMoeTensor::Kind::kRouterBias: l.router_bias = true; break;
    case KimiMoeTensor::Kind::kExpert: ++l.expert_tensors[t->expert]; break;
  }
}

nlohmann::json config_json(const MoeModelConfig& c) {
  return {{"source", c.source},
          {"model_type", c.model_type},
          {"hidden_size", c.hidden_size},
          {"expert_hidden", c.expert_hidden},
          {"intermediate", c.intermediate},
          {"num_experts", c.num_experts},
          {"top_k", c.top_k},
          {"n_group", c.n_group},
          {"topk_group", c.topk_group},
          {"renormalize", c.renormalize},
          {"routed_scaling_factor", c.routed_scaling_factor},
          {"scoring_func", c.scoring_func},
          {"hidden_act", c.hidden_act},
          {"situ_beta", c.situ_beta},
          {"situ_linear_beta", c.situ_linear_beta},
          {"num_hidden_layers", c.num_hidden_layers},
          {"first_k_dense_replace", c.first_k_dense_replace},
          {"quant_format", c.quant_format},
          {"quant_group_size", c.quant_group_size}};
}

// --layer: the error of loading the layer for the rank, with what was loaded.
Status load_failure(const InspectArgs& a, const Status& load) {
  if (load.is_ok()) return load;
  return Status(load.code(), "loading layer " + std::to_string(a.layer) + " for EP rank " + std::to_string(a.ep_rank) +
                                 " of " + std::to_string(a.ep_size) + ": " + load.message());
}

}  // namespace

Status run_inspect(const InspectArgs& a) {
  auto ck = st::Checkpoint::open(a.path);
  if (!ck) return ck.status();
  // Every tensor, listed by shard file and, within a file, in data order.
  std::vector<Row> rows;
  for (const auto& name : ck->tensor_names()) {
    auto hit = ck->find(name);
    if (!hit) return hit.status();
    const auto* t = hit->second;
    rows.push_back({t->name, st::dtype_name(t->dtype), st::shape_string(t->shape),
                    std::filesystem::path(hit->first->path()).filename().string(), t->shape, t->nbytes(), t->begin});
  }
  std::sort(rows.begin(), rows.end(), [](const Row& x, const Row& y) {
    return x.file != y.file ? x.file < y.file : x.begin < y.begin;
  });
  int64_t total = 0;
  std::map<std::string, int64_t> file_bytes;
  std::map<int, MoeLayerSummary> layers;
  for (const auto& r : rows) {
    total += r.bytes;
    file_bytes[r.file] += r.bytes;
    classify(r.name, &layers);
  }
  auto cfg = load_model_config(ck->directory());
  // Optional: load one layer for one EP rank exactly as `k3 validate --checkpoint` / `k3 moe run` do.
  nlohmann::json load = nullptr;
  std::string load_error;
  Status load_status;
  if (a.layer >= 0) {
    const Status ep = check_ep_flags(a.ep_size, a.ep_rank, a.path);
    auto w = ep.is_ok() ? load_moe_layer(a.path, a.layer, a.ep_size, a.ep_rank) : Result<MoeLayerWeights>(ep);
    if (!w) {
      load_error = w.status().message();
      load_status = w.status();
    } else {
      load = {{"layer", a.layer},
              {"ep_size", a.ep_size},
              {"ep_rank", a.ep_rank},
              {"local_experts", w->shape.local_experts()},
              {"first_expert", w->shape.first_local_expert()},
              {"fc1_bytes", w->fc1_q.size() + w->fc1_scale.size()},
              {"fc2_bytes", w->fc2_q.size() + w->fc2_scale.size()},
              {"router_weight", !w->router_weight.empty()},
              {"router_bias", !w->router_bias.empty()}};
    }
  }

  if (a.json) {
    nlohmann::json j;
    j["path"] = a.path;
    j["directory"] = ck->directory();
    j["files"] = nlohmann::json::array();
    for (const auto& [f, b] : file_bytes) j["files"].push_back({{"file", f}, {"bytes", b}});
    j["tensors"] = nlohmann::json::array();
    for (const auto& r : rows) {
      j["tensors"].push_back({{"name", r.name}, {"dtype", r.dtype}, {"shape", r.dims}, {"bytes", r.bytes}, {"file", r.file}});
    }
    j["num_tensors"] = rows.size();
    j["total_bytes"] = total;
    j["moe_layers"] = nlohmann::json::object();
    for (const auto& [layer, s] : layers) {
      std::vector<int> complete, partial;
      for (const auto& [e, n] : s.expert_tensors) (n == 6 ? complete : partial).push_back(e);
      j["moe_layers"][std::to_string(layer)] = {{"experts", format_id_ranges(complete, 1 << 20)},
                                                {"num_experts", complete.size()},
                                                {"incomplete_experts", format_id_ranges(partial, 1 << 20)},
                                                {"router_weight", s.router_weight},
                                                {"router_bias", s.router_bias}};
    }
    if (cfg) j["config"] = config_json(cfg.value());
    else j["config_error"] = cfg.status().message();
    if (a.layer >= 0) {
      if (load_error.empty()) j["load"] = load;
      else j["load_error"] = load_error;
    }
    std::cout << j.dump(2) << "\n";
    return load_failure(a, load_status);
  }

  if (!a.summary) {
    // Names and file names come from the files: control characters are printed as \xNN, never
    // raw (they could move the cursor, clear the screen or fake other rows).
    size_t w = 4;
    std::vector<std::string> names;
    names.reserve(rows.size());
    for (const auto& r : rows) {
      names.push_back(st::printable_name(r.name));
      w = std::max(w, names.back().size());
    }
    std::printf("%-*s  %-7s  %-14s  %12s  %s\n", static_cast<int>(w), "name", "dtype", "shape", "bytes", "file");
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      std::printf("%-*s  %-7s  %-14s  %12lld  %s\n", static_cast<int>(w), names[i].c_str(), r.dtype.c_str(),
                  r.shape.c_str(), static_cast<long long>(r.bytes), st::printable_name(r.file).c_str());
    }
    std::printf("\n");
  }
  std::printf("total: %zu tensors, %lld bytes (%s) in %zu file%s\n", rows.size(), static_cast<long long>(total),
              human_bytes(total).c_str(), file_bytes.size(), file_bytes.size() == 1 ? "" : "s");
  for (const auto& [layer, s] : layers) {
    std::vector<int> complete, partial;
    for (const auto& [e, n] : s.expert_tensors) (n == 6 ? complete : partial).push_back(e);
    std::printf("moe layer %d: %zu experts (%s)%s%s, router %s\n", layer, complete.size(),
                complete.empty() ? "none" : format_id_ranges(complete).c_str(),
                partial.empty() ? "" : ", incomplete experts ", partial.empty() ? "" : format_id_ranges(partial).c_str(),
                s.router_weight && s.router_bias ? "weight + bias" : (s.router_weight ? "weight only" : "absent"));
  }
  if (cfg) {
    const auto& c = cfg.value();
    std::printf("config: %s, hidden %lld, experts K %lld x N %lld, E %d, top-%d, %s routing, act %s, %s\n",
                st::printable_name(c.model_type).c_str(), static_cast<long long>(c.hidden_size),
                static_cast<long long>(c.expert_hidden), static_cast<long long>(c.intermediate), c.num_experts, c.top_k,
                st::printable_name(c.scoring_func).c_str(), st::printable_name(c.hidden_act).c_str(),
                c.quant_format.empty() ? "unquantized" : st::printable_name(c.quant_format).c_str());
  } else {
    std::printf("config: %s\n", cfg.status().message().c_str());
  }
  if (a.layer >= 0) {
    K3_RETURN_IF_ERROR(load_failure(a, load_status));
    std::printf("loaded layer %d for EP rank %d of %d: experts [%d, %d), FC1 %s, FC2 %s, router %s\n", a.layer,
                a.ep_rank, a.ep_size, load["first_expert"].get<int>(),
                load["first_expert"].get<int>() + load["local_experts"].get<int>(),
                human_bytes(load["fc1_bytes"].get<int64_t>()).c_str(), human_bytes(load["fc2_bytes"].get<int64_t>()).c_str(),
                load["router_weight"].get<bool>() ? (load["router_bias"].get<bool>() ? "weight + bias" : "weight only")
                                                  : "absent");
  }
  return Status::ok();
}

}  // namespace k3::tool
