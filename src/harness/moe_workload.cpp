// The fused-MoE benchmark workload (k3/harness/moe_workload.hpp).
#include "k3/harness/moe_workload.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <string_view>

#include "k3/harness/atomic_file.hpp"
#include "k3/expert_map.hpp"

namespace k3 {
namespace {
constexpr char kMagic[8] = {'K', '3', 'I', 'D', 'S', '0', '0', '1'};

// k distinct values of [0, n) drawn with probabilities proportional to w (sequential draws
// without replacement).
std::vector<int> draw_distinct(std::mt19937_64& rng, const std::vector<double>& w, int k) {
  std::vector<double> left = w;
  std::vector<int> out;
  for (int i = 0; i < k; ++i) {
    std::discrete_distribution<int> d(left.begin(), left.end());
    const int v = d(rng);
    out.push_back(v);
    left[static_cast<size_t>(v)] = 0.0;
  }
  return out;
}

// Unroutable ids of a replay file are named with their position.
Status check_replay_ids(const std::string& file, std::span<const int32_t> ids, int num_experts) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < -1 || ids[i] >= num_experts) {
      return invalid_argument(file + ": id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                              " is outside [-1, " + std::to_string(num_experts) + ")");
    }
  }
  return Status::ok();
}

// Distinct local (and for ep_mixed remote) experts per token, drawn from the spec's weights.
Status draw_synthetic_ids(const BenchRouting& spec, const MoeShape& shape, int64_t m, std::mt19937_64& rng,
                          std::vector<int32_t>& ids) {
  const int el = shape.local_experts(), first = shape.first_local_expert(), k = shape.top_k, e = shape.num_experts;
  const int local_slots = spec.kind == BenchRouting::Kind::kEpMixed ? k / 2 : k;
  if (local_slots > el) {
    return invalid_argument("routing " + spec.name() + ": " + std::to_string(local_slots) +
                            " local slots per token need at least that many local experts (E_local = " +
                            std::to_string(el) + ")");
  }
  if (spec.kind == BenchRouting::Kind::kEpMixed && e - el < k - local_slots) {
    return invalid_argument("routing ep_mixed: " + std::to_string(k - local_slots) +
                            " remote slots per token need that many remote experts (E - E_local = " +
                            std::to_string(e - el) + ")");
  }
  std::vector<double> lw(static_cast<size_t>(el), 1.0);
  if (spec.kind == BenchRouting::Kind::kZipf) {
    std::vector<int> rank(static_cast<size_t>(el));
    std::iota(rank.begin(), rank.end(), 1);
    std::shuffle(rank.begin(), rank.end(), rng);
    for (int i = 0; i < el; ++i) lw[static_cast<size_t>(i)] = 1.0 / std::pow(rank[static_cast<size_t>(i)], spec.zipf_s);
  }
  const std::vector<double> rw(static_cast<size_t>(e - el), 1.0);
  std::vector<int32_t> row;
  for (int64_t t = 0; t < m; ++t) {
    row.clear();
    for (int v : draw_distinct(rng, lw, local_slots)) row.push_back(first + v);
    if (k > local_slots) {
      for (int v : draw_distinct(rng, rw, k - local_slots)) row.push_back(v < first ? v : v + el);
      std::shuffle(row.begin(), row.end(), rng);
    }
    std::copy(row.begin(), row.end(), ids.begin() + t * k);
  }
  return Status::ok();
}

}  // namespace

std::string BenchRouting::name() const {
  switch (kind) {
    case Kind::kUniform: return "uniform";
    case Kind::kZipf: {
      char b[32];
      std::snprintf(b, sizeof b, "zipf:%g", zipf_s);
      return b;
    }
    case Kind::kEpMixed: return "ep_mixed";
    case Kind::kReplay: return "replay:" + file;
  }
  return "?";
}

Result<BenchRouting> parse_bench_routing(const std::string& s) {
  BenchRouting r;
  if (s == "uniform") {
    r.kind = BenchRouting::Kind::kUniform;
  } else if (s == "ep_mixed") {
    r.kind = BenchRouting::Kind::kEpMixed;
  } else if (s.rfind("zipf:", 0) == 0) {
    r.kind = BenchRouting::Kind::kZipf;
    char* end = nullptr;
    r.zipf_s = std::strtod(s.c_str() + 5, &end);
    if (end == s.c_str() + 5 || *end != '\0' || !(r.zipf_s > 0) || !std::isfinite(r.zipf_s)) {
      return invalid_argument("routing '" + s + "': zipf:S needs a finite S > 0");
    }
  } else if (s.rfind("replay:", 0) == 0 && s.size() > 7) {
    r.kind = BenchRouting::Kind::kReplay;
    r.file = s.substr(7);
  } else {
    return invalid_argument("routing '" + s + "' is unknown (expected uniform, zipf:S, ep_mixed or replay:FILE)");
  }
  return r;
}

Result<RoutedTokens> make_bench_routing(const BenchRouting& spec, const MoeShape& shape, int64_t m, uint64_t seed) {
  K3_RETURN_IF_ERROR(validate_moe_shape(shape));
  if (m < 0) return invalid_argument("routing: m = " + std::to_string(m) + " must be >= 0");
  const int k = shape.top_k;
  RoutedTokens r;
  r.ids.resize(static_cast<size_t>(m * k));
  r.weights.resize(static_cast<size_t>(m * k));
  std::mt19937_64 rng(seed);
  if (spec.kind == BenchRouting::Kind::kReplay) {
    int64_t tokens = 0;
    K3_ASSIGN_OR_RETURN(const std::vector<int32_t> ids, load_routing_replay(spec.file, k, &tokens, "--routing replay:"));
    if (tokens == 0) return invalid_argument(spec.file + ": holds no token");
    K3_RETURN_IF_ERROR(check_replay_ids(spec.file, ids, shape.num_experts));
    for (int64_t t = 0; t < m; ++t) std::copy_n(ids.begin() + (t % tokens) * k, k, r.ids.begin() + t * k);
  } else {
    K3_RETURN_IF_ERROR(draw_synthetic_ids(spec, shape, m, rng, r.ids));
  }
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  for (int64_t t = 0; t < m; ++t) {
    float sum = 0;
    for (int s = 0; s < k; ++s) sum += (r.weights[static_cast<size_t>(t * k + s)] = uw(rng));
    for (int s = 0; s < k; ++s) r.weights[static_cast<size_t>(t * k + s)] /= sum;
  }
  return r;
}

Status save_routing_replay(const std::string& path, int64_t tokens, int top_k, std::span<const int32_t> ids,
                           const std::string& label) {
  if (tokens < 0 || top_k < 1 || static_cast<int64_t>(ids.size()) != tokens * top_k) {
    return invalid_argument(label + ": ids has " + std::to_string(ids.size()) + " elements, expected tokens (" +
                            std::to_string(tokens) + ") x top_k (" + std::to_string(top_k) + ")");
  }
  K3_ASSIGN_OR_RETURN(AtomicFile f, AtomicFile::create(path, label));
  const int64_t hdr[2] = {tokens, top_k};
  K3_RETURN_IF_ERROR(f.write(std::string_view(kMagic, 8)));
  K3_RETURN_IF_ERROR(f.write(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(hdr), sizeof hdr)));
  K3_RETURN_IF_ERROR(f.write(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(ids.data()), ids.size() * 4)));
  return f.commit();
}

Result<std::vector<int32_t>> load_routing_replay(const std::string& path, int top_k, int64_t* tokens,
                                                 const std::string& label) {
  K3_RETURN_IF_ERROR(check_input_file(label, path));  // a FIFO is refused, not waited on
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return io_error(path + ": cannot open");
  const int64_t size = static_cast<int64_t>(f.tellg());
  f.seekg(0);
  char magic[8];
  int64_t hdr[2] = {0, 0};
  if (size < 24 || !f.read(magic, 8) || std::memcmp(magic, kMagic, 8) != 0 ||
      !f.read(reinterpret_cast<char*>(hdr), sizeof hdr)) {
    return io_error(path + ": not a routing replay file (expected the 8-byte magic K3IDS001 and a 24-byte header)");
  }
  if (hdr[1] != top_k) {
    return invalid_argument(path + ": top_k = " + std::to_string(hdr[1]) + " in the file, the shape has top_k = " +
                            std::to_string(top_k));
  }
  if (hdr[0] < 0 || hdr[0] > (int64_t{1} << 28) || size != 24 + hdr[0] * top_k * 4) {
    return io_error(path + ": header says " + std::to_string(hdr[0]) + " tokens x " + std::to_string(top_k) +
                    " ids but the file has " + std::to_string(size) + " bytes");
  }
  std::vector<int32_t> ids(static_cast<size_t>(hdr[0] * top_k));
  if (!f.read(reinterpret_cast<char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4))) {
    return io_error(path + ": short read");
  }
  *tokens = hdr[0];
  return ids;
}

SyntheticMoeWeights synthetic_moe_weights(const MoeShape& sh, uint64_t seed) {
  const int64_t el = sh.local_experts(), k = sh.hidden, n = sh.intermediate;
  SyntheticMoeWeights w;
  w.fc1_q.resize(static_cast<size_t>(el * 2 * n * k / 2));
  w.fc1_scale.resize(static_cast<size_t>(el * 2 * n * k / 32));
  w.fc2_q.resize(static_cast<size_t>(el * k * n / 2));
  w.fc2_scale.resize(static_cast<size_t>(el * k * n / 32));
  // splitmix64 of the word offset: fast, seeded, and independent of the thread count.
  auto fill = [](std::vector<uint8_t>& v, uint64_t s) {
    const int64_t words = static_cast<int64_t>(v.size() / 8);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < words; ++i) {
      uint64_t z = s + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      std::memcpy(v.data() + i * 8, &z, 8);
    }
    for (size_t i = static_cast<size_t>(words) * 8; i < v.size(); ++i) v[i] = static_cast<uint8_t>(s >> (8 * (i % 8)));
  };
  fill(w.fc1_q, seed);
  fill(w.fc2_q, seed);
  std::mt19937_64 rng(seed);
  for (auto& s : w.fc1_scale) s = static_cast<uint8_t>(119 + rng() % 3);
  for (auto& s : w.fc2_scale) s = static_cast<uint8_t>(119 + rng() % 3);
  return w;
}

int64_t mxfp4_expert_bytes(const MoeShape& sh) {
  const int64_t nk = sh.hidden * sh.intermediate;
  return 3 * nk / 2 + 3 * nk / 32;
}

Result<MoeCallTraffic> moe_call_traffic(const MoeShape& shape, int64_t m, std::span<const int32_t> ids,
                                        int64_t chunk_tokens) {
  if (chunk_tokens < 1) {
    return invalid_argument("moe_call_traffic: chunk_tokens = " + std::to_string(chunk_tokens) + " must be >= 1");
  }
  K3_ASSIGN_OR_RETURN(const EpMapping map, map_expert_parallel(shape, m, ids));
  const int el = shape.local_experts();
  const double expert_bytes = static_cast<double>(mxfp4_expert_bytes(shape));
  MoeCallTraffic t;
  std::vector<char> used(static_cast<size_t>(el));
  for (int64_t t0 = 0; t0 < m; t0 += chunk_tokens) {
    const int64_t t1 = std::min(m, t0 + chunk_tokens);
    std::fill(used.begin(), used.end(), 0);
    for (int64_t i = t0 * shape.top_k; i < t1 * shape.top_k; ++i) {
      const int32_t l = map.local_ids[static_cast<size_t>(i)];
      if (l >= 0) used[static_cast<size_t>(l)] = 1;
    }
    for (char u : used) t.weight_bytes += u ? expert_bytes : 0.0;
  }
  t.local_slots = map.local_slots;
  t.flops = 2.0 * static_cast<double>(map.local_slots) * 3.0 * static_cast<double>(shape.hidden * shape.intermediate);
  for (int64_t r : map.rows_per_expert) t.active_experts += r > 0;
  return t;
}

}  // namespace k3
