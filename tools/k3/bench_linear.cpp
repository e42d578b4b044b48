// `k3 bench linear`: the dense linear layer (MXFP8 or BF16 weights) at the seed's and
// Kimi-Linear's shapes, for an M sweep. Small M is reported against the read bandwidth (the
// weights stream once per call: N K (1 + 1/32) bytes, W16A16 2 N K), large M against the level's
// dot / FMA peak, both measured in the same run. Weights are rotated over several prepacked
// copies (at least --pool-mib) so that decode reads them from memory, not from the last-level
// cache. Rounds interleave the cases so that drift spreads over all of them. torch's BF16
// F.linear runs side by side when a Python with torch is found (--torch-python, default python3):
// one child process per round, after k3's round, on the same shapes, M, threads and weight
// rotation; its times go next to k3's.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <tuple>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/cpu_linear.hpp"
#include "k3/formats.hpp"
#include "k3/system.hpp"

namespace k3::tool {
namespace {

struct Args {
  int threads = 0;
  std::string isa;
  std::vector<std::string> shapes = {"1536x7168", "7168x3584", "3584x7168", "2304x4096", "4096x2304"};
  std::vector<std::string> recipes = {"w8a16", "w8a8"};
  std::vector<int64_t> m = {1, 2, 4, 8, 32, 256, 1024};
  int iters = 10;
  int rounds = 3;
  int64_t pool_mib = 256;
  int64_t bw_mib = 512;
  std::string output;
  std::string torch_python = "python3";  // "" or "off": no torch baseline
};

// The torch side (run by --torch-python with one JSON argument): BF16 weights rotated over
// pool_mib of copies, F.linear(x, w, out=) timed per call; one JSON line per case.
constexpr const char* kTorchScript = R"PY(
import json, sys, time
a = json.loads(sys.argv[1])
import torch
torch.set_num_threads(a["threads"])
g = torch.Generator().manual_seed(7)
for k, n in a["shapes"]:
    w0 = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    ws = [w0] + [w0.clone() for _ in range(max(1, (a["pool_mib"] << 20) // (n * k * 2) + 1) - 1)]
    xa = torch.randn(max(a["m"]), k, generator=g).to(torch.bfloat16)
    for m in a["m"]:
        x, out = xa[:m].contiguous(), torch.empty(m, n, dtype=torch.bfloat16)
        iters = max(1, min(a["iters"], int(2e10 / (2 * m * n * k))))
        torch.nn.functional.linear(x, ws[0], out=out)
        t = []
        for i in range(iters):
            wi = ws[(i + 1) % len(ws)]
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, wi, out=out)
            t.append(time.perf_counter() - t0)
        print(json.dumps({"k": k, "n": n, "m": m, "times": t}), flush=True)
print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads()}), flush=True)
)PY";

// Runs argv (no shell; posix_spawnp, so the bench's gigabytes of weight copies are not forked);
// (exit status, stdout). Exit 127 when it cannot be started. quiet: the child's stderr goes to
// /dev/null (the torch probe: a missing torch is reported in one line, not as a traceback).
std::pair<int, std::string> run_capture(const std::vector<std::string>& argv, bool quiet = false) {
  int fd[2];
  if (pipe(fd) != 0) return {127, std::string("pipe: ") + std::strerror(errno)};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&fa, fd[0]);
  posix_spawn_file_actions_addclose(&fa, fd[1]);
  if (quiet) posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    close(fd[0]);
    close(fd[1]);
    return {127, std::string("spawn: ") + std::strerror(rc)};
  }
  close(fd[1]);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t r = read(fd[0], buf, sizeof buf);
    if (r > 0) out.append(buf, static_cast<size_t>(r));
    else if (r == 0 || errno != EINTR) break;
  }
  close(fd[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128, out};
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

Result<std::pair<int64_t, int64_t>> parse_shape(const std::string& s) {
  const auto x = s.find('x');
  try {
    if (x == std::string::npos) throw std::invalid_argument(s);
    size_t used = 0;
    const int64_t k = std::stoll(s.substr(0, x), &used);
    if (used != x) throw std::invalid_argument(s);
    const int64_t n = std::stoll(s.substr(x + 1), &used);
    if (used != s.size() - x - 1) throw std::invalid_argument(s);
    return std::make_pair(k, n);
  } catch (const std::exception&) {
    return invalid_argument("--shapes: '" + s + "' is not KxN (for example 1536x7168)");
  }
}

// Bytes of one layer's weights: 8 bits + one scale per 32 (MXFP8), or 16 bits (BF16).
int64_t weight_bytes(const LinearProblem& p) {
  return p.recipe == LinearRecipe::kW16A16 ? p.n * p.k * 2 : p.n * p.k * 33 / 32;
}

struct Layer {
  LinearProblem p;
  cpu::LinearPlan plan;
  std::vector<cpu::PackedLinear> copies;
  std::vector<uint8_t> ws;
};

Status run(const Args& a) {
  if (!a.output.empty()) K3_RETURN_IF_ERROR(check_output_path("--output", a.output));
  const int threads = a.threads > 0 ? a.threads : default_thread_count();
  auto isa = a.isa.empty() ? active_isa_level() : parse_isa_level(a.isa);
  if (!isa.is_ok()) return Status(isa.status().code(), (a.isa.empty() ? "" : "--isa: ") + isa.status().message());
  const int64_t max_m = *std::max_element(a.m.begin(), a.m.end());

  // Layers: one per (shape, recipe), each with enough copies to exceed the pool.
  std::vector<Layer> layers;
  std::mt19937 rng(7);
  for (const auto& s : a.shapes) {
    K3_ASSIGN_OR_RETURN(auto kn, parse_shape(s));
    for (const auto& r : a.recipes) {
      Layer l;
      l.p.k = kn.first;
      l.p.n = kn.second;
      auto rec = parse_linear_recipe(r);
      if (!rec.is_ok()) return invalid_argument("--recipes: " + rec.status().message());
      l.p.recipe = rec.value();
      l.p.out_dtype = OutDType::kBF16;
      K3_RETURN_IF_ERROR(validate_linear_problem(l.p));
      cpu::LinearOptions o;
      o.threads = threads;
      o.isa = isa.value();
      o.max_tokens = max_m;
      K3_ASSIGN_OR_RETURN(l.plan, cpu::plan(l.p, o));
      const bool b16 = l.p.recipe == LinearRecipe::kW16A16;
      std::vector<uint8_t> codes, scales;
      std::vector<uint16_t> wb;
      if (b16) {
        wb.resize(static_cast<size_t>(l.p.n * l.p.k));
        std::normal_distribution<float> wd(0.0f, 0.05f);
        for (auto& v : wb) v = bf16_from_f32(wd(rng));
      } else {
        codes.resize(static_cast<size_t>(l.p.n * l.p.k));
        scales.resize(static_cast<size_t>(l.p.n * l.p.k / 32));
        for (auto& c : codes) {
          do c = static_cast<uint8_t>(rng() & 0xFF);
          while ((c & 0x7F) == 0x7F);
        }
        for (auto& sc : scales) sc = static_cast<uint8_t>(118 + rng() % 12);
      }
      const LinearWeightsView w{codes, scales, {}, wb};
      const int64_t bytes = weight_bytes(l.p);
      const int64_t copies = std::max<int64_t>(1, (a.pool_mib << 20) / bytes + 1);
      for (int64_t c = 0; c < copies; ++c) {
        K3_ASSIGN_OR_RETURN(auto packed, cpu::prepack(l.plan, w));
        l.copies.push_back(std::move(packed));
      }
      l.ws.resize(static_cast<size_t>(l.plan.workspace_bytes));
      layers.push_back(std::move(l));
    }
  }

  const auto bw = measure_read_bandwidth(threads, a.bw_mib << 20);
  const auto peak = measure_dot_peak(threads, isa.value());
  std::printf("machine: %s, %d thread(s), isa %s\n", cpu_info().model.c_str(), threads, isa_level_name(isa.value()));
  std::printf("limits (same run): %s %.2f GB/s [%.2f, %.2f]; %s %.1f GFLOP/s [%.1f, %.1f]\n", bw.what.c_str(),
              bw.value / 1e9, bw.min / 1e9, bw.max / 1e9, peak.what.c_str(), peak.value / 1e9, peak.min / 1e9,
              peak.max / 1e9);
  print_probe_note(peak);
  // W16A16 runs FP32 FMAs on every level: on avx512bf16 its limit is the AVX-512 FP32 FMA peak.
  const bool fp32_peak_needed =
      isa.value() == IsaLevel::kAvx512Bf16 &&
      std::any_of(layers.begin(), layers.end(), [](const Layer& l) { return l.p.recipe == LinearRecipe::kW16A16; });
  const auto peak_fp32 = fp32_peak_needed ? measure_dot_peak(threads, IsaLevel::kAvx512) : peak;
  if (fp32_peak_needed) {
    std::printf("limit of w16a16 (FP32 FMA kernels): %s %.1f GFLOP/s [%.1f, %.1f]\n", peak_fp32.what.c_str(),
                peak_fp32.value / 1e9, peak_fp32.min / 1e9, peak_fp32.max / 1e9);
    print_probe_note(peak_fp32);
  }
  std::printf("%s\n\n", layers.front().plan.describe().c_str());

  // x for the largest M, shared (BF16 values of magnitude ~1).
  int64_t max_k = 0, max_n = 0;
  for (const auto& l : layers) max_k = std::max(max_k, l.p.k), max_n = std::max(max_n, l.p.n);
  std::vector<uint16_t> x(static_cast<size_t>(max_m * max_k));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : x) v = bf16_from_f32(nd(rng));
  std::vector<uint8_t> out(static_cast<size_t>(max_m * max_n * 2));

  // The torch baseline: is there a Python with torch? (A failed import is reported, not an error.)
  bool torch_on = !a.torch_python.empty() && a.torch_python != "off";
  std::string torch_note = "--torch-python off", torch_version, torch_args;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::vector<double>> torch_samples;
  if (torch_on) {
    nlohmann::json ta = {{"threads", threads}, {"pool_mib", a.pool_mib}, {"iters", a.iters}, {"m", a.m}};
    ta["shapes"] = nlohmann::json::array();
    std::vector<std::pair<int64_t, int64_t>> seen;
    for (const auto& l : layers) {
      const std::pair<int64_t, int64_t> kn{l.p.k, l.p.n};
      if (std::find(seen.begin(), seen.end(), kn) == seen.end()) seen.push_back(kn);
    }
    for (const auto& [k, n] : seen) ta["shapes"].push_back({k, n});
    torch_args = ta.dump();
    const auto probe = run_capture({a.torch_python, "-c", "import torch"}, /*quiet=*/true);
    if (probe.first != 0) {
      torch_on = false;
      torch_note = probe.first == 127 ? a.torch_python + " was not found"
                                      : a.torch_python + " cannot import torch";
    }
  }

  // samples[layer][m] over all rounds
  std::vector<std::vector<std::vector<double>>> samples(layers.size(), std::vector<std::vector<double>>(a.m.size()));
  const int total = a.rounds * static_cast<int>(layers.size() * a.m.size());
  int done = 0;
  for (int round = 0; round < a.rounds; ++round) {
    for (size_t li = 0; li < layers.size(); ++li) {
      Layer& l = layers[li];
      for (size_t mi = 0; mi < a.m.size(); ++mi) {
        const int64_t m = a.m[mi];
        const auto xs = std::span<const uint16_t>(x).first(static_cast<size_t>(m * l.p.k));
        const auto os = std::span<uint8_t>(out).first(static_cast<size_t>(m * l.p.n * 2));
        const double work = 2.0 * static_cast<double>(m * l.p.n * l.p.k);
        const int iters = std::max(1, std::min(a.iters, static_cast<int>(2e10 / std::max(work, 1.0))));
        size_t c = round % l.copies.size();
        K3_RETURN_IF_ERROR(cpu::run(l.plan, l.copies[c], m, xs, l.ws, os));  // warm-up
        for (int i = 0; i < iters; ++i) {
          c = (c + 1) % l.copies.size();
          const double t0 = now_s();
          K3_RETURN_IF_ERROR(cpu::run(l.plan, l.copies[c], m, xs, l.ws, os));
          samples[li][mi].push_back(now_s() - t0);
        }
        progress(++done, total,
                 "linear " + std::to_string(l.p.k) + "x" + std::to_string(l.p.n) + " " +
                     linear_recipe_name(l.p.recipe) + " M=" + std::to_string(m));
      }
    }
    if (torch_on) {  // torch's round, after k3's
      auto [code, text] = run_capture({a.torch_python, "-c", kTorchScript, torch_args});
      if (code != 0) {
        torch_on = false;
        torch_note = a.torch_python + " exited with status " + std::to_string(code) + " (is torch installed?)";
        torch_samples.clear();
        continue;
      }
      size_t at = 0;
      while (at < text.size()) {
        const size_t nl = text.find('\n', at);
        const std::string line = text.substr(at, nl == std::string::npos ? std::string::npos : nl - at);
        at = nl == std::string::npos ? text.size() : nl + 1;
        const auto j = nlohmann::json::parse(line, nullptr, false);
        if (j.is_discarded() || !j.is_object()) continue;
        if (j.contains("torch")) {
          torch_version = j["torch"].get<std::string>();
          continue;
        }
        auto& v = torch_samples[{j["k"].get<int64_t>(), j["n"].get<int64_t>(), j["m"].get<int64_t>()}];
        for (const auto& t : j["times"]) v.push_back(t.get<double>());
      }
    }
  }
  if (torch_on && torch_version.empty()) {
    torch_on = false;
    torch_note = a.torch_python + " printed no torch results";
  }
  if (torch_on) {
    std::printf("torch baseline: BF16 F.linear, torch %s, %d thread(s), the same shapes, M and weight rotation "
                "(one process per round, after k3's)\n",
                torch_version.c_str(), threads);
  } else {
    std::printf("torch baseline: not run (%s)\n", torch_note.c_str());
  }

  nlohmann::json records = nlohmann::json::array();
  std::printf("%-11s %-6s %5s | %28s | %9s %7s | %9s %7s%s\n", "K x N", "recipe", "M", "ms median [min, max]", "GB/s",
              "of bw", "GFLOP/s", "of peak", torch_on ? " | torch ms   k3 speed-up" : "");
  bool over = false;
  for (size_t li = 0; li < layers.size(); ++li) {
    const Layer& l = layers[li];
    for (size_t mi = 0; mi < a.m.size(); ++mi) {
      auto t = samples[li][mi];
      std::sort(t.begin(), t.end());
      const Timing tm{t[t.size() / 2], t.front(), t.back(), static_cast<int>(t.size())};
      const int64_t m = a.m[mi];
      const double bytes = static_cast<double>(weight_bytes(l.p)) + static_cast<double>(m * (l.p.k + l.p.n) * 2);
      const double gbs = bytes / tm.median, flops = 2.0 * static_cast<double>(m * l.p.n * l.p.k) / tm.median;
      const double fbw = gbs / bw.value;
      const double fpk = flops / (l.p.recipe == LinearRecipe::kW16A16 ? peak_fp32.value : peak.value);
      over = over || fbw > 1.0 || fpk > 1.0;
      std::string torch_col;
      nlohmann::json torch_rec;
      if (auto it = torch_samples.find({l.p.k, l.p.n, m}); torch_on && it != torch_samples.end() && !it->second.empty()) {
        auto tt = it->second;
        std::sort(tt.begin(), tt.end());
        const Timing tq{tt[tt.size() / 2], tt.front(), tt.back(), static_cast<int>(tt.size())};
        char buf[64];
        std::snprintf(buf, sizeof buf, " | %8.3f %8.2fx", tq.median * 1e3, tq.median / tm.median);
        torch_col = buf;
        torch_rec = {{"time", to_json(tq)}, {"k3_speedup", tq.median / tm.median}};
      }
      std::printf("%5lldx%-5lld %-6s %5lld | %9.3f [%7.3f, %7.3f] | %9.2f %6.1f%% | %9.1f %6.1f%%%s%s\n",
                  static_cast<long long>(l.p.k), static_cast<long long>(l.p.n), linear_recipe_name(l.p.recipe),
                  static_cast<long long>(m), tm.median * 1e3, tm.min * 1e3, tm.max * 1e3, gbs / 1e9, 100 * fbw,
                  flops / 1e9, 100 * fpk, torch_col.c_str(), over_limit_flag(std::max(fbw, fpk)));
      records.push_back({{"k", l.p.k},
                         {"n", l.p.n},
                         {"recipe", linear_recipe_name(l.p.recipe)},
                         {"m", m},
                         {"time", to_json(tm)},
                         {"bytes", bytes},
                         {"flop", 2.0 * static_cast<double>(m * l.p.n * l.p.k)},
                         {"fraction_of_read_bandwidth", fbw},
                         {"fraction_of_peak", fpk},
                         {"torch_bf16", torch_rec}});
    }
  }
  if (over)
    std::printf("\nA fraction above 100%% means a limit probe read low (a busy machine); rerun on a quiet one.\n");
  if (!a.output.empty()) {
    nlohmann::json j = {{"machine", machine_json(threads)},
                        {"isa", isa_level_name(isa.value())},
                        {"plan", layers.front().plan.describe()},
                        {"read_bandwidth_Bps", to_json(bw)},
                        {"peak_flops", to_json(peak)},
                        {"peak_flops_w16a16", to_json(peak_fp32)},
                        {"rounds", a.rounds},
                        {"pool_mib", a.pool_mib},
                        {"torch", torch_on ? nlohmann::json{{"version", torch_version}, {"python", a.torch_python}}
                                           : nlohmann::json{{"not_run", torch_note}}},
                        {"records", records}};
    K3_RETURN_IF_ERROR(write_file_atomic(a.output, j.dump(2) + "\n", "--output"));
  }
  return Status::ok();
}

const BenchRegistration kRegistration("linear", [](CLI::App& bench) -> CommandRun {
  auto* cmd = bench.add_subcommand("linear", "Dense linear layer (MXFP8 or BF16 weights): M sweep at the seed's and Kimi-Linear's shapes");
  auto a = std::make_shared<Args>();
  cmd->add_option("--threads", a->threads, "Threads (default: K3_NUM_THREADS or all CPUs)");
  cmd->add_option("--isa", a->isa,
                  "CPU kernel level: scalar | avx2 | avx512 | avx512bf16 (default: K3_ISA or the CPU's best); the "
                  "peak is measured for the same level");
  cmd->add_option("--shapes", a->shapes, "KxN shapes (comma- or space-separated)")->delimiter(',')->capture_default_str();
  cmd->add_option("--recipes", a->recipes, "w8a16, w8a8 and / or w16a16 (BF16 weights)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--m", a->m, "Rows M (1 to 65536; comma- or space-separated)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  cmd->add_option("--iters", a->iters, "Timed calls per case and round (fewer for big cases)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--rounds", a->rounds, "Interleaved rounds over all cases")->capture_default_str()->check(CLI::Range(1, 100));
  cmd->add_option("--pool-mib", a->pool_mib, "Weights MiB rotated over per layer (defeats the cache)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--bw-mib", a->bw_mib, "Buffer of the read-bandwidth probe in MiB")
      ->capture_default_str()
      ->check(CLI::Range(16, 65536));
  cmd->add_option("--output", a->output, "Write JSON records to this file");
  cmd->add_option("--torch-python", a->torch_python,
                  "Python that runs torch's BF16 F.linear side by side, when it can import torch ('off': none)")
      ->capture_default_str();
  return [a]() { return run(*a); };
});

}  // namespace
}  // namespace k3::tool
