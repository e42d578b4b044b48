// `k3 validate --op moe`: the fused-MoE correctness matrix of docs/moe.md for every usable
// backend, against the FP64 contract oracle (tight tolerances) and, at Kimi shapes, the seeds'
// BF16 reference (recipe noise, reported as the seed metrics). Suites: smoke, real, nonfinite,
// determinism, all. See docs/moe.md.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "k3/harness/digest.hpp"
#include "k3/formats.hpp"
#include "k3/harness/moe_case.hpp"
#include "k3/harness/moe_compare.hpp"
#include "k3/moe_ref.hpp"
#include "k3/harness/validate.hpp"
#include "validate_moe_checkpoint.hpp"

namespace k3::harness {
namespace {

ValidateRow make_row(const std::string& case_name, const std::string& backend, bool pass, std::string note) {
  ValidateRow r;
  r.op = "moe";
  r.case_name = case_name;
  r.backend = backend;
  r.pass = pass;
  r.note = std::move(note);
  return r;
}

struct Selection {
  std::vector<Recipe> recipes;
  std::vector<ActivationKind> acts;
  std::vector<const MoeBackend*> backends;
};

// Recipes, activations and backends to check; option errors become FAIL rows.
Selection select(const ValidateOptions& o, std::vector<ValidateRow>& rows) {
  Selection s;
  if (o.recipe.empty()) {
    s.recipes = {Recipe::kW4A8, Recipe::kW4A16};
  } else if (auto r = parse_recipe(o.recipe); r.is_ok()) {
    s.recipes = {r.value()};
  } else {
    rows.push_back(make_row("option --recipe", "-", false, r.status().message()));
  }
  if (o.activation.empty()) {
    s.acts = {ActivationKind::kSiTU, ActivationKind::kSwiGLU, ActivationKind::kSiLU};
  } else if (auto a = parse_activation(o.activation); a.is_ok()) {
    s.acts = {a.value()};
  } else {
    rows.push_back(make_row("option --activation", "-", false, a.status().message()));
  }
  if (o.backend == "all") {
    for (const auto& b : moe_backends()) {
      if (b.available().is_ok()) s.backends.push_back(&b);
    }
  } else if (auto b = find_moe_backend(o.backend); !b.is_ok()) {
    rows.push_back(make_row("backend " + o.backend, o.backend, false, b.status().message()));
  } else if (const Status av = b.value()->available(); !av.is_ok()) {
    rows.push_back(make_row("backend " + o.backend + " available", o.backend, false, av.message()));
  } else {
    s.backends.push_back(b.value());
  }
  return s;
}

// --require CAPABILITY: a backend name must be registered and usable; a recipe or activation must
// be supported by every selected backend. Missing means FAIL.
MoeCaseSpec smoke_spec(int64_t m, RoutingPattern routing, uint64_t seed);  // below

void check_requirements(const ValidateOptions& o, const Selection& sel, std::vector<ValidateRow>& rows) {
  for (const std::string& cap : o.require) {
    const auto recipe = parse_recipe(cap);
    const auto act = parse_activation(cap);
    if (!recipe.is_ok() && !act.is_ok()) {
      auto b = find_moe_backend(cap);
      if (!b.is_ok()) {
        const bool known_kind = cap == "cpu" || cap == "cuda" || cap == "reference";
        rows.push_back(make_row("require " + cap, cap, false,
                                known_kind ? "no '" + cap + "' fused-MoE backend in this build: " + b.status().message()
                                           : "unknown capability '" + cap +
                                                 "' (known: a backend name, w4a8, w4a16, situ, swiglu, silu)"));
        continue;
      }
      const Status av = b.value()->available();
      rows.push_back(make_row("require " + cap, cap, av.is_ok(), av.is_ok() ? "available" : av.message()));
      continue;
    }
    if (sel.backends.empty()) rows.push_back(make_row("require " + cap, "-", false, "no backend selected"));
    for (const MoeBackend* b : sel.backends) {
      MoeProblem p;
      p.shape = smoke_spec(1, RoutingPattern::kUniform, 0).problem.shape;  // a problem every backend should take
      if (recipe.is_ok()) p.recipe = recipe.value();
      if (act.is_ok()) p.activation.kind = act.value();
      const Status st = b->supports ? b->supports(p, o.options_for(b->name)) : Status::ok();
      rows.push_back(make_row("require " + cap, b->name, st.is_ok(), st.is_ok() ? "supported" : st.message()));
    }
  }
}

struct Runner {
  const ValidateOptions& opts;
  const Selection& sel;
  std::vector<ValidateRow>& rows;

  static std::string label(const std::string& name, const MoeProblem& p) {
    return name + " " + recipe_name(p.recipe) + " " + activation_name(p.activation.kind) + " " +
           out_dtype_name(p.out_dtype);
  }

  // Runs one backend (`threads` > 0 overrides the options' count); on error adds a FAIL row and
  // returns false.
  bool run_backend(const MoeBackend& b, const MoeCase& c, const std::string& name, std::vector<uint8_t>& out,
                   int threads = 0) {
    out.assign(c.m * c.problem.shape.hidden * out_dtype_size(c.problem.out_dtype), 0xA5);  // poison
    BackendOptions bo = opts.options_for(b.name);
    if (threads > 0) bo.threads = threads;
    const Status st = opts.explained(k3::run_moe(b, c.problem, c.weights(), c.inputs(), out, bo), bo);
    if (st.code() == StatusCode::kInexact) {
      // The backend cannot hold these operands exactly and says so instead of rounding them (the
      // CUDA path's BF16 weight registers, docs/cuda_moe.md): a documented refusal, not a wrong
      // answer. SKIP with its reason; any other error fails.
      ValidateRow r = make_row(label(name, c.problem), b.name, true, "skipped, refused as inexact: " + st.message());
      r.skipped = true;
      rows.push_back(r);
      return false;
    }
    if (!st.is_ok()) rows.push_back(make_row(label(name, c.problem), b.name, false, st.to_string()));
    return st.is_ok();
  }

  bool supported(const MoeBackend& b, const MoeCase& c, const std::string& name) {
    if (!b.supports) return true;
    const BackendOptions bo = opts.options_for(b.name);
    const Status st = opts.explained(b.supports(c.problem, bo), bo);
    if (!st.is_ok()) {
      ValidateRow r = make_row(label(name, c.problem), b.name, true,
                               "skipped, not supported: " + st.message() + " (--require makes this fail)");
      r.skipped = true;
      rows.push_back(r);
    }
    return st.is_ok();
  }

  // Every selected backend against the contract oracle; with `seed`, also against the BF16
  // reference (the seeds' metrics).
  void check(const std::string& name, const MoeCase& c, bool seed) {
    std::vector<double> oracle(c.m * c.problem.shape.hidden), ref(seed ? oracle.size() : 0);
    std::vector<bool> beyond;  // rows whose FP32 class the oracle cannot predict (moe_ref.hpp)
    const Status st = seed ? moe_oracles(c.problem, c.weights(), c.inputs(), oracle, ref, &beyond)
                           : moe_oracle(c.problem, c.weights(), c.inputs(), OracleKind::kContract, oracle, &beyond);
    if (!st.is_ok()) {
      rows.push_back(make_row(label(name, c.problem), "oracle", false, st.to_string()));
      return;
    }
    const auto zero_rows = rows_without_local_slot(c.problem.shape, c.inputs());
    for (const MoeBackend* b : sel.backends) {
      std::vector<uint8_t> out;
      if (!supported(*b, c, name) || !run_backend(*b, c, name, out)) continue;
      auto add = [&](const std::string& case_name, const std::vector<double>& against, const MoeTolerance& tol,
                     bool check_zero_rows) {
        const auto cmp = compare_moe_output(out, c.problem.out_dtype, against,
                                            check_zero_rows ? zero_rows : std::vector<bool>{}, beyond);
        if (!cmp.is_ok()) {
          rows.push_back(make_row(case_name, b->name, false, cmp.status().to_string()));
          return;
        }
        const MoeMetrics& m = cmp.value();
        std::string why;
        const bool ok = within(m, tol, &why);
        ValidateRow r = make_row(case_name, b->name, ok, why + "; " + m.summary());
        r.cosine = m.cosine;
        r.nrmse = m.nrmse;
        r.max_abs = m.max_abs;
        r.digest = sha256_hex(out);
        rows.push_back(r);
      };
      add(label(name, c.problem), oracle, contract_tolerance(c.problem.out_dtype), true);
      if (seed) add(label(name, c.problem) + " vs ref", ref, seed_tolerance(c.problem.recipe), false);
    }
  }

  // Every selected recipe x activation of a case.
  void check_all(const std::string& name, MoeCase& c, bool seed) {
    for (Recipe r : sel.recipes) {
      for (ActivationKind a : sel.acts) {
        c.problem.recipe = r;
        c.problem.activation.kind = a;
        opts.report("moe: " + name + " " + recipe_name(r) + " " + activation_name(a));
        check(name, c, seed);
      }
    }
  }
};

MoeCaseSpec smoke_spec(int64_t m, RoutingPattern routing, uint64_t seed) {
  MoeCaseSpec s;
  s.problem.shape = {96, 160, 10, 3, 1, 0};  // K 96, N 160, E 10, top-3: odd multiples of 32
  s.m = m;
  s.routing = routing;
  s.seed = seed;
  return s;
}

void smoke(const ValidateOptions& o, Runner& run) {
  struct Def {
    const char* name;
    MoeCaseSpec spec;
    OutDType dtype;
  };
  std::vector<Def> defs = {
      {"smoke m1 uniform", smoke_spec(1, RoutingPattern::kUniform, o.seed), OutDType::kBF16},
      {"smoke m2 uniform", smoke_spec(2, RoutingPattern::kUniform, o.seed + 1), OutDType::kFP16},
      {"smoke m8 uniform", smoke_spec(8, RoutingPattern::kUniform, o.seed + 2), OutDType::kFP32},
      {"smoke m32 uniform", smoke_spec(32, RoutingPattern::kUniform, o.seed + 3), OutDType::kBF16},
      {"smoke m32 skewed", smoke_spec(32, RoutingPattern::kSkewed, o.seed + 4), OutDType::kBF16},
      {"smoke m32 empty-expert", smoke_spec(32, RoutingPattern::kEmptyExpert, o.seed + 5), OutDType::kBF16},
      {"smoke m32 masked", smoke_spec(32, RoutingPattern::kMasked, o.seed + 6), OutDType::kBF16},
  };
  MoeCaseSpec ep = smoke_spec(32, RoutingPattern::kUniform, o.seed + 7);
  ep.problem.shape.ep_size = 2;
  ep.problem.shape.ep_rank = 1;
  defs.push_back({"smoke m32 ep2r1 uniform", ep, OutDType::kBF16});
  ep.problem.shape.ep_rank = 0;
  ep.routing = RoutingPattern::kEpMixed;
  ep.local_slots = 2;
  defs.push_back({"smoke m32 ep2r0 mixed-2of3", ep, OutDType::kFP32});
  ep.problem.shape.ep_size = 3;  // an uneven partition: 10 experts as 4 + 3 + 3, rank 2 holds [7, 10)
  ep.problem.shape.ep_rank = 2;
  defs.push_back({"smoke m32 ep3r2 mixed-2of3", ep, OutDType::kBF16});
  MoeCaseSpec ov = smoke_spec(19, RoutingPattern::kUniform, o.seed + 8);
  ov.situ_overrides = true;
  defs.push_back({"smoke m19 situ-per-expert", ov, OutDType::kBF16});
  for (auto& d : defs) {
    d.spec.problem.out_dtype = d.dtype;
    auto c = make_moe_case(d.spec);
    if (!c.is_ok()) {
      run.rows.push_back(make_row(d.name, "-", false, c.status().to_string()));
      continue;
    }
    run.check_all(d.name, c.value(), false);
  }
}

// Kimi-K3 EP32 rank 7: K 3584, N 3072, E_local 28 of 896, top-16 with 8 local slots per token.
void real(const ValidateOptions& o, Runner& run) {
  MoeCaseSpec s;
  s.problem.shape = {3584, 3072, 896, 16, 32, 7};
  s.routing = RoutingPattern::kEpMixed;
  s.local_slots = 8;
  s.seed = o.seed + 100;
  s.m = 1;
  auto c = make_moe_case(s);
  if (!c.is_ok()) {
    run.rows.push_back(make_row("real ep32r7", "-", false, c.status().to_string()));
    return;
  }
  run.check_all("real ep32r7 m1", c.value(), true);
  s.m = 128;
  const Status st = regenerate_inputs(s, c.value());
  if (!st.is_ok()) {
    run.rows.push_back(make_row("real ep32r7 m128", "-", false, st.to_string()));
    return;
  }
  run.check_all("real ep32r7 m128", c.value(), true);
}

void nonfinite(const ValidateOptions& o, Runner& run) {
  // NaN, +Inf, -Inf and the largest finite BF16 in x (tokens 1..4); token 0 and 5..7 stay finite.
  auto c = make_moe_case(smoke_spec(8, RoutingPattern::kUniform, o.seed + 200));
  if (!c.is_ok()) {
    run.rows.push_back(make_row("nonfinite", "-", false, c.status().to_string()));
    return;
  }
  const int64_t k = c->problem.shape.hidden;
  c->x[1 * k + 5] = 0x7FC0;   // NaN
  c->x[2 * k + 40] = 0x7F80;  // +Inf
  c->x[3 * k + 70] = 0xFF80;  // -Inf
  c->x[4 * k + 0] = 0x7F7F;   // 3.39e38, the largest finite BF16
  run.check_all("nonfinite x nan/inf/max", c.value(), false);
  // NaN / Inf routing weights on masked and remote slots must be ignored (EP2 rank 0).
  MoeCaseSpec s = smoke_spec(16, RoutingPattern::kMasked, o.seed + 201);
  s.problem.shape.ep_size = 2;
  auto e = make_moe_case(s);
  if (!e.is_ok()) {
    run.rows.push_back(make_row("nonfinite", "-", false, e.status().to_string()));
    return;
  }
  for (size_t i = 0; i < e->topk_ids.size(); ++i) {
    if (e->topk_ids[i] < 0) e->topk_weights[i] = NAN;
    else if (e->topk_ids[i] >= e->problem.shape.local_experts()) e->topk_weights[i] = INFINITY;
  }
  run.check_all("nonfinite ignored-w nan/inf", e.value(), false);
  // A NaN weight on a local slot poisons exactly its token's row.
  for (size_t i = 0; i < e->topk_ids.size(); ++i) {
    if (e->topk_ids[i] >= 0 && e->topk_ids[i] < e->problem.shape.local_experts()) {
      e->topk_weights[i] = NAN;
      break;
    }
  }
  run.check_all("nonfinite local-w nan", e.value(), false);
  // Weight elements whose FP32 value overflows: local expert 0's gate row 5 gets +6 * 2^127 (+Inf)
  // at element 35, which meets x = 0 in token 0 (Inf * 0 = NaN) and nonzero x elsewhere (+-Inf);
  // local expert 1's FC2 row 33 gets -4 * 2^127 (-Inf) at element 0. Tokens routed to neither stay finite.
  auto w = make_moe_case(smoke_spec(8, RoutingPattern::kUniform, o.seed + 202));
  if (!w.is_ok()) {
    run.rows.push_back(make_row("nonfinite", "-", false, w.status().to_string()));
    return;
  }
  const int64_t wk = w->problem.shape.hidden, wn = w->problem.shape.intermediate;
  const int64_t row1 = 5, row2 = 1 * wk + 33;
  w->fc1_scale[static_cast<size_t>(row1 * (wk / 32) + 1)] = 254;
  uint8_t& b1 = w->fc1_q[static_cast<size_t>(row1 * (wk / 2) + 16 + 1)];  // block 1, element 3 (high nibble)
  b1 = static_cast<uint8_t>((b1 & 0x0F) | 0x70);
  w->fc2_scale[static_cast<size_t>(row2 * (wn / 32))] = 254;
  uint8_t& b2 = w->fc2_q[static_cast<size_t>(row2 * (wn / 2))];  // block 0, element 0 (low nibble)
  b2 = static_cast<uint8_t>((b2 & 0xF0) | 0xE);
  w->topk_ids[0] = static_cast<int32_t>(w->problem.shape.first_local_expert());  // token 0 meets expert 0
  w->x[35] = 0;
  run.check_all("nonfinite w-overflow inf*0", w.value(), false);
}

// Three runs (1, 2 and 3 threads, BackendOptions::threads) must give the same bytes.
void determinism(const ValidateOptions& o, Runner& run) {
  MoeCaseSpec s;
  s.problem.shape = {512, 256, 16, 4, 1, 0};
  s.m = 64;
  s.routing = RoutingPattern::kSkewed;
  s.seed = o.seed + 300;
  auto c = make_moe_case(s);
  if (!c.is_ok()) {
    run.rows.push_back(make_row("determinism", "-", false, c.status().to_string()));
    return;
  }
  for (Recipe r : run.sel.recipes) {
    for (ActivationKind a : run.sel.acts) {
      c->problem.recipe = r;
      c->problem.activation.kind = a;
      const std::string name = "determinism m64 x3";
      for (const MoeBackend* b : run.sel.backends) {
        if (!run.supported(*b, c.value(), name)) continue;
        std::string digests[3];
        bool ok = true;
        const int threads[3] = {1, 2, 3};
        for (int i = 0; i < 3 && ok; ++i) {
          std::vector<uint8_t> out;
          ok = run.run_backend(*b, c.value(), name, out, threads[i]);
          digests[i] = ok ? sha256_hex(out) : "";
        }
        if (!ok) continue;
        const bool same = digests[0] == digests[1] && digests[1] == digests[2];
        ValidateRow row = make_row(Runner::label(name, c->problem), b->name, same,
                                   same ? "3 runs (1, 2, 3 threads) bit-identical"
                                        : "digests differ: " + digests[0].substr(0, 12) + " " +
                                              digests[1].substr(0, 12) + " " + digests[2].substr(0, 12));
        row.digest = digests[0];
        run.rows.push_back(row);
      }
    }
  }
}

std::vector<ValidateRow> run_moe(const ValidateOptions& o) {
  std::vector<ValidateRow> rows;
  Selection sel = select(o, rows);
  check_requirements(o, sel, rows);
  if (sel.recipes.empty() || sel.acts.empty()) return rows;
  if (sel.backends.empty()) {  // a named backend that is unknown or unusable already has its FAIL row
    if (o.backend == "all") rows.push_back(make_row("backends", "-", false, "no usable fused-MoE backend"));
    return rows;
  }
  // The options themselves (threads, SIMD level, kernel path) are checked once per backend on a
  // problem every backend takes: a bad one is a FAIL, not a SKIP on every case.
  std::erase_if(sel.backends, [&](const MoeBackend* b) {
    if (!b->supports) return false;
    MoeProblem p;
    p.shape = smoke_spec(1, RoutingPattern::kUniform, 0).problem.shape;
    const BackendOptions bo = o.options_for(b->name);
    const Status st = o.explained(b->supports(p, bo), bo);
    if (st.is_ok() || st.code() == StatusCode::kUnsupported) return false;
    rows.push_back(make_row("backend " + b->name + " options", b->name, false, st.message()));
    return true;
  });
  if (sel.backends.empty()) return rows;
  Runner run{o, sel, rows};
  const std::string& s = o.suite;
  if (s != "all" && s != "smoke" && s != "real" && s != "nonfinite" && s != "determinism") {
    rows.push_back(make_row("suite " + s, "-", false, "unknown suite (smoke, real, nonfinite, determinism, all)"));
    return rows;
  }
  if (!o.checkpoint.empty()) {
    validate_on_checkpoint(
        o, run.sel.recipes, [&](const std::string& name, MoeCase& c, bool seed) { run.check(name, c, seed); }, rows);
    return rows;
  }
  if (s == "all" || s == "smoke") smoke(o, run);
  if (s == "all" || s == "nonfinite") nonfinite(o, run);
  if (s == "all" || s == "determinism") determinism(o, run);
  if (s == "all" || s == "real") real(o, run);
  return rows;
}

}  // namespace

std::vector<ValidateRow> validate_moe(const ValidateOptions& o) { return run_moe(o); }

}  // namespace k3::harness
