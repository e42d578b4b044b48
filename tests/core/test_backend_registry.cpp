// The backend registry (k3/backend.hpp): order, lookup errors, defaults, the options passed in,
// and that each MoE / KDA backend computes what its own API computes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <vector>

#include "k3/backend.hpp"
#include "k3/cpu_kda.hpp"
#include "k3/kda_ops.hpp"
#include "k3/cpu_moe.hpp"
#include "k3/linear.hpp"
#include "k3/harness/kda_case.hpp"
#include "k3/harness/moe_case.hpp"

namespace k3 {
namespace {

MoeCase small_case(uint64_t seed) {
  MoeCaseSpec s;
  s.problem.shape = {64, 96, 8, 2, 1, 0};
  s.problem.out_dtype = OutDType::kFP32;
  s.m = 5;
  s.seed = seed;
  auto c = make_moe_case(s);
  EXPECT_TRUE(c.is_ok()) << c.status().to_string();
  return std::move(c.value());
}

TEST(BackendRegistry, MoeBackendsAreOrderedNamedAndFindable) {
  const auto list = moe_backends();
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].name, "cpu");
  EXPECT_EQ(list[1].name, "cuda");
  EXPECT_EQ(list[2].name, "reference");
  for (size_t i = 1; i < list.size(); ++i) EXPECT_GT(list[i - 1].priority, list[i].priority);
  for (const auto& b : list) {
    ASSERT_TRUE(b.available && b.supports && b.prepare) << b.name;
    auto f = find_moe_backend(b.name);
    ASSERT_TRUE(f.is_ok());
    EXPECT_EQ(f.value(), &b);
  }
  auto bad = find_moe_backend("tpu");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'tpu'"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("cpu, cuda, reference"), std::string::npos) << bad.status().message();
  EXPECT_TRUE(default_moe_backend().available().is_ok());
  EXPECT_EQ(default_moe_backend().name, "cpu");  // priority 10 and always usable
}

TEST(BackendRegistry, CpuAndReferenceAgreeAndThreadsDoNotChangeBits) {
  const MoeCase c = small_case(5);
  const int64_t bytes = c.m * 64 * 4;
  std::vector<uint8_t> ref(static_cast<size_t>(bytes)), a(ref.size()), b(ref.size());
  ASSERT_TRUE(run_moe(*find_moe_backend("reference").value(), c.problem, c.weights(), c.inputs(), ref).is_ok());
  BackendOptions one, two;
  one.threads = 1;
  two.threads = 2;
  const MoeBackend& cpu = *find_moe_backend("cpu").value();
  ASSERT_TRUE(run_moe(cpu, c.problem, c.weights(), c.inputs(), a, one).is_ok());
  ASSERT_TRUE(run_moe(cpu, c.problem, c.weights(), c.inputs(), b, two).is_ok());
  EXPECT_EQ(a, b);
  double err = 0, norm = 0;
  for (int64_t i = 0; i < c.m * 64; ++i) {
    float x, y;
    std::memcpy(&x, a.data() + 4 * i, 4);
    std::memcpy(&y, ref.data() + 4 * i, 4);
    err += (x - y) * (x - y);
    norm += y * y;
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-5);
}

// A prepared layer computes what the one-shot call computes, call after call, for every M up to
// its max_tokens, and says what runs.
TEST(BackendRegistry, PreparedMoeLayersGiveTheOneShotBitsAndDescribeWhatRuns) {
  const MoeCase c = small_case(11);
  for (const char* name : {"cpu", "reference"}) {
    const MoeBackend& b = *find_moe_backend(name).value();
    BackendOptions o;
    o.threads = 2;
    o.max_tokens = 5;
    auto layer = prepare_moe(b, c.problem, c.weights(), o);
    ASSERT_TRUE(layer.is_ok()) << name << ": " << layer.status().to_string();
    const PreparedMoe& l = **layer;
    EXPECT_EQ(l.backend(), name);
    EXPECT_EQ(l.max_tokens(), 5);
    EXPECT_EQ(l.problem().shape.hidden, 64);
    EXPECT_FALSE(l.describe().empty());
    EXPECT_EQ(l.kernel(), std::string(name) == "cpu" ? std::string(cpu::plan(c.problem, {.threads = 2, .isa = {}}).value().blocking.kernel)
                                                     : std::string("fp64 oracle"));
    std::vector<uint8_t> ws(static_cast<size_t>(l.workspace_bytes()));
    for (int64_t m : {5, 1, 3}) {  // several calls on one handle, M below max_tokens
      const MoeInputsView in{m, std::span<const uint16_t>(c.x.data(), static_cast<size_t>(m * 64)),
                             std::span<const int32_t>(c.topk_ids.data(), static_cast<size_t>(m * 2)),
                             std::span<const float>(c.topk_weights.data(), static_cast<size_t>(m * 2))};
      std::vector<uint8_t> want(static_cast<size_t>(m * 64 * 4)), got(want.size());
      ASSERT_TRUE(run_moe(b, c.problem, c.weights(), in, want, o).is_ok());
      ASSERT_TRUE(l.run(in, ws, got).is_ok()) << name << " m " << m;
      EXPECT_EQ(want, got) << name << " m " << m;
    }
    // Errors name the argument, the limit and the value.
    std::vector<uint8_t> out6(static_cast<size_t>(6 * 64 * 4));
    std::vector<uint16_t> x6(6 * 64);
    std::vector<int32_t> ids6(12, 0);
    std::vector<float> w6(12, 0.5f);
    Status st = l.run({6, x6, ids6, w6}, ws, out6);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << name;
    EXPECT_NE(st.message().find("m = 6 "), std::string::npos) << name << ": " << st.message();
    EXPECT_NE(st.message().find("max_tokens = 5"), std::string::npos) << name << ": " << st.message();
    std::vector<uint8_t> short_out(10);
    st = l.run(c.inputs(), ws, short_out);
    EXPECT_NE(st.message().find("out has 10 bytes"), std::string::npos) << name << ": " << st.message();
    ids6[3] = 8;  // E = 8
    st = l.run({5, std::span<const uint16_t>(x6).first(5 * 64), std::span<const int32_t>(ids6).first(10),
                std::span<const float>(w6).first(10)},
               ws, std::span<uint8_t>(out6).first(5 * 64 * 4));
    EXPECT_NE(st.message().find("topk_ids[1, 1] = 8"), std::string::npos) << name << ": " << st.message();
  }
  // A workspace below workspace_bytes() is refused (the cpu backend needs one).
  auto cpu_layer = prepare_moe(*find_moe_backend("cpu").value(), c.problem, c.weights());
  ASSERT_TRUE(cpu_layer.is_ok());
  EXPECT_EQ((*cpu_layer)->max_tokens(), 8192);  // the default
  ASSERT_GT((*cpu_layer)->workspace_bytes(), 0);
  std::vector<uint8_t> ws(16), out(static_cast<size_t>(c.m * 64 * 4));
  const Status st = (*cpu_layer)->run(c.inputs(), ws, out);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("workspace"), std::string::npos) << st.message();
}

TEST(BackendRegistry, PrepareMoeRefusesBadOptionsAndWeightsNamingThem) {
  const MoeCase c = small_case(12);
  const MoeBackend& cpu = *find_moe_backend("cpu").value();
  BackendOptions o;
  o.max_tokens = -1;
  auto r = prepare_moe(cpu, c.problem, c.weights(), o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("max_tokens = -1 must be in [1, 2^24]"), std::string::npos) << r.status().message();
  o.max_tokens = 0;
  o.path = "prefill";
  r = prepare_moe(cpu, c.problem, c.weights(), o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("path = 'prefill'"), std::string::npos) << r.status().message();
  MoeWeightsView w = c.weights();
  w.fc2_scale = w.fc2_scale.subspan(1);
  for (const char* name : {"cpu", "reference"}) {
    r = prepare_moe(*find_moe_backend(name).value(), c.problem, w);
    ASSERT_FALSE(r.is_ok()) << name;
    EXPECT_NE(r.status().message().find("fc2_scale [E_local, K, N/32] has"), std::string::npos) << r.status().message();
  }
}

TEST(BackendRegistry, OptionsReachTheCpuBackend) {
  const MoeCase c = small_case(6);
  std::vector<uint8_t> out(static_cast<size_t>(c.m * 64 * 4));
  const MoeBackend& cpu = *find_moe_backend("cpu").value();
  BackendOptions o;
  o.threads = 100000;  // out of range: must be refused by the plan, naming the value
  Status st = run_moe(cpu, c.problem, c.weights(), c.inputs(), out, o);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("100000"), std::string::npos) << st.message();
  if (best_isa_level() != IsaLevel::kAvx512Bf16) {
    BackendOptions hi;
    hi.isa = IsaLevel::kAvx512Bf16;
    st = run_moe(cpu, c.problem, c.weights(), c.inputs(), out, hi);
    ASSERT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("avx512bf16"), std::string::npos) << st.message();
  }
  BackendOptions scalar;
  scalar.isa = IsaLevel::kScalar;
  std::vector<uint8_t> s(out.size()), d(out.size());
  ASSERT_TRUE(run_moe(cpu, c.problem, c.weights(), c.inputs(), s, scalar).is_ok());
  ASSERT_TRUE(run_moe(cpu, c.problem, c.weights(), c.inputs(), d).is_ok());
  if (best_isa_level() != IsaLevel::kAvx512Bf16) {
    EXPECT_EQ(s, d);  // the FP32 levels are bit-identical
  }
}

TEST(BackendRegistry, RunMoeChecksBuffersAndAvailability) {
  const MoeCase c = small_case(7);
  std::vector<uint8_t> out(static_cast<size_t>(c.m * 64 * 4 - 1));
  Status st = run_moe(*find_moe_backend("reference").value(), c.problem, c.weights(), c.inputs(), out);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("out has"), std::string::npos) << st.message();
  const MoeBackend& cuda = *find_moe_backend("cuda").value();
  if (!cuda.available().is_ok()) {  // no device (or not compiled): the reason, never a crash
    out.resize(out.size() + 1);
    st = run_moe(cuda, c.problem, c.weights(), c.inputs(), out);
    ASSERT_FALSE(st.is_ok());
    EXPECT_EQ(st.message(), cuda.available().message());
  }
}

// BackendOptions::path is a kernel path of the cuda MoE backend: the others refuse one by name
// (the k3 tool passes K3_CUDA_MOE_PATH to the cuda backend only), and a bad name for the cuda
// backend is refused naming `path` before any device is needed.
// supports() is each backend's planner's verdict on the problem and the options, not a blanket
// yes: the cpu backend refuses a thread count beyond its limit and a bad activation, the
// reference backend a bad shape or activation, both before any weight is read; run_moe says
// the same.
TEST(BackendRegistry, MoeSupportsIsThePlannersVerdict) {
  const MoeCase c = small_case(8);
  const MoeBackend& cpu = *find_moe_backend("cpu").value();
  const MoeBackend& ref = *find_moe_backend("reference").value();
  EXPECT_TRUE(cpu.supports(c.problem, {}).is_ok());
  EXPECT_TRUE(ref.supports(c.problem, {}).is_ok());
  BackendOptions many;
  many.threads = 1 << 20;
  const Status t = cpu.supports(c.problem, many);
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.message().find("threads"), std::string::npos) << t.message();
  std::vector<uint8_t> out(static_cast<size_t>(c.m * c.problem.shape.hidden * out_dtype_size(c.problem.out_dtype)));
  EXPECT_EQ(run_moe(cpu, c.problem, c.weights(), c.inputs(), out, many).message(), t.message());
  MoeProblem bad_act = c.problem;
  bad_act.activation.kind = ActivationKind::kSiTU;
  bad_act.activation.situ_beta = -1.0f;
  for (const MoeBackend* b : {&cpu, &ref}) {
    const Status st = b->supports(bad_act, {});
    ASSERT_FALSE(st.is_ok()) << b->name;
    EXPECT_NE(st.message().find("beta"), std::string::npos) << b->name << ": " << st.message();
  }
  MoeProblem bad_shape = c.problem;
  bad_shape.shape.hidden = 33;
  EXPECT_FALSE(ref.supports(bad_shape, {}).is_ok());
  EXPECT_FALSE(cpu.supports(bad_shape, {}).is_ok());
}

TEST(BackendRegistry, OnlyTheCudaMoeBackendTakesAKernelPath) {
  const MoeCase c = small_case(8);
  std::vector<uint8_t> out(static_cast<size_t>(c.m * 64 * 4));
  BackendOptions o;
  o.path = "prefill";
  for (const char* name : {"cpu", "reference"}) {
    const Status st = run_moe(*find_moe_backend(name).value(), c.problem, c.weights(), c.inputs(), out, o);
    ASSERT_FALSE(st.is_ok()) << name;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(std::string("path = 'prefill': the moe backend '") + name + "' has no kernel paths"),
              std::string::npos)
        << st.message();
  }
  const LinearProblem lp{64, 16, LinearRecipe::kW16A16, OutDType::kFP32, false};
  std::vector<uint16_t> w(64 * 16, 0x3F80), x(64, 0x3F80);
  std::vector<uint8_t> lo(16 * 4);
  const Status ls = run_linear(*find_linear_backend("cpu").value(), lp, {{}, {}, {}, w}, 1, x, lo, o);
  EXPECT_NE(ls.message().find("path = 'prefill': the linear backend 'cpu' has no kernel paths"), std::string::npos)
      << ls.message();
  o.path = {};
  ASSERT_TRUE(run_linear(*find_linear_backend("cpu").value(), lp, {{}, {}, {}, w}, 1, x, lo, o).is_ok());
  float y0;
  std::memcpy(&y0, lo.data(), 4);
  EXPECT_EQ(y0, 64.0f);  // 64 products 1 x 1
  const MoeBackend& cuda = *find_moe_backend("cuda").value();
  if (cuda.available().is_ok()) {
    o.path = "no-such-path";
    const Status st = run_moe(cuda, c.problem, c.weights(), c.inputs(), out, o);
    EXPECT_NE(st.message().find("path: "), std::string::npos) << st.message();
  }
}

// KDA's small ops are registry entries: the cpu entry is the CPU op with the options' threads,
// the reference entry the FP64 reference; a backend that cannot run says why.
TEST(BackendRegistry, KdaSmallOpsGoThroughTheRegistry) {
  const int64_t D = 64, W = 4, T = 9;
  std::vector<float> x(T * D), w(D * W), b(D), state0(D * (W - 1));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::cos(0.11f * static_cast<float>(i));
  for (size_t i = 0; i < b.size(); ++i) b[i] = 0.01f * static_cast<float>(i);
  for (size_t i = 0; i < state0.size(); ++i) state0[i] = std::sin(1.3f * static_cast<float>(i));
  const std::vector<int64_t> cu = {0, T};
  auto conv_with = [&](auto&& fn) {
    std::vector<float> y(T * D), st = state0;
    EXPECT_TRUE(fn(kda::ConvArgs{D, W, true, x, w, b, cu, st, y}).is_ok());
    y.insert(y.end(), st.begin(), st.end());
    return y;
  };
  BackendOptions two;
  two.threads = 2;
  const KdaBackend& cpu = *find_kda_backend("cpu").value();
  const KdaBackend& ref = *find_kda_backend("reference").value();
  EXPECT_EQ(conv_with([&](const kda::ConvArgs& a) { return run_kda_conv(cpu, a, two); }),
            conv_with([&](const kda::ConvArgs& a) { return kda::causal_conv1d(a, 2); }));
  EXPECT_EQ(conv_with([&](const kda::ConvArgs& a) { return run_kda_conv(ref, a); }),
            conv_with([&](const kda::ConvArgs& a) { return kda::causal_conv1d_reference(a); }));
  std::vector<float> g(T * D, 0.5f), nw(D, 1.5f), y1(T * D), y2(T * D);
  ASSERT_TRUE(run_kda_rmsnorm(cpu, {D, 1e-5f, x, g, nw, y1}, two).is_ok());
  ASSERT_TRUE(kda::gated_rmsnorm({D, 1e-5f, x, g, nw, y2}, 2).is_ok());
  EXPECT_EQ(y1, y2);
  // Errors: the op's own argument checks, a kernel path, an unusable backend.
  std::vector<float> short_y(5);
  EXPECT_EQ(run_kda_rmsnorm(cpu, {D, 1e-5f, x, g, nw, short_y}).code(), StatusCode::kInvalidArgument);
  BackendOptions path;
  path.path = "prefill";
  EXPECT_NE(run_kda_rmsnorm(cpu, {D, 1e-5f, x, g, nw, y1}, path).message().find("path = 'prefill'"), std::string::npos);
  const KdaBackend& cuda = *find_kda_backend("cuda").value();
  if (!cuda.available().is_ok()) {
    EXPECT_EQ(run_kda_rmsnorm(cuda, {D, 1e-5f, x, g, nw, y1}).message(), cuda.available().message());
  }
}

TEST(BackendRegistry, KdaBackendsSayWhatTheyCanDo) {
  const auto list = kda_backends();
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].name, "cpu");
  EXPECT_EQ(default_kda_backend().name, "cpu");
  const KdaBackend& cuda = *find_kda_backend("cuda").value();
  EXPECT_TRUE(cuda.prefill && cuda.decode && cuda.verify);  // every entry
  if (!cuda.available().is_ok()) {  // no device here, or built without CUDA: the reason
    EXPECT_TRUE(cuda.available().code() == StatusCode::kUnavailable) << cuda.available().to_string();
  }
  const KdaBackend& ref = *find_kda_backend("reference").value();
  EXPECT_TRUE(ref.prefill && !ref.decode && !ref.verify);
  auto bad = find_kda_backend("gpu");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("kda backend 'gpu'"), std::string::npos) << bad.status().message();

  // cpu prefill against the FP32 reference on a small varlen batch.
  kda::KdaConfig cfg;
  cfg.num_heads = 2;
  cfg.head_k = 16;
  cfg.head_v = 16;
  cfg.gate = kda::GateMode::kLogDecay;
  const int64_t t = 21, h = 2, k = 16;
  std::vector<float> q(t * h * k), kk(q.size()), v(q.size()), g(q.size()), beta(t * h);
  uint32_t x = 1;
  auto rnd = [&x] { x = x * 1664525u + 1013904223u; return static_cast<float>(x >> 8) / 16777216.f - 0.5f; };
  for (auto& e : q) e = rnd();
  for (auto& e : kk) e = rnd();
  for (auto& e : v) e = rnd();
  for (auto& e : g) e = -0.1f + 0.05f * rnd();
  for (auto& e : beta) e = rnd();
  const std::vector<int64_t> cu = {0, 4, 21};
  kda::KdaInputs in;
  in.q = kda::ActSpan::of(std::span<const float>(q));
  in.k = kda::ActSpan::of(std::span<const float>(kk));
  in.v = kda::ActSpan::of(std::span<const float>(v));
  in.g = g;
  in.beta = beta;
  in.cu_seqlens = cu;
  std::vector<float> o1(q.size()), o2(q.size());
  ASSERT_TRUE(ref.supports(cfg).is_ok());
  ASSERT_TRUE(ref.prefill(cfg, in, {o1, {}}, {}).is_ok());
  const KdaBackend& cpu = *find_kda_backend("cpu").value();
  ASSERT_TRUE(cpu.prefill(cfg, in, {o2, {}}, {}).is_ok());
  double err = 0, norm = 0;
  for (size_t i = 0; i < o1.size(); ++i) {
    err += (o1[i] - o2[i]) * (o1[i] - o2[i]);
    norm += o1[i] * o1[i];
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-5);
  kda::KdaConfig bad_cfg = cfg;
  bad_cfg.num_heads = 0;
  EXPECT_FALSE(cpu.supports(bad_cfg).is_ok());
}

// prepare_kda: a handle per layer that keeps the plan (cpu) or the one-shot entries (reference);
// its calls give the bits of the one-shot run_kda_* calls with the same options.
TEST(BackendRegistry, PreparedKdaLayersGiveTheOneShotBitsAndKeepThePlan) {
  kda::CaseSpec spec;
  spec.cfg.num_heads = 3;
  spec.cfg.head_k = 32;
  spec.cfg.head_v = 48;
  spec.seqlens = {9, 40, 1};
  spec.seed = 11;
  const kda::KdaCase c = kda::make_case(spec);
  const KdaBackend& cpu = *find_kda_backend("cpu").value();
  const KdaBackend& ref = *find_kda_backend("reference").value();
  for (const kda::Algorithm algo : {kda::Algorithm::kChunked, kda::Algorithm::kRecurrent}) {
    BackendOptions o;
    o.threads = 2;
    o.kda_algorithm = algo;
    auto layer = prepare_kda(cpu, spec.cfg, o);
    ASSERT_TRUE(layer.is_ok()) << layer.status().to_string();
    EXPECT_EQ((*layer)->backend(), "cpu");
    EXPECT_EQ((*layer)->config().head_v, 48);
    EXPECT_NE((*layer)->describe().find(kda::algorithm_name(algo)), std::string::npos) << (*layer)->describe();
    std::vector<uint8_t> ws(static_cast<size_t>((*layer)->workspace_bytes()));
    std::vector<float> o1(c.o_size()), f1(c.state_size()), o2(c.o_size()), f2(c.state_size());
    for (int call = 0; call < 2; ++call) {  // the handle is reusable: the same bits every call
      ASSERT_TRUE((*layer)->prefill(c.inputs(), {o1, f1}, ws).is_ok());
      ASSERT_TRUE(run_kda_prefill(cpu, spec.cfg, c.inputs(), {o2, f2}, o).is_ok());
      EXPECT_EQ(std::memcmp(o1.data(), o2.data(), o1.size() * 4), 0) << kda::algorithm_name(algo);
      EXPECT_EQ(std::memcmp(f1.data(), f2.data(), f1.size() * 4), 0) << kda::algorithm_name(algo);
    }
    if (!ws.empty()) {  // a short workspace is refused, not overrun
      std::vector<uint8_t> small(ws.size() - 1);
      EXPECT_FALSE((*layer)->prefill(c.inputs(), {o1, f1}, small).is_ok());
    }
  }
  // The reference backend keeps no plan: workspace 0, prefill as run_kda_prefill, decode refused
  // by name as by run_kda_decode.
  auto r = prepare_kda(ref, spec.cfg, {});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ((*r)->workspace_bytes(), 0);
  std::vector<float> o1(c.o_size()), f1(c.state_size()), o2(c.o_size()), f2(c.state_size());
  ASSERT_TRUE((*r)->prefill(c.inputs(), {o1, f1}, {}).is_ok());
  ASSERT_TRUE(run_kda_prefill(ref, spec.cfg, c.inputs(), {o2, f2}).is_ok());
  EXPECT_EQ(std::memcmp(o1.data(), o2.data(), o1.size() * 4), 0);
  std::vector<float> pool(c.state_size()), o(3 * 3 * 48);
  const std::vector<int32_t> idx = {0, 1, 2};
  const Status st = (*r)->decode({c.inputs(), pool, idx, o}, {});
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("kda backend 'reference' has no decode entry"), std::string::npos) << st.message();
  // Bad options and configurations are refused when preparing, naming them.
  BackendOptions bad;
  bad.threads = 100000;
  auto b = prepare_kda(cpu, spec.cfg, bad);
  ASSERT_FALSE(b.is_ok());
  EXPECT_NE(b.status().message().find("threads = 100000"), std::string::npos) << b.status().message();
  kda::KdaConfig zero = spec.cfg;
  zero.num_heads = 0;
  EXPECT_FALSE(prepare_kda(cpu, zero, {}).is_ok());
  BackendOptions with_path;
  with_path.path = "prefill";
  auto p = prepare_kda(cpu, spec.cfg, with_path);
  ASSERT_FALSE(p.is_ok());
  EXPECT_NE(p.status().message().find("has no kernel paths"), std::string::npos) << p.status().message();
}

// run_kda_prefill / _decode / _verify: the registry's checks in one place, and the KDA options
// (algorithm, SIMD level, threads) reaching the backend.
TEST(BackendRegistry, RunKdaNamesAMissingEntryAndPassesTheOptions) {
  kda::KdaConfig cfg;
  cfg.num_heads = 2;
  cfg.head_k = 16;
  cfg.head_v = 16;
  cfg.gate = kda::GateMode::kLogDecay;
  const int64_t t = 19, n = 3;
  std::vector<float> q(t * 2 * 16), kk(q.size()), v(q.size()), g(q.size()), beta(t * 2);
  uint32_t x = 7;
  auto rnd = [&x] { x = x * 1664525u + 1013904223u; return static_cast<float>(x >> 8) / 16777216.f - 0.5f; };
  for (auto& e : q) e = rnd();
  for (auto& e : kk) e = rnd();
  for (auto& e : v) e = rnd();
  for (auto& e : g) e = -0.1f + 0.05f * rnd();
  for (auto& e : beta) e = rnd();
  kda::KdaInputs in;
  in.q = kda::ActSpan::of(std::span<const float>(q));
  in.k = kda::ActSpan::of(std::span<const float>(kk));
  in.v = kda::ActSpan::of(std::span<const float>(v));
  in.g = g;
  in.beta = beta;
  const KdaBackend& ref = *find_kda_backend("reference").value();
  const KdaBackend& cpu = *find_kda_backend("cpu").value();
  const KdaBackend& cuda = *find_kda_backend("cuda").value();

  // Missing entries and an unusable backend: the reason, never a call through an empty function.
  std::vector<float> pool(4 * 2 * 16 * 16), o(n * 2 * 16);
  const std::vector<int32_t> idx = {0, 1, 2};
  kda::KdaInputs step = in;
  step.q.f32 = step.q.f32.first(n * 32);
  step.k.f32 = step.k.f32.first(n * 32);
  step.v.f32 = step.v.f32.first(n * 32);
  step.g = step.g.first(n * 32);
  step.beta = step.beta.first(n * 2);
  BackendOptions with_path;
  with_path.path = "prefill";
  Status st = run_kda_decode(cpu, cfg, {step, pool, idx, o}, with_path);
  EXPECT_NE(st.message().find("path = 'prefill': the kda backend 'cpu' has no kernel paths"), std::string::npos)
      << st.message();
  st = run_kda_decode(ref, cfg, {step, pool, idx, o});
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_EQ(st.message(), "kda backend 'reference' has no decode entry (it implements: prefill, conv, rmsnorm)");
  const std::vector<int32_t> acc = {1};
  st = run_kda_verify(ref, cfg, {step, 3, pool, idx, acc, o});
  EXPECT_NE(st.message().find("has no verify entry"), std::string::npos) << st.message();
  std::vector<float> window(4 * kda::replay_window_floats(cfg, 1).value(), 0.0f);
  const std::vector<int32_t> one_each(idx.size(), 1);
  st = run_kda_commit(ref, cfg, {1, pool, window, idx, one_each});
  EXPECT_EQ(st.message(), "kda backend 'reference' has no commit entry (it implements: prefill, conv, rmsnorm)");
  st = run_kda_verify_replay(ref, cfg, {step, 1, pool, idx, window, o});
  EXPECT_EQ(st.message(), "kda backend 'reference' has no verify_replay entry (it implements: prefill, conv, rmsnorm)");
  {  // cpu: verify_replay + commit of one token each through the registry = decode
    std::vector<float> p1 = pool, p2 = pool, o_dec(o.size()), o_rep(o.size());
    ASSERT_TRUE(run_kda_decode(cpu, cfg, {step, p1, idx, o_dec}).is_ok());
    ASSERT_TRUE(run_kda_verify_replay(cpu, cfg, {step, 1, p2, idx, window, o_rep}).is_ok());
    ASSERT_TRUE(run_kda_commit(cpu, cfg, {1, p2, window, idx, one_each}).is_ok());
    EXPECT_EQ(0, std::memcmp(p1.data(), p2.data(), p1.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(o_dec.data(), o_rep.data(), o.size() * sizeof(float)));
  }
  std::vector<float> o1(q.size()), o2(q.size());
  if (!cuda.available().is_ok()) {
    st = run_kda_prefill(cuda, cfg, in, {o1, {}});
    EXPECT_EQ(st.message(), cuda.available().message());
  }
  EXPECT_TRUE(run_kda_decode(cpu, cfg, {step, pool, idx, o}).is_ok());

  // The reference is token-recurrent: chunked is refused, recurrent accepted.
  BackendOptions chunked;
  chunked.kda_algorithm = kda::Algorithm::kChunked;
  st = run_kda_prefill(ref, cfg, in, {o1, {}}, chunked);
  EXPECT_NE(st.message().find("algorithm = chunked"), std::string::npos) << st.message();
  BackendOptions recurrent;
  recurrent.kda_algorithm = kda::Algorithm::kRecurrent;
  recurrent.threads = 3;
  ASSERT_TRUE(run_kda_prefill(ref, cfg, in, {o1, {}}, recurrent).is_ok());
  std::vector<float> want(q.size());
  ASSERT_TRUE(kda::reference_fp32(cfg, in, {want, {}}).is_ok());
  EXPECT_EQ(o1, want);

  // The cpu backend runs the algorithm and SIMD level it is given: the same bits as its own API.
  for (const auto algo : {kda::Algorithm::kRecurrent, kda::Algorithm::kChunked}) {
    BackendOptions bo;
    bo.kda_algorithm = algo;
    bo.isa = IsaLevel::kScalar;
    bo.threads = 2;
    ASSERT_TRUE(run_kda_prefill(cpu, cfg, in, {o2, {}}, bo).is_ok());
    cpu::KdaOptions co;
    co.algorithm = algo;
    co.isa = IsaLevel::kScalar;
    co.threads = 1;
    ASSERT_TRUE(cpu::prefill(cfg, in, {want, {}}, co).is_ok());
    EXPECT_EQ(o2, want) << kda::algorithm_name(algo);
  }
  BackendOptions too_many;
  too_many.threads = cpu::kKdaMaxThreads + 1;
  st = run_kda_prefill(cpu, cfg, in, {o2, {}}, too_many);
  EXPECT_NE(st.message().find("threads = 257 must be in [0, 256]"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace k3
