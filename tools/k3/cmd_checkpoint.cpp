// `k3 checkpoint synth|inspect`: write a seeded synthetic Kimi-K3 checkpoint (k3/harness/checkpoint_synth.hpp)
// and list the tensors of any safetensors checkpoint (checkpoint_inspect.cpp).
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "checkpoint_cli.hpp"
#include "command.hpp"
#include "k3/harness/checkpoint_synth.hpp"
#include "k3/moe.hpp"

namespace k3::tool {

namespace {
constexpr int64_t kMaxListValue = (1 << 24) - 1;  // largest id in a list such as --layers
constexpr int64_t kMaxListRange = 4096;           // most values one a-b range may expand to
}  // namespace

Result<std::vector<int>> parse_int_list(const std::string& s, const char* option) {
  std::vector<int> out;
  const auto bad = [&] {
    return invalid_argument(std::string(option) + " '" + s + "' must be a comma-separated list of integers or a-b ranges");
  };
  size_t i = 0;
  std::string too_big;  // the number that exceeded kMaxListValue
  auto read_int = [&](int* v) {
    const size_t start = i;
    int64_t x = 0;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])) && x <= kMaxListValue) x = x * 10 + (s[i++] - '0');
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;  // the rest of a huge number
    *v = static_cast<int>(std::min<int64_t>(x, kMaxListValue));
    if (x > kMaxListValue) too_big = s.substr(start, i - start);
    return i > start && x <= kMaxListValue;
  };
  while (i < s.size()) {
    int a = 0, b = 0;
    const size_t start = i;
    if (!read_int(&a)) {
      if (!too_big.empty()) {
        return invalid_argument(std::string(option) + " '" + s + "': " + too_big + " is above the limit of " +
                                std::to_string(kMaxListValue));
      }
      return bad();
    }
    b = a;
    if (i < s.size() && s[i] == '-') {
      ++i;
      if (!read_int(&b)) {
        if (!too_big.empty()) {
          return invalid_argument(std::string(option) + " '" + s + "': " + too_big + " is above the limit of " +
                                  std::to_string(kMaxListValue));
        }
        return bad();
      }
      if (b < a) return bad();
      if (b - a + 1 > kMaxListRange) {
        return invalid_argument(std::string(option) + " '" + s + "': the range " + s.substr(start, i - start) +
                                " is too large (" + std::to_string(int64_t{b} - a + 1) + " values, limit " +
                                std::to_string(kMaxListRange) + " per range)");
      }
    }
    for (int v = a; v <= b; ++v) out.push_back(v);
    if (i < s.size()) {
      if (s[i] != ',') return bad();
      ++i;
      if (i == s.size()) return bad();
    }
  }
  if (out.empty()) return bad();
  return out;
}

Result<std::pair<int, int>> parse_range(const std::string& s, const char* option) {
  const auto colon = s.find(':');
  const auto bad = [&] { return invalid_argument(std::string(option) + " '" + s + "' must be BEGIN:END (end exclusive)"); };
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) return bad();
  int v[2] = {0, 0};
  const std::string parts[2] = {s.substr(0, colon), s.substr(colon + 1)};
  for (int p = 0; p < 2; ++p) {
    if (parts[p].size() > 7) return bad();
    for (const char c : parts[p]) {
      if (!std::isdigit(static_cast<unsigned char>(c))) return bad();
      v[p] = v[p] * 10 + (c - '0');
    }
  }
  return std::pair<int, int>{v[0], v[1]};
}

Result<int64_t> parse_byte_size(const std::string& s, const char* option) {
  size_t i = 0;
  int64_t n = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])) && n < (int64_t{1} << 40)) n = n * 10 + (s[i++] - '0');
  std::string unit = s.substr(i);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (!unit.empty() && unit.back() == 'B') unit.pop_back();
  int64_t mult = 0;
  if (unit.empty()) mult = 1;
  else if (unit == "K") mult = 1000;
  else if (unit == "M") mult = 1000 * 1000;
  else if (unit == "G") mult = 1000 * 1000 * 1000;
  else if (unit == "KI") mult = int64_t{1} << 10;
  else if (unit == "MI") mult = int64_t{1} << 20;
  else if (unit == "GI") mult = int64_t{1} << 30;
  if (i == 0 || mult == 0 || n >= (int64_t{1} << 40)) {
    return invalid_argument(std::string(option) + " '" + s + "' must be a byte count like 5GB, 500MB, 2GiB or 1048576");
  }
  return n * mult;
}

std::string human_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

namespace {

struct SynthArgs {
  SynthOptions o;
  std::string layers = "1";
  std::string experts;
  std::string shard_size;
  int ep_size = 0, ep_rank = -1;
  bool no_router = false;
};

Status run_synth(SynthArgs a) {
  auto layers = parse_int_list(a.layers, "--layers");
  if (!layers) return layers.status();
  a.o.layers = layers.value();
  if (!a.experts.empty()) {
    auto r = parse_range(a.experts, "--experts");
    if (!r) return r.status();
    a.o.expert_begin = r->first;
    a.o.expert_end = r->second;
  } else if (a.ep_size > 0) {
    if (a.ep_size > a.o.num_experts || a.ep_rank < 0 || a.ep_rank >= a.ep_size) {
      return invalid_argument("--ep-size " + std::to_string(a.ep_size) + " --ep-rank " + std::to_string(a.ep_rank) +
                              ": ep-size must be at most --num-experts " + std::to_string(a.o.num_experts) +
                              " and ep-rank be in [0, ep-size)");
    }
    const ExpertRange own = expert_range(a.o.num_experts, a.ep_size, a.ep_rank);  // docs/distributed.md
    a.o.expert_begin = own.first;
    a.o.expert_end = own.first + own.count;
  } else if (a.ep_rank >= 0) {
    return invalid_argument("--ep-rank needs --ep-size");
  }
  if (!a.shard_size.empty()) {
    auto s = parse_byte_size(a.shard_size, "--shard-size");
    if (!s) return s.status();
    a.o.shard_size = s.value();
  }
  a.o.router = !a.no_router;
  K3_RETURN_IF_ERROR(validate_synth_options(a.o));

  // Bytes to write, checked against the free space first (a full Kimi-K3 layer is 15.7 GB).
  const int end = a.o.expert_end < 0 ? a.o.num_experts : a.o.expert_end;
  const int64_t nk = a.o.expert_hidden * a.o.intermediate;
  const int64_t per_expert = 3 * (nk / 2 + nk / 32);
  const int64_t router = a.o.router ? a.o.num_experts * (a.o.hidden_size + 1) * 2 : 0;
  const int64_t total = static_cast<int64_t>(a.o.layers.size()) * ((end - a.o.expert_begin) * per_expert + router);
  std::error_code ec;
  std::filesystem::path probe(a.o.output_dir);
  while (!probe.empty() && !std::filesystem::exists(probe, ec)) probe = probe.parent_path();
  const auto space = std::filesystem::space(probe.empty() ? std::filesystem::path(".") : probe, ec);
  if (!ec && static_cast<int64_t>(space.available) < total + (int64_t{64} << 20)) {
    return io_error(a.o.output_dir + ": needs " + human_bytes(total) + " but only " +
                    human_bytes(static_cast<int64_t>(space.available)) +
                    " are free; store fewer experts (--experts / --ep-size --ep-rank) or layers");
  }
  std::printf("writing %s: layers %s, experts [%d, %d) of %d, K %lld, N %lld, seed %llu, %s\n",
              a.o.output_dir.c_str(), a.layers.c_str(), a.o.expert_begin, end, a.o.num_experts,
              static_cast<long long>(a.o.expert_hidden), static_cast<long long>(a.o.intermediate),
              static_cast<unsigned long long>(a.o.seed), human_bytes(total).c_str());
  std::fflush(stdout);
  auto r = write_synthetic_checkpoint(a.o);
  if (!r) return r.status();
  for (const auto& f : r->files) std::printf("  %s\n", f.c_str());
  for (const auto& f : r->removed) std::printf("  removed the stale %s (it would have hidden model.safetensors)\n", f.c_str());
  if (!r->kept.empty()) {
    std::string names;
    for (const auto& f : r->kept) names += (names.empty() ? "" : ", ") + f;
    std::printf("note: left in place, not written by this run: %s%s\n", names.c_str(),
                a.o.shard_size > 0 ? " (readers follow model.safetensors.index.json)"
                                   : " (without an index, readers open every *.safetensors in the folder)");
  }
  std::printf("wrote %lld tensors, %s of tensor data\n", static_cast<long long>(r->tensors), human_bytes(r->bytes).c_str());
  return Status::ok();
}

const CommandRegistration kRegistration("checkpoint", 30, [](CLI::App& app) -> CommandRun {
  auto* cmd = app.add_subcommand("checkpoint", "Synthesize or inspect Kimi-K3 safetensors checkpoints");
  cmd->require_subcommand(1);

  auto* synth = cmd->add_subcommand("synth", "Write a seeded synthetic checkpoint in the Kimi-K3 format");
  auto s = std::make_shared<SynthArgs>();
  synth->add_option("--output,-o", s->o.output_dir, "Checkpoint directory to write")->required();
  synth->add_option("--layers", s->layers, "MoE layers, e.g. 1,2 or 1-4")->capture_default_str();
  auto* experts = synth->add_option("--experts", s->experts, "Global experts BEGIN:END to store (default: all)");
  auto* ep_size = synth->add_option("--ep-size", s->ep_size, "Store the experts of one EP rank: EP size");
  synth->add_option("--ep-rank", s->ep_rank, "... and rank (with --ep-size)");
  experts->excludes(ep_size);
  synth->add_option("--hidden", s->o.hidden_size, "hidden_size (router width)")->capture_default_str();
  synth->add_option("--expert-hidden", s->o.expert_hidden, "K: routed_expert_hidden_size")->capture_default_str();
  synth->add_option("--intermediate", s->o.intermediate, "N: moe_intermediate_size")->capture_default_str();
  synth->add_option("--num-experts", s->o.num_experts, "Routed experts E")->capture_default_str();
  synth->add_option("--top-k", s->o.top_k, "Experts per token")->capture_default_str();
  synth->add_option("--num-layers", s->o.num_hidden_layers, "num_hidden_layers")->capture_default_str();
  synth->add_option("--activation", s->o.activation, "hidden_act: situ, silu or swiglu")->capture_default_str();
  synth->add_option("--seed", s->o.seed, "Seed of the weights")->capture_default_str();
  synth->add_option("--shard-size", s->shard_size, "Max bytes per shard (e.g. 5GB): writes model.safetensors.index.json");
  synth->add_flag("--no-router", s->no_router, "Leave out gate.weight and e_score_correction_bias");
  synth->add_flag("--force", s->o.overwrite, "Replace a checkpoint already in --output");

  auto* inspect = cmd->add_subcommand("inspect", "List tensors, dtypes, shapes and sizes of a checkpoint");
  auto i = std::make_shared<InspectArgs>();
  inspect->add_option("path", i->path, "Checkpoint directory or .safetensors file")->required();
  inspect->add_flag("--json", i->json, "Machine-readable output");
  inspect->add_flag("--summary", i->summary, "Text: only the totals and the MoE layers, not every tensor");
  inspect->add_option("--layer", i->layer, "Also load this MoE layer as a backend would (checks every tensor)");
  inspect->add_option("--ep-size", i->ep_size, "EP size for --layer")->capture_default_str();
  inspect->add_option("--ep-rank", i->ep_rank, "EP rank for --layer")->capture_default_str();

  return [synth, inspect, s, i]() {
    return run_parsed({{synth, [s] { return run_synth(*s); }}, {inspect, [i] { return run_inspect(*i); }}});
  };
});

}  // namespace
}  // namespace k3::tool
