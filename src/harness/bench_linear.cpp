// The dense-linear benchmark (k3/harness/bench.hpp): the layer (MXFP8 or BF16 weights) at the
// seed's and Kimi-Linear's shapes over an M sweep. Small M is rated against the read bandwidth
// (the weights stream once per call: N K (1 + 1/32) bytes, W16A16 2 N K), large M against the
// level's dot / FMA peak, both measured in the same run. Weights are rotated over several
// prepacked copies (at least pool_mib) so that decode reads them from memory, not from the
// last-level cache. Rounds interleave the cases so that drift spreads over all of them. torch's
// BF16 F.linear runs side by side when `torch_python` can import torch: one child process per
// round, after k3's round, on the same shapes, M, threads and weight rotation.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "bench_json.hpp"
#include "k3/backend.hpp"
#include "k3/kda.hpp"
#include "k3/linear.hpp"
#include "k3/mx.hpp"
#include "k3/formats.hpp"
#include "k3/harness/bench.hpp"

namespace k3::harness {
namespace {

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

struct Layer {
  LinearProblem p;
  std::vector<std::unique_ptr<PreparedLinear>> copies;  // the registry's prepared layer, several copies
  std::vector<uint8_t> ws;
};

}  // namespace

Result<std::pair<int64_t, int64_t>> parse_linear_shape(const std::string& s) {
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

namespace {
// Bytes of one layer's weights: 8 bits + one scale per 32 (MXFP8), or 16 bits (BF16).
int64_t weight_bytes(const LinearProblem& p) {
  return p.recipe == LinearRecipe::kW16A16 ? p.n * p.k * 2 : p.n * p.k * 33 / 32;
}
}  // namespace

Status check_linear_bench(const LinearBenchConfig& c) {
  if (c.shapes.empty()) return invalid_argument("--shapes is empty");
  if (c.recipes.empty()) return invalid_argument("--recipes is empty");
  if (c.m.empty()) return invalid_argument("--m is empty");
  for (const auto& s : c.shapes) K3_RETURN_IF_ERROR(parse_linear_shape(s).status());
  for (const auto& r : c.recipes) {
    if (auto rec = parse_linear_recipe(r); !rec.is_ok()) return invalid_argument("--recipes: " + rec.status().message());
  }
  for (const int64_t m : c.m) {
    if (m < 1 || m > (int64_t{1} << 16)) return invalid_argument("--m " + std::to_string(m) + " must be in [1, 65536]");
  }
  if (c.iters < 1 || c.iters > 1000) return invalid_argument("--iters " + std::to_string(c.iters) + " must be in [1, 1000]");
  if (c.rounds < 1 || c.rounds > 100) return invalid_argument("--rounds " + std::to_string(c.rounds) + " must be in [1, 100]");
  if (c.pool_mib < 1 || c.pool_mib > 65536) return invalid_argument("--pool-mib " + std::to_string(c.pool_mib) + " must be in [1, 65536]");
  if (c.bw_mib < 16 || c.bw_mib > 65536) return invalid_argument("--bw-mib " + std::to_string(c.bw_mib) + " must be in [16, 65536]");
  // What the run will allocate, checked before any of it is: per (shape, recipe) the packed
  // copies that fill the pool plus the weights it generates them from, the bandwidth probes, x and
  // the output. Above the physical memory (or kda::kMaxBufferBytes) it is refused by name.
  int64_t total = (c.bw_mib + std::min<int64_t>(c.bw_mib, 256)) << 20, transient = 0, max_k = 0, max_n = 0;
  const int64_t max_m = *std::max_element(c.m.begin(), c.m.end());
  for (const auto& s : c.shapes) {
    const auto kn = parse_linear_shape(s).value();
    for (const auto& r : c.recipes) {
      LinearProblem p;
      p.k = kn.first;
      p.n = kn.second;
      p.recipe = parse_linear_recipe(r).value();
      if (Status st = validate_linear_problem(p); !st.is_ok())
        return invalid_argument("--shapes " + s + ": " + st.message());
      const int64_t bytes = weight_bytes(p);
      const int64_t copies = std::max<int64_t>(1, (c.pool_mib << 20) / bytes + 1);
      total += copies * bytes;
      transient = std::max(transient, p.n * p.k * 6);  // the FP32 weights and their codes, while packing
    }
    max_k = std::max(max_k, kn.first), max_n = std::max(max_n, kn.second);
  }
  total += transient + max_m * (max_k + max_n) * 2;
  if (Status st = kda::check_buffer_bytes("k3 bench linear at these --shapes, --recipes, --m, --pool-mib " +
                                              std::to_string(c.pool_mib) + " and --bw-mib " + std::to_string(c.bw_mib),
                                          total, 1);
      !st.is_ok())
    return invalid_argument(st.message() + "; use smaller --shapes or --pool-mib");
  return Status::ok();
}

namespace {

// Bytes one call of M rows moves: the weights, BF16 x in and BF16 y out.
int64_t call_bytes(const LinearProblem& p, int64_t m) { return weight_bytes(p) + m * (p.k + p.n) * 2; }

Result<nlohmann::json> run(const LinearBenchConfig& a, const BenchHooks& hooks) {
  K3_RETURN_IF_ERROR(check_linear_bench(a));
  const int threads = a.threads > 0 ? a.threads : hardware_thread_count();
  const IsaLevel isa_level = a.isa;
  const int64_t max_m = *std::max_element(a.m.begin(), a.m.end());

  // Layers: one per (shape, recipe), each with enough copies to exceed the pool, prepared through
  // the registry's cpu backend.
  K3_ASSIGN_OR_RETURN(const LinearBackend* backend, find_linear_backend("cpu"));
  std::vector<Layer> layers;
  std::mt19937 rng(7);
  for (const auto& s : a.shapes) {
    K3_ASSIGN_OR_RETURN(auto kn, parse_linear_shape(s));
    for (const auto& r : a.recipes) {
      Layer l;
      l.p.k = kn.first;
      l.p.n = kn.second;
      auto rec = parse_linear_recipe(r);
      if (!rec.is_ok()) return invalid_argument("--recipes: " + rec.status().message());
      l.p.recipe = rec.value();
      l.p.out_dtype = OutDType::kBF16;
      K3_RETURN_IF_ERROR(validate_linear_problem(l.p));
      BackendOptions o;
      o.threads = threads;
      o.isa = isa_level;
      o.max_tokens = max_m;
      const bool b16 = l.p.recipe == LinearRecipe::kW16A16;
      std::vector<uint8_t> codes, scales;
      std::vector<uint16_t> wb;
      if (b16) {
        wb.resize(static_cast<size_t>(l.p.n * l.p.k));
        std::normal_distribution<float> wd(0.0f, 0.05f);
        for (auto& v : wb) v = bf16_from_f32(wd(rng));
      } else {
        // Weights as a checkpoint holds them: Gaussian values quantized to MXFP8 (RCEIL), so the
        // codes have a trained layer's distribution (zero and subnormal codes are rare, and the
        // avx512bf16 kernels take the path of normal blocks as they would there).
        std::vector<float> wf(static_cast<size_t>(l.p.n * l.p.k));
        std::normal_distribution<float> wd(0.0f, 0.05f);
        for (auto& v : wf) v = wd(rng);
        codes.resize(static_cast<size_t>(l.p.n * l.p.k));
        scales.resize(static_cast<size_t>(l.p.n * l.p.k / 32));
        K3_RETURN_IF_ERROR(mx_quantize(wf, l.p.n, l.p.k, MxElement::kE4M3, ScaleRule::kRceil, codes, scales));
      }
      const LinearWeightsView w{codes, scales, {}, wb};
      const int64_t bytes = weight_bytes(l.p);
      const int64_t copies = std::max<int64_t>(1, (a.pool_mib << 20) / bytes + 1);
      for (int64_t c = 0; c < copies; ++c) {
        K3_ASSIGN_OR_RETURN(auto layer, prepare_linear(*backend, l.p, w, o));
        l.copies.push_back(std::move(layer));
      }
      l.ws.resize(static_cast<size_t>(l.copies.front()->workspace_bytes()));
      layers.push_back(std::move(l));
    }
  }

  const auto bw = measure_read_bandwidth(threads, a.bw_mib << 20);
  // Decode M (<= 8, bound by the weight stream): also against the read bandwidth probed right
  // before and after each round's calls of that layer and M (a shared host's bandwidth moves within
  // a run): per round the larger of the two probes, and the fraction of that round's median.
  constexpr int64_t kDecodeMaxM = 8, kAdjacentMaxMib = 256;
  constexpr int kAdjacentPasses = 3;
  std::unique_ptr<ReadBandwidthProbe> adjacent;
  if (std::any_of(a.m.begin(), a.m.end(), [](int64_t m) { return m <= kDecodeMaxM; })) {
    adjacent = std::make_unique<ReadBandwidthProbe>(threads, std::min<int64_t>(a.bw_mib, kAdjacentMaxMib) << 20);
  }
  const auto peak = measure_dot_peak(threads, isa_level);
  // W16A16 runs FP32 FMAs on every level: on avx512bf16 its limit is the AVX-512 FP32 FMA peak.
  const bool fp32_peak_needed =
      isa_level == IsaLevel::kAvx512Bf16 &&
      std::any_of(layers.begin(), layers.end(), [](const Layer& l) { return l.p.recipe == LinearRecipe::kW16A16; });
  const auto peak_fp32 = fp32_peak_needed ? measure_dot_peak(threads, IsaLevel::kAvx512) : peak;

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
  // per round: the adjacent read bandwidth and the fraction of it (decode M only)
  auto adj_bw = samples, adj_frac = samples;
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
        const bool probed = adjacent != nullptr && m <= kDecodeMaxM;
        const double before = probed ? adjacent->measure(kAdjacentPasses) : 0;
        K3_RETURN_IF_ERROR(l.copies[c]->run(m, xs, l.ws, os));  // warm-up
        std::vector<double> times;
        for (int i = 0; i < iters; ++i) {
          c = (c + 1) % l.copies.size();
          const double t0 = now_s();
          K3_RETURN_IF_ERROR(l.copies[c]->run(m, xs, l.ws, os));
          times.push_back(now_s() - t0);
        }
        if (probed) {
          const double adj = std::max(before, adjacent->measure(kAdjacentPasses));
          auto sorted = times;
          std::sort(sorted.begin(), sorted.end());
          adj_bw[li][mi].push_back(adj);
          adj_frac[li][mi].push_back(static_cast<double>(call_bytes(l.p, m)) / sorted[sorted.size() / 2] / adj);
        }
        samples[li][mi].insert(samples[li][mi].end(), times.begin(), times.end());
        hooks.step(++done, total,
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

  nlohmann::json records = nlohmann::json::array();
  for (size_t li = 0; li < layers.size(); ++li) {
    const Layer& l = layers[li];
    for (size_t mi = 0; mi < a.m.size(); ++mi) {
      auto t = samples[li][mi];
      std::sort(t.begin(), t.end());
      const Timing tm = summarize(t);
      const int64_t m = a.m[mi];
      const double bytes = static_cast<double>(call_bytes(l.p, m));
      const double gbs = bytes / tm.median, flops = 2.0 * static_cast<double>(m * l.p.n * l.p.k) / tm.median;
      const double fbw = gbs / bw.value;
      const double fpk = flops / (l.p.recipe == LinearRecipe::kW16A16 ? peak_fp32.value : peak.value);
      nlohmann::json torch_rec;
      if (auto it = torch_samples.find({l.p.k, l.p.n, m}); torch_on && it != torch_samples.end() && !it->second.empty()) {
        auto tt = it->second;
        std::sort(tt.begin(), tt.end());
        const Timing tq = summarize(tt);
        torch_rec = {{"time", to_json(tq)}, {"k3_speedup", tq.median / tm.median}};
      }
      nlohmann::json rec{{"k", l.p.k},
                         {"n", l.p.n},
                         {"recipe", linear_recipe_name(l.p.recipe)},
                         {"m", m},
                         {"time", to_json(tm)},
                         {"bytes", bytes},
                         {"flop", 2.0 * static_cast<double>(m * l.p.n * l.p.k)},
                         {"fraction_of_read_bandwidth", fbw},
                         {"fraction_of_peak", fpk},
                         {"torch_bf16", torch_rec}};
      if (!adj_frac[li][mi].empty()) {
        auto ab = adj_bw[li][mi], af = adj_frac[li][mi];
        std::sort(ab.begin(), ab.end());
        std::sort(af.begin(), af.end());
        rec["adjacent_read_bandwidth_Bps"] = {
            {"median", ab[ab.size() / 2]}, {"min", ab.front()}, {"max", ab.back()},
            {"what", "per round, read bandwidth right before and right after that round's calls (best of " +
                         std::to_string(kAdjacentPasses) + " passes over " + std::to_string(adjacent->bytes() >> 20) +
                         " MiB each), the larger"}};
        rec["fraction_of_adjacent_read_bandwidth"] = af[af.size() / 2];  // median over the rounds
      }
      records.push_back(std::move(rec));
    }
  }
  {
    nlohmann::json j = {{"machine", machine(threads, isa_level)},
                        {"isa", isa_level_name(isa_level)},
                        {"plan", layers.front().copies.front()->describe()},
                        {"read_bandwidth_Bps", to_json(bw)},
                        {"peak_flops", to_json(peak)},
                        {"peak_flops_w16a16", to_json(peak_fp32)},
                        {"rounds", a.rounds},
                        {"pool_mib", a.pool_mib},
                        {"torch", torch_on ? nlohmann::json{{"version", torch_version}, {"python", a.torch_python}}
                                           : nlohmann::json{{"not_run", torch_note}}},
                        {"records", records}};
    return j;
  }
}

}  // namespace

BenchResult bench_linear(const LinearBenchConfig& c, const BenchHooks& hooks) {
  auto doc = run(c, hooks);
  if (!doc.is_ok()) return {"", doc.status()};
  return {doc->dump(2) + "\n", Status::ok()};
}

}  // namespace k3::harness
