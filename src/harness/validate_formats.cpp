// `k3 validate --op formats`: a self-check of the MX codecs that a user can run on any machine
// (the full test suite, including the NVIDIA cross-check, lives in tests/).
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "k3/cuda.hpp"
#include "k3/harness/digest.hpp"
#include "k3/mx.hpp"
#include "k3/harness/validate.hpp"

namespace k3::harness {
namespace {

// Independent decode of a sign/exponent/mantissa code, in double.
double decode_formula(uint32_t code, int ebits, int mbits, int bias) {
  const uint32_t sign = (code >> (ebits + mbits)) & 1u;
  const uint32_t e = (code >> mbits) & ((1u << ebits) - 1u);
  const uint32_t m = code & ((1u << mbits) - 1u);
  const double v = e == 0 ? std::ldexp(static_cast<double>(m), 1 - bias - mbits)
                          : std::ldexp(static_cast<double>((1u << mbits) | m), static_cast<int>(e) - bias - mbits);
  return sign ? -v : v;
}

ValidateRow row(const std::string& name, bool pass, std::string note, const std::string& backend = "reference") {
  ValidateRow r;
  r.op = "formats";
  r.case_name = name;
  r.backend = backend;
  r.pass = pass;
  r.note = std::move(note);
  return r;
}

ValidateRow check_codes(const char* name, int ebits, int mbits, int bias, float (*dec)(uint8_t),
                        uint8_t (*enc)(float), uint32_t ncodes, bool (*is_special)(uint32_t)) {
  int bad = 0;
  for (uint32_t c = 0; c < ncodes; ++c) {
    const float v = dec(static_cast<uint8_t>(c));
    if (is_special(c)) {
      bad += !std::isnan(v) && !std::isinf(v);
      continue;
    }
    bad += static_cast<double>(v) != decode_formula(c, ebits, mbits, bias);
    bad += enc(v) != c;
  }
  return row(std::string(name) + " codes decode/encode (" + std::to_string(ncodes) + ")", bad == 0,
             bad ? std::to_string(bad) + " mismatches" : "");
}

std::vector<ValidateRow> run_formats(const ValidateOptions& opt) {
  std::vector<ValidateRow> rows;
  const bool want_ref = opt.backend == "all" || opt.backend == "reference" || opt.backend == "cpu";
  if (want_ref) {
    rows.push_back(check_codes("e2m1", 2, 1, 1, e2m1_to_f32, e2m1_from_f32, 16, [](uint32_t) { return false; }));
    rows.push_back(check_codes("e4m3", 4, 3, 7, e4m3_to_f32, e4m3_from_f32, 256,
                               [](uint32_t c) { return (c & 0x7F) == 0x7F; }));
    rows.push_back(check_codes("e5m2", 5, 2, 15, e5m2_to_f32, e5m2_from_f32, 256,
                               [](uint32_t c) { return (c & 0x7C) == 0x7C; }));
    int bad = 0;
    for (uint32_t c = 0; c < 255; ++c) {
      const float v = e8m0_to_f32(static_cast<uint8_t>(c));
      bad += static_cast<double>(v) != std::ldexp(1.0, static_cast<int>(c) - 127);
      bad += e8m0_from_f32_ceil(v) != c || e8m0_from_f32_floor(v) != c;
    }
    bad += !std::isnan(e8m0_to_f32(0xFF));
    rows.push_back(row("e8m0 codes decode/encode (256)", bad == 0, bad ? std::to_string(bad) + " mismatches" : ""));

    // Worked examples of docs/formats.md: (element, amax, FLOOR code, RCEIL code).
    struct Example { MxElement e; float amax; int floor_code, rceil_code; };
    const Example ex[] = {{MxElement::kE4M3, 480.f, 127, 128}, {MxElement::kE4M3, 300.f, 127, 127},
                          {MxElement::kE2M1, 7.f, 127, 128}};
    bad = 0;
    for (const auto& x : ex) {
      bad += mx_scale_code(x.amax, x.e, ScaleRule::kFloor) != x.floor_code;
      bad += mx_scale_code(x.amax, x.e, ScaleRule::kRceil) != x.rceil_code;
    }
    // E2M1 amax 7 under RCEIL: 7 / 2 = 3.5 -> RNE -> 4 (8 after scaling); FLOOR: 7 -> 6.
    bad += mx_decode_element(mx_encode_element(7.f, 128, MxElement::kE2M1), 128, MxElement::kE2M1) != 8.f;
    bad += mx_decode_element(mx_encode_element(7.f, 127, MxElement::kE2M1), 127, MxElement::kE2M1) != 6.f;
    rows.push_back(row("scale rules: worked examples 480/300/7", bad == 0, bad ? "mismatch" : ""));

    // Random data: round trip error bounded by half an element ulp (RCEIL never clips).
    std::mt19937_64 rng(opt.seed);
    std::normal_distribution<float> nd(0.f, 3.f);
    const int64_t rows_n = 64, cols = 1024;
    std::vector<float> x(rows_n * cols), back(x.size());
    for (auto& v : x) v = nd(rng) * std::exp2(static_cast<float>(static_cast<int>(rng() % 40) - 20));
    for (MxElement e : {MxElement::kE2M1, MxElement::kE4M3}) {
      std::vector<uint8_t> q(rows_n * mx_row_bytes(e, cols)), s(rows_n * cols / 32);
      bool ok = mx_quantize(x, rows_n, cols, e, ScaleRule::kRceil, q, s).is_ok() &&
                mx_dequantize(q, s, rows_n, cols, e, back).is_ok();
      const double rel = e == MxElement::kE2M1 ? 0.25 : 1.0 / 16, sub = e == MxElement::kE2M1 ? 0.25 : 1.0 / 1024;
      double err2 = 0, ref2 = 0, max_abs = 0, dot = 0, back2 = 0;
      for (int64_t i = 0; i < rows_n * cols; ++i) {
        const double err = std::fabs(static_cast<double>(back[i]) - x[i]);
        const double scale = e8m0_to_f32(s[i / 32]);
        ok = ok && err <= std::max(rel * std::fabs(x[i]), sub * scale);
        err2 += err * err;
        ref2 += static_cast<double>(x[i]) * x[i];
        dot += static_cast<double>(x[i]) * back[i];
        back2 += static_cast<double>(back[i]) * back[i];
        max_abs = std::max(max_abs, err);
      }
      auto r = row(std::string(mx_element_name(e)) + " random round trip (64x1024, rceil)", ok,
                   ok ? "every error within half an element ulp" : "an error exceeds half an element ulp");
      r.nrmse = std::sqrt(err2 / ref2);
      r.cosine = dot / std::sqrt(ref2 * back2);
      r.max_abs = max_abs;
      r.digest = sha256_hex_of<uint8_t>(q);
      rows.push_back(r);
    }

    // Non-finite policy (k3/mx.hpp): Inf saturates, NaN poisons the block with scale 0xFF.
    float blk[32] = {};
    uint8_t codes[32];
    blk[0] = INFINITY;
    blk[1] = -INFINITY;
    blk[2] = 1.0f;
    const uint8_t s_inf = mx_quantize_block(blk, MxElement::kE4M3, ScaleRule::kRceil, codes);
    bad = (s_inf != 0xFE) + (codes[0] != 0x7E) + (codes[1] != 0xFE) + (codes[2] != 0);
    blk[3] = NAN;
    const uint8_t s_nan = mx_quantize_block(blk, MxElement::kE4M3, ScaleRule::kRceil, codes);
    bad += (s_nan != kE8M0Nan) + !std::isnan(mx_decode_element(codes[2], s_nan, MxElement::kE4M3));
    rows.push_back(row("non-finite: Inf saturates, NaN -> scale 0xFF", bad == 0, bad ? "policy violated" : ""));

    // Swizzled scale layout round trip with padding.
    const int64_t srows = 200, scols = 7;
    std::vector<uint8_t> lin(srows * scols), swz(swizzled_scale_size(srows, scols), 0xAA), lin2(lin.size());
    for (auto& v : lin) v = static_cast<uint8_t>(1 + rng() % 254);
    bad = !scales_to_swizzled(lin, srows, scols, swz).is_ok() || !scales_from_swizzled(swz, srows, scols, lin2).is_ok();
    bad += lin != lin2;
    int64_t nonzero = 0;
    for (auto v : swz) nonzero += v != 0;
    bad += nonzero != srows * scols;  // every padding byte is 0
    rows.push_back(row("128x4 swizzled scales round trip (200x7)", bad == 0, bad ? "mismatch or dirty padding" : ""));
  }

  // CUDA: the device kernel must match the host codec bit for bit.
  const bool want_cuda = opt.backend == "all" || opt.backend == "cuda";
  bool cuda_required = opt.backend == "cuda";
  for (const auto& c : opt.require) cuda_required = cuda_required || c == "cuda";
  if (want_cuda) {
    auto devs = cuda::devices();
    const bool usable = devs.is_ok() && devs.value()[0].runnable;
    if (usable) {
      std::mt19937_64 rng(opt.seed + 1);
      std::normal_distribution<float> nd(0.f, 1.f);
      const int64_t r = 256, c = 512;
      std::vector<float> x(r * c);
      for (auto& v : x) v = nd(rng) * 37.f;
      x[5] = INFINITY;
      x[4000] = NAN;
      for (MxElement e : {MxElement::kE2M1, MxElement::kE4M3}) {
        std::vector<uint8_t> qh(r * mx_row_bytes(e, c)), sh(r * c / 32), qd(qh.size()), sd(sh.size());
        const bool ok_h = mx_quantize(x, r, c, e, ScaleRule::kRceil, qh, sh).is_ok();
        const Status st = cuda::mx_quantize(x, r, c, e, ScaleRule::kRceil, qd, sd);
        auto rr = row(std::string(mx_element_name(e)) + " device quantize == host (256x512)",
                      ok_h && st.is_ok() && qh == qd && sh == sd, st.is_ok() ? "" : st.to_string(), "cuda");
        rr.digest = sha256_hex_of<uint8_t>(qd);
        rows.push_back(rr);
      }
    } else if (cuda_required) {
      rows.push_back(row("cuda backend present", false,
                         devs.is_ok() ? "device 0 is not a compiled architecture" : devs.status().message(), "cuda"));
    }
  }
  return rows;
}

}  // namespace

std::vector<ValidateRow> validate_formats(const ValidateOptions& o) { return run_formats(o); }

}  // namespace k3::harness
