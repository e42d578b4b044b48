#include "bench_moe_routing.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <span>
#include <string_view>

#include "k3/atomic_file.hpp"

namespace k3::tool {
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
}  // namespace

std::string RoutingSpec::name() const {
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

Result<RoutingSpec> parse_routing(const std::string& s) {
  RoutingSpec r;
  if (s == "uniform") {
    r.kind = RoutingSpec::Kind::kUniform;
  } else if (s == "ep_mixed") {
    r.kind = RoutingSpec::Kind::kEpMixed;
  } else if (s.rfind("zipf:", 0) == 0) {
    r.kind = RoutingSpec::Kind::kZipf;
    char* end = nullptr;
    r.zipf_s = std::strtod(s.c_str() + 5, &end);
    if (end == s.c_str() + 5 || *end != '\0' || !(r.zipf_s > 0) || !std::isfinite(r.zipf_s)) {
      return invalid_argument("--routing " + s + ": zipf:S needs a finite S > 0");
    }
  } else if (s.rfind("replay:", 0) == 0 && s.size() > 7) {
    r.kind = RoutingSpec::Kind::kReplay;
    r.file = s.substr(7);
  } else {
    return invalid_argument("--routing " + s + " is unknown (expected uniform, zipf:S, ep_mixed or replay:FILE)");
  }
  return r;
}

Result<Routing> make_routing(const RoutingSpec& spec, const MoeShape& shape, int64_t m, uint64_t seed) {
  const int el = shape.local_experts(), first = shape.first_local_expert(), k = shape.top_k, e = shape.num_experts;
  Routing r;
  r.ids.resize(static_cast<size_t>(m * k));
  r.weights.resize(static_cast<size_t>(m * k));
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uw(0.05f, 1.0f);
  if (spec.kind == RoutingSpec::Kind::kReplay) {
    int64_t tokens = 0;
    auto ids = load_routing(spec.file, k, &tokens);
    if (!ids.is_ok()) return ids.status();
    if (tokens == 0) return invalid_argument(spec.file + ": holds no token");
    for (size_t i = 0; i < ids->size(); ++i) {
      const int32_t id = (*ids)[i];
      if (id < -1 || id >= e) {
        return invalid_argument(spec.file + ": id " + std::to_string(id) + " at position " + std::to_string(i) +
                                " is outside [-1, " + std::to_string(e) + ")");
      }
    }
    for (int64_t t = 0; t < m; ++t) {
      std::copy_n(ids->begin() + (t % tokens) * k, k, r.ids.begin() + t * k);
    }
  } else {
    const int local_slots = spec.kind == RoutingSpec::Kind::kEpMixed ? k / 2 : k;
    if (local_slots > el) {
      return invalid_argument("routing " + spec.name() + ": " + std::to_string(local_slots) +
                              " local slots per token need at least that many local experts (E_local = " +
                              std::to_string(el) + ")");
    }
    if (spec.kind == RoutingSpec::Kind::kEpMixed && e - el < k - local_slots) {
      return invalid_argument("routing ep_mixed: " + std::to_string(k - local_slots) +
                              " remote slots per token need that many remote experts (E - E_local = " +
                              std::to_string(e - el) + ")");
    }
    std::vector<double> lw(static_cast<size_t>(el), 1.0);
    if (spec.kind == RoutingSpec::Kind::kZipf) {
      std::vector<int> rank(static_cast<size_t>(el));
      std::iota(rank.begin(), rank.end(), 1);
      std::shuffle(rank.begin(), rank.end(), rng);
      for (int i = 0; i < el; ++i) lw[static_cast<size_t>(i)] = 1.0 / std::pow(rank[static_cast<size_t>(i)], spec.zipf_s);
    }
    std::vector<double> rw(static_cast<size_t>(e - el), 1.0);
    for (int64_t t = 0; t < m; ++t) {
      std::vector<int32_t> row;
      for (int v : draw_distinct(rng, lw, local_slots)) row.push_back(first + v);
      if (k > local_slots) {
        for (int v : draw_distinct(rng, rw, k - local_slots)) row.push_back(v < first ? v : v + el);
        std::shuffle(row.begin(), row.end(), rng);
      }
      std::copy(row.begin(), row.end(), r.ids.begin() + t * k);
    }
  }
  for (int64_t t = 0; t < m; ++t) {
    float sum = 0;
    for (int s = 0; s < k; ++s) sum += (r.weights[static_cast<size_t>(t * k + s)] = uw(rng));
    for (int s = 0; s < k; ++s) r.weights[static_cast<size_t>(t * k + s)] /= sum;
  }
  return r;
}

Status save_routing(const std::string& path, int64_t tokens, int top_k, const std::vector<int32_t>& ids) {
  if (static_cast<int64_t>(ids.size()) != tokens * top_k) {
    return invalid_argument("save_routing: ids has " + std::to_string(ids.size()) + " elements, expected " +
                            std::to_string(tokens * top_k));
  }
  auto f = AtomicFile::create(path, "--save-routing");
  if (!f.is_ok()) return f.status();
  const int64_t hdr[2] = {tokens, top_k};
  K3_RETURN_IF_ERROR(f->write(std::string_view(kMagic, 8)));
  K3_RETURN_IF_ERROR(f->write(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(hdr), sizeof hdr)));
  K3_RETURN_IF_ERROR(f->write(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(ids.data()), ids.size() * 4)));
  return f->commit();
}

Result<std::vector<int32_t>> load_routing(const std::string& path, int top_k, int64_t* tokens) {
  K3_RETURN_IF_ERROR(check_input_file("--routing replay:", path));  // a FIFO is refused, not waited on
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

}  // namespace k3::tool
