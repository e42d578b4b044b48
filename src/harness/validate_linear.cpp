// `k3 validate --op linear`: the dense MXFP8 linear layer against its FP64 oracle and its plain
// contract (docs/linear.md). Suites:
//   smoke / real  shapes with K and N not multiples of 64, M = 1 ... 4096, both recipes, every
//                 output dtype, with and without bias: NRMSE / max error against the FP64 oracle
//                 within the contract tolerance AND the bits of the plain contract (linear_reference)
//   nonfinite     NaN / Inf / huge / tiny rows: the oracle's NaN / Inf class, the contract's bits
//                 (the huge value is 2^118: from about 2^119 on, one product of an unscaled E4M3
//                 weight can exceed FLT_MAX, and the contract's FP32 block sum is then +-Inf where
//                 the FP64 oracle stays finite; docs/linear.md)
//   determinism   threads 1, 2, 3 and every ISA level up to the CPU's: one digest
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "k3/backend.hpp"
#include "k3/harness/digest.hpp"
#include "k3/formats.hpp"
#include "k3/linear.hpp"
#include "k3/harness/moe_compare.hpp"
#include "k3/system.hpp"
#include "k3/harness/validate.hpp"

namespace k3::harness {
namespace {

struct LinCase {
  std::string name;
  LinearProblem p;
  int64_t m = 0;
  std::vector<uint8_t> codes, scales;
  std::vector<float> bias;
  std::vector<uint16_t> x;
  std::vector<uint16_t> wb;  // W16A16 weights
  LinearWeightsView view() const { return {codes, scales, bias, wb}; }
};

LinCase make(const std::string& name, int64_t k, int64_t n, int64_t m, LinearRecipe r, OutDType d, bool bias,
             uint64_t seed) {
  LinCase c;
  c.name = name;
  c.p = {k, n, r, d, bias};
  c.m = m;
  std::mt19937_64 rng(seed);
  if (r == LinearRecipe::kW16A16) {  // BF16 weights of a checkpoint's scale
    c.wb.resize(static_cast<size_t>(n * k));
    std::normal_distribution<float> wd(0.0f, 0.05f);
    for (auto& v : c.wb) v = bf16_from_f32(wd(rng));
  } else {
    // Any non-NaN code, except that about half of the (16-row tile, 32-k block) pairs hold normal
    // codes only (nonzero exponent field), as most blocks of a trained layer do: the avx512bf16
    // kernels expand those by bit moves and the others through a lookup, and both are checked.
    const int64_t blocks = k / 32;
    std::vector<uint8_t> normal_only(static_cast<size_t>((n + 15) / 16 * blocks));
    for (auto& v : normal_only) v = static_cast<uint8_t>(rng() & 1);
    c.codes.resize(static_cast<size_t>(n * k));
    for (int64_t row = 0; row < n; ++row)
      for (int64_t kk = 0; kk < k; ++kk) {
        const bool normal = normal_only[static_cast<size_t>((row / 16) * blocks + kk / 32)] != 0;
        uint8_t v;
        do v = static_cast<uint8_t>(rng() & 0xFF);
        while ((v & 0x7F) == 0x7F || (normal && (v & 0x78) == 0));
        c.codes[static_cast<size_t>(row * k + kk)] = v;
      }
    c.scales.resize(static_cast<size_t>(n * k / 32));
    for (auto& s : c.scales) s = static_cast<uint8_t>(116 + rng() % 8);
  }
  if (bias) {
    c.bias.resize(static_cast<size_t>(n));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& b : c.bias) b = nd(rng);
  }
  c.x.resize(static_cast<size_t>(m * k));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : c.x) v = bf16_from_f32(nd(rng));
  return c;
}

std::string row_name(const LinCase& c) {
  return c.name + " " + std::to_string(c.p.k) + "x" + std::to_string(c.p.n) + " M" + std::to_string(c.m) + " " +
         linear_recipe_name(c.p.recipe) + " " + out_dtype_name(c.p.out_dtype) + (c.p.bias ? " +b" : "");
}

// The backend's output against the oracle (tolerance of the output dtype) and the contract's bits.
ValidateRow check(const LinCase& c, const LinearBackend& b, const BackendOptions& o) {
  ValidateRow row;
  row.op = "linear";
  row.case_name = row_name(c);
  row.backend = b.name;
  std::vector<uint8_t> out(static_cast<size_t>(c.m * c.p.n * out_dtype_size(c.p.out_dtype)));
  if (auto st = run_linear(b, c.p, c.view(), c.m, c.x, out, o); !st.is_ok()) {
    row.note = st.to_string();
    return row;
  }
  row.digest = sha256_hex(out);
  std::vector<double> ref(static_cast<size_t>(c.m * c.p.n));
  std::vector<uint8_t> contract(out.size());
  if (auto st = linear_oracle_fp64(c.p, c.view(), c.m, c.x, ref); !st.is_ok()) {
    row.note = "oracle: " + st.to_string();
    return row;
  }
  if (auto st = linear_reference(c.p, c.view(), c.m, c.x, contract); !st.is_ok()) {
    row.note = "contract: " + st.to_string();
    return row;
  }
  auto m = compare_moe_output(out, c.p.out_dtype, ref, {});
  if (!m.is_ok()) {
    row.note = m.status().to_string();
    return row;
  }
  row.cosine = m->cosine;
  row.nrmse = m->nrmse;
  row.max_abs = m->max_abs;
  std::string why;
  const bool tol = within(m.value(), contract_tolerance(c.p.out_dtype), &why) && m->nonfinite_mismatch == 0;
  const int64_t differ = count_output_mismatches(out, contract, c.p.out_dtype);  // NaN as a class
  row.pass = tol && differ == 0;
  if (!tol) row.note = "oracle: " + why + (m->nonfinite_mismatch ? " (NaN/Inf class differs)" : "");
  else if (differ) row.note = std::to_string(differ) + " outputs differ from the contract's bits";
  else row.note = "contract bits; " + m->summary();
  return row;
}

ValidateRow flag(const std::string& name, const std::string& backend, bool pass, std::string note) {
  ValidateRow r;
  r.op = "linear";
  r.case_name = name;
  r.backend = backend;
  r.pass = pass;
  r.note = std::move(note);
  return r;
}

std::string linear_backend_names() {
  std::string names;
  for (const auto& b : linear_backends()) names += (names.empty() ? "" : ", ") + b.name;
  return names;
}

// --backend all: every usable linear backend. A named backend must exist and be usable here: a
// FAIL row otherwise (never a silent skip), as the other ops do.
std::vector<const LinearBackend*> backends_of(const ValidateOptions& o, std::vector<ValidateRow>& rows) {
  std::vector<const LinearBackend*> list;
  if (o.backend == "all") {
    for (const auto& b : linear_backends())
      if (b.available().is_ok()) list.push_back(&b);
    return list;
  }
  auto b = find_linear_backend(o.backend);
  if (!b.is_ok()) {
    rows.push_back(flag("backend " + o.backend, o.backend, false,
                        "no '" + o.backend + "' backend for the linear layer (it runs on: " +
                            linear_backend_names() + "): " + b.status().message()));
    return list;
  }
  if (const Status st = b.value()->available(); !st.is_ok()) {
    rows.push_back(flag("backend " + o.backend + " usable", o.backend, false, st.message()));
    return list;
  }
  list.push_back(b.value());
  return list;
}

// --require CAP: a linear backend or recipe must be usable / known; "cuda" (a capability of the
// build and machine) must be usable here, as for every op: the linear layer itself has no CUDA
// backend, which the row says. Capabilities of other ops (an MoE recipe, an activation) are
// checked by those ops' validators.
void require_rows(const ValidateOptions& o, std::vector<ValidateRow>& rows) {
  for (const std::string& cap : o.require) {
    if (auto b = find_linear_backend(cap); b.is_ok()) {
      const Status st = b.value()->available();
      rows.push_back(flag("require " + cap, cap, st.is_ok(), st.is_ok() ? "available" : st.message()));
    } else if (parse_linear_recipe(cap).is_ok()) {
      rows.push_back(flag("require " + cap, "-", true, "recipe supported by every linear backend"));
    } else if (cap == "cuda") {
      auto m = find_moe_backend("cuda");
      const Status st = m.is_ok() ? m.value()->available() : m.status();
      rows.push_back(flag("require cuda", "cuda", st.is_ok(),
                          st.is_ok() ? "CUDA usable (the linear layer has no CUDA backend yet; its CPU backends ran)"
                                     : "CUDA is not usable here: " + st.message()));
    }
  }
}

std::vector<ValidateRow> run_linear_validation(const ValidateOptions& o) {
  std::vector<ValidateRow> rows;
  require_rows(o, rows);
  const auto backends = backends_of(o, rows);
  const bool smoke = o.suite == "smoke", all = o.suite == "all";
  const uint64_t seed = o.seed;
  std::vector<LinCase> cases;
  if (smoke || all || o.suite == "real") {
    cases.push_back(make("tiny", 32, 1, 1, LinearRecipe::kW8A16, OutDType::kFP32, false, seed));
    cases.push_back(make("odd", 96, 37, 3, LinearRecipe::kW8A8, OutDType::kFP32, true, seed + 1));
    cases.push_back(make("odd", 160, 50, 9, LinearRecipe::kW8A16, OutDType::kBF16, true, seed + 2));
    cases.push_back(make("odd", 224, 129, 40, LinearRecipe::kW8A8, OutDType::kFP16, false, seed + 3));
    cases.push_back(make("odd", 160, 37, 3, LinearRecipe::kW16A16, OutDType::kBF16, true, seed + 12));
    cases.push_back(make("odd", 96, 50, 40, LinearRecipe::kW16A16, OutDType::kFP32, false, seed + 13));
    if (!smoke) {
      cases.push_back(make("rows", 96, 40, 4096, LinearRecipe::kW8A16, OutDType::kFP32, true, seed + 4));
      cases.push_back(make("rows", 96, 40, 4096, LinearRecipe::kW8A8, OutDType::kFP32, true, seed + 5));
      cases.push_back(make("seed kda o_proj", 1536, 7168, 1, LinearRecipe::kW8A8, OutDType::kBF16, false, seed + 6));
      cases.push_back(make("seed kda o_proj", 1536, 7168, 8, LinearRecipe::kW8A8, OutDType::kFP32, false, seed + 7));
      cases.push_back(make("latent down", 7168, 3584, 2, LinearRecipe::kW8A16, OutDType::kFP32, false, seed + 8));
      cases.push_back(make("latent up", 3584, 7168, 2, LinearRecipe::kW8A8, OutDType::kFP32, false, seed + 9));
      cases.push_back(make("kimi-linear q", 2304, 4096, 16, LinearRecipe::kW8A16, OutDType::kFP32, true, seed + 10));
      cases.push_back(make("kimi-linear o", 4096, 2304, 33, LinearRecipe::kW8A16, OutDType::kBF16, false, seed + 11));
      cases.push_back(make("rows", 96, 40, 4096, LinearRecipe::kW16A16, OutDType::kFP32, true, seed + 14));
      cases.push_back(make("kimi-linear q", 2304, 4096, 1, LinearRecipe::kW16A16, OutDType::kBF16, false, seed + 15));
      cases.push_back(make("kimi-linear o", 4096, 2304, 24, LinearRecipe::kW16A16, OutDType::kBF16, false, seed + 16));
    }
  }
  if (all || o.suite == "nonfinite") {
    for (const auto r : {LinearRecipe::kW8A16, LinearRecipe::kW8A8, LinearRecipe::kW16A16}) {
      LinCase c = make("nonfinite", 128, 48, 12, r, OutDType::kFP32, true, seed + 20);
      const int64_t k = c.p.k;
      c.x[0 * k + 5] = 0x7FC0;                                  // NaN: the row is NaN
      c.x[1 * k + 9] = bf16_from_f32(INFINITY);                 // +Inf: +-Inf / NaN per output
      c.x[2 * k + 3] = bf16_from_f32(-INFINITY);
      c.x[3 * k + 7] = bf16_from_f32(std::ldexp(1.0f, 118));   // huge: not for VDPBF16PS
      c.x[4 * k + 1] = bf16_from_f32(std::ldexp(1.0f, -120));  // tiny: not for VDPBF16PS
      c.x[5 * k + 2] = 0x0001;                                  // BF16 subnormal
      for (int64_t i = 0; i < k; ++i) c.x[6 * k + i] = 0;       // zero row
      cases.push_back(std::move(c));
    }
  }
  for (const auto& c : cases)
    for (const auto* b : backends) {
      // The reference backend is slow: it runs the small cases only.
      if (b->name == "reference" && c.m * c.p.n * c.p.k > (int64_t{1} << 24)) continue;
      rows.push_back(check(c, *b, o.options_for(b->name)));
    }
  if (all || o.suite == "determinism") {
    const LinCase c = make("determinism", 288, 129, 40, LinearRecipe::kW8A8, OutDType::kBF16, true, seed + 30);
    const LinCase d = make("determinism", 288, 129, 5, LinearRecipe::kW8A16, OutDType::kFP32, true, seed + 31);
    const LinCase e = make("determinism", 288, 129, 40, LinearRecipe::kW16A16, OutDType::kBF16, true, seed + 32);
    for (const LinCase* cc : {&c, &d, &e}) {
      ValidateRow row;
      row.op = "linear";
      row.case_name = row_name(*cc) + " threads 1,2,3 x isa";
      row.backend = "cpu";
      std::string first;
      row.pass = true;
      auto cpu_b = find_linear_backend("cpu");
      for (int l = 0; l <= static_cast<int>(best_isa_level()) && row.pass; ++l)
        for (const int t : {1, 2, 3}) {
          BackendOptions bo;
          bo.threads = t;
          bo.isa = static_cast<IsaLevel>(l);
          std::vector<uint8_t> out(static_cast<size_t>(cc->m * cc->p.n * out_dtype_size(cc->p.out_dtype)));
          if (auto st = run_linear(*cpu_b.value(), cc->p, cc->view(), cc->m, cc->x, out, bo); !st.is_ok()) {
            row.pass = false;
            row.note = st.to_string();
            break;
          }
          const std::string dg = sha256_hex(out);
          if (first.empty()) first = dg;
          if (dg != first) {
            row.pass = false;
            row.note = std::string("isa ") + isa_level_name(static_cast<IsaLevel>(l)) + " threads " +
                       std::to_string(t) + " differs";
          }
        }
      row.digest = first;
      if (row.pass) row.note = "one digest on every level up to " + std::string(isa_level_name(best_isa_level()));
      rows.push_back(row);
    }
  }
  return rows;
}

}  // namespace

std::vector<ValidateRow> validate_linear(const ValidateOptions& o) { return run_linear_validation(o); }

}  // namespace k3::harness
