// `k3 generate`: the native runner (k3/model.hpp) on a checkpoint directory. Token ids in (the
// prompt) and out (stdout, one line, comma-separated); progress and timings on stderr.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "k3/harness/atomic_file.hpp"
#include "k3/harness/limits.hpp"
#include "k3/model.hpp"
#include "k3/moe.hpp"
#include "k3/system.hpp"
#include "backend_options.hpp"
#include "command.hpp"

namespace k3::tool {
namespace {

struct GenerateArgs {
  std::string checkpoint;
  std::string prompt_ids;
  int64_t max_new_tokens = 16;
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
  std::string trunk = "mxfp8";
  std::string experts = "w4a16";
  int threads = 0;
  std::string isa;
  int64_t max_context = 4096;
  int64_t max_batch_tokens = 512;
  int batch = 1;
  bool ignore_eos = false;
  bool bandwidth = false;
  bool quiet = false;
  std::string json;
};

Result<std::vector<int32_t>> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::string item;
  std::stringstream in(text);
  while (std::getline(in, item, ',')) {
    const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b == std::string::npos) return invalid_argument("--prompt-ids: an empty entry in \"" + text + "\"");
    const std::string s = item.substr(b, e - b + 1);
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(s, &used);
    } catch (...) {
      used = 0;
    }
    if (used != s.size() || v < 0 || v > (int64_t{1} << 31) - 1) {
      return invalid_argument("--prompt-ids: \"" + s + "\" is not a token id (a non-negative integer)");
    }
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) return invalid_argument("--prompt-ids: at least one token id is needed (e.g. --prompt-ids 1,2,3)");
  return ids;
}

Status run(const GenerateArgs& a) {
  K3_ASSIGN_OR_RETURN(auto prompt, parse_ids(a.prompt_ids));
  ModelOptions o;
  o.threads = a.threads > 0 ? a.threads : env_thread_count();
  if (!a.isa.empty()) {
    K3_ASSIGN_OR_RETURN(IsaLevel l, parse_isa_level(a.isa));
    o.isa = l;
  } else {
    o.isa = env_isa_level();
  }
  K3_ASSIGN_OR_RETURN(o.trunk, parse_trunk_format(a.trunk));
  if (a.experts == "w4a16") {
    o.experts = Recipe::kW4A16;
  } else if (a.experts == "w4a8") {
    o.experts = Recipe::kW4A8;
  } else {
    return invalid_argument("--experts \"" + a.experts + "\" is not one of: w4a16, w4a8");
  }
  o.max_seqs = a.batch;
  o.max_context = a.max_context;
  o.max_batch_tokens = a.max_batch_tokens;
  if (!a.quiet) o.progress = [](const std::string& s) { std::fprintf(stderr, "%s\n", s.c_str()); };
  SamplingOptions so;
  so.temperature = a.temperature;
  so.top_k = a.top_k;
  so.top_p = a.top_p;
  so.seed = a.seed;
  K3_RETURN_IF_ERROR(Sampler::check(so));
  K3_ASSIGN_OR_RETURN(auto model, Model::load(a.checkpoint, o));
  const ModelInfo& info = model->info();
  if (!a.quiet) std::fprintf(stderr, "%s", info.describe().c_str());
  std::vector<int32_t> stop = a.ignore_eos ? std::vector<int32_t>{} : info.config.eos_token_ids;

  std::vector<std::vector<int32_t>> outs;
  GenerateTimings tm;
  double step_ms_batch = 0;
  if (a.batch == 1) {
    K3_ASSIGN_OR_RETURN(auto ids, model->generate(0, prompt, a.max_new_tokens, so, stop, &tm));
    outs.push_back(std::move(ids));
  } else {
    // B copies of the prompt as one batch: prefill each, then decode all B in one forward per step.
    const int64_t v = model->vocab_size();
    std::vector<float> logits(static_cast<size_t>(v) * static_cast<size_t>(a.batch));
    std::vector<Sampler> samplers;
    for (int b = 0; b < a.batch; ++b) {
      SamplingOptions sb = so;
      sb.seed = so.seed + static_cast<uint64_t>(b);
      samplers.emplace_back(sb);
    }
    if (prompt.size() + static_cast<size_t>(std::max<int64_t>(a.max_new_tokens - 1, 0)) >
        static_cast<size_t>(a.max_context)) {
      return out_of_range("prompt (" + std::to_string(prompt.size()) + " tokens) + --max-new-tokens " +
                          std::to_string(a.max_new_tokens) + " exceed --max-context " + std::to_string(a.max_context));
    }
    outs.assign(static_cast<size_t>(a.batch), {});
    std::vector<int32_t> next(static_cast<size_t>(a.batch)), slots(static_cast<size_t>(a.batch));
    const auto t0 = std::chrono::steady_clock::now();
    for (int b = 0; b < a.batch; ++b) {
      slots[static_cast<size_t>(b)] = b;
      K3_RETURN_IF_ERROR(model->reset(b));
      for (size_t at = 0; at < prompt.size(); at += static_cast<size_t>(a.max_batch_tokens)) {
        const size_t n = std::min(prompt.size() - at, static_cast<size_t>(a.max_batch_tokens));
        K3_RETURN_IF_ERROR(model->forward(std::span<const int32_t>(prompt).subspan(at, n), {},
                                          std::span<const int32_t>(&slots[static_cast<size_t>(b)], 1), false,
                                          std::span<float>(logits).subspan(static_cast<size_t>(b) * v, v)));
      }
    }
    const auto t1 = std::chrono::steady_clock::now();
    std::vector<int64_t> cu(static_cast<size_t>(a.batch) + 1);
    for (int b = 0; b <= a.batch; ++b) cu[static_cast<size_t>(b)] = b;
    int64_t steps = 0;
    for (int64_t i = 0; i < a.max_new_tokens; ++i) {
      for (int b = 0; b < a.batch; ++b) {
        K3_ASSIGN_OR_RETURN(next[static_cast<size_t>(b)],
                            samplers[static_cast<size_t>(b)].sample(std::span<const float>(logits).subspan(static_cast<size_t>(b) * v, v)));
        outs[static_cast<size_t>(b)].push_back(next[static_cast<size_t>(b)]);
      }
      if (i + 1 == a.max_new_tokens) break;
      K3_RETURN_IF_ERROR(model->forward(next, cu, slots, false, logits));
      ++steps;
    }
    const auto t2 = std::chrono::steady_clock::now();
    tm.prompt_tokens = static_cast<int64_t>(prompt.size()) * a.batch;
    tm.new_tokens = static_cast<int64_t>(outs[0].size()) * a.batch;
    tm.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
    tm.decode_seconds = std::chrono::duration<double>(t2 - t1).count();
    step_ms_batch = steps > 0 ? tm.decode_seconds * 1e3 / static_cast<double>(steps) : 0;
  }
  for (const auto& ids : outs) {
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? "," : "", ids[i]);
    std::printf("\n");
  }
  std::fflush(stdout);

  const int64_t decode_steps = a.batch == 1 ? std::max<int64_t>(tm.new_tokens - 1, 0) : 0;
  const double step_ms = a.batch == 1 ? (decode_steps > 0 ? tm.decode_seconds * 1e3 / static_cast<double>(decode_steps) : 0)
                                      : step_ms_batch;
  double bw = 0;
  if (a.bandwidth) bw = ReadBandwidthProbe(info.threads, int64_t{1} << 30).measure(3);
  const double bw_ms = bw > 0 ? static_cast<double>(info.step_bytes) / bw * 1e3 : 0;
  std::fprintf(stderr,
               "k3 generate: prompt %lld tokens, prefill %.1f ms (%.1f tokens/s); %lld new tokens, decode %.2f ms/step "
               "(%.1f tokens/s%s)\n",
               static_cast<long long>(tm.prompt_tokens), tm.prefill_seconds * 1e3,
               tm.prefill_seconds > 0 ? static_cast<double>(tm.prompt_tokens) / tm.prefill_seconds : 0.0,
               static_cast<long long>(tm.new_tokens), step_ms,
               step_ms > 0 ? 1e3 * a.batch / step_ms : 0.0, a.batch > 1 ? ", all sequences" : "");
  if (bw > 0) {
    std::fprintf(stderr,
                 "k3 generate: one step reads %.1f MiB; at the read bandwidth measured after the run (%.1f GB/s) that is "
                 "%.2f ms: the step takes %.2fx the bandwidth time\n",
                 static_cast<double>(info.step_bytes) / (1 << 20), bw / 1e9, bw_ms, bw_ms > 0 ? step_ms / bw_ms : 0.0);
  }
  if (!a.json.empty()) {
    nlohmann::json j;
    j["checkpoint"] = info.directory;
    j["prompt_ids"] = prompt;
    j["output_ids"] = outs;
    j["trunk"] = trunk_format_name(info.trunk);
    j["experts"] = recipe_name(info.experts);
    j["threads"] = info.threads;
    j["isa"] = isa_level_name(info.isa);
    j["cpu"] = cpu_info().model;
    j["batch"] = a.batch;
    j["prefill_seconds"] = tm.prefill_seconds;
    j["decode_ms_per_step"] = step_ms;
    j["step_bytes"] = info.step_bytes;
    j["packed_bytes"] = info.packed_bytes;
    j["peak_rss_bytes"] = info.peak_rss_bytes;
    j["load_seconds"] = info.load_seconds;
    if (bw > 0) {
      j["read_bandwidth_bytes_per_s"] = bw;
      j["step_over_bandwidth_time"] = step_ms / bw_ms;
    }
    K3_RETURN_IF_ERROR(write_file_atomic(a.json, j.dump(2) + "\n", "--json"));
  }
  return Status::ok();
}

const CommandRegistration kRegistration("generate", 35, [](CLI::App& app) -> CommandRun {
  auto* cmd = app.add_subcommand("generate", "Run a Kimi-Linear checkpoint end to end on the native runner");
  auto a = std::make_shared<GenerateArgs>();
  cmd->add_option("--checkpoint", a->checkpoint, "Checkpoint directory (config.json + safetensors shards)")->required();
  cmd->add_option("--prompt-ids", a->prompt_ids, "Prompt token ids, comma-separated (e.g. 1,2,3)")->required();
  cmd->add_option("--max-new-tokens", a->max_new_tokens, "Tokens to generate")->capture_default_str()
      ->check(CLI::Range(int64_t{0}, kModelMaxContext));
  cmd->add_option("--temperature", a->temperature, "0: greedy")->capture_default_str();
  cmd->add_option("--top-k", a->top_k, "0: no top-k cut")->capture_default_str();
  cmd->add_option("--top-p", a->top_p, "1: no nucleus cut")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Sampler seed (sequence b of a batch uses seed + b)")->capture_default_str();
  cmd->add_option("--trunk", a->trunk, "Projections: mxfp8 (W8A16) or bf16 (W16A16)")->capture_default_str();
  cmd->add_option("--experts", a->experts, "Routed experts (MXFP4): w4a16 or w4a8 activations")->capture_default_str();
  cmd->add_option("--threads", a->threads, "CPU threads (default: K3_NUM_THREADS or all CPUs)")
      ->check(CLI::Range(0, k3::kMaxThreadCount));
  cmd->add_option("--isa", a->isa, "CPU kernel level: scalar | avx2 | avx512 | avx512bf16 (default: K3_ISA or the best)");
  cmd->add_option("--max-context", a->max_context, "Tokens of state per sequence (prompt + generated)")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, kModelMaxContext));
  cmd->add_option("--max-batch-tokens", a->max_batch_tokens, "Tokens per forward call (the prefill piece)")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{65536}));
  cmd->add_option("--batch", a->batch, "Decode B copies of the prompt together (one weight pass per step)")
      ->capture_default_str()->check(CLI::Range(1, kModelMaxSeqs));
  cmd->add_flag("--ignore-eos", a->ignore_eos, "Do not stop at the config's eos_token_id");
  cmd->add_flag("--bandwidth", a->bandwidth, "Probe the read bandwidth after the run and report the step against it");
  cmd->add_flag("--quiet", a->quiet, "No progress lines");
  cmd->add_option("--json", a->json, "Write the ids, timings and sizes to this JSON file");
  return [a]() { return run(*a); };
});

}  // namespace
}  // namespace k3::tool
