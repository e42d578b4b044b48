// Typed, range-checked lookups in one JSON object of an untrusted document (config.json): every
// error names the key (and its other spelling), the object and the file. Shared by the MoE
// checkpoint config (k3/checkpoint.hpp) and the model runner (k3/model.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/io/json_guard.hpp"
#include "k3/status.hpp"

namespace k3::detail {

using Json = nlohmann::json;

// Looks keys up in one JSON object; errors name the key (with its other spelling), the object
// and the file.
class Keys {
 public:
  Keys(const Json& obj, std::string where) : obj_(obj), where_(std::move(where)) {}

  // The first present spelling, or nullptr.
  const Json* find(const char* key, const char* alt = nullptr) const {
    if (auto it = obj_.find(key); it != obj_.end()) return &*it;
    if (alt) {
      if (auto it = obj_.find(alt); it != obj_.end()) return &*it;
    }
    return nullptr;
  }
  Status missing(const char* key, const char* alt) const {
    return invalid_argument(where_ + " lacks \"" + key + "\"" + (alt ? std::string(" (or \"") + alt + "\")" : ""));
  }
  Status mistyped(const char* key, const Json& v, const char* want) const {
    return invalid_argument(where_ + ": \"" + key + "\" = " + detail::json_quote(v) + " must be " + want);
  }

  Status get_int(int64_t* out, int64_t lo, int64_t hi, const char* key, const char* alt = nullptr) const {
    const Json* v = find(key, alt);
    if (!v) return missing(key, alt);
    const char* name = obj_.contains(key) ? key : alt;
    if (!v->is_number_integer() || (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi)) ||
        v->get<int64_t>() < lo || v->get<int64_t>() > hi) {
      return mistyped(name, *v, ("an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]").c_str());
    }
    *out = v->get<int64_t>();
    return Status::ok();
  }
  Status get_int(int* out, int64_t lo, int64_t hi, const char* key, const char* alt = nullptr) const {
    int64_t v = 0;
    K3_RETURN_IF_ERROR(get_int(&v, lo, hi, key, alt));
    *out = static_cast<int>(v);
    return Status::ok();
  }
  Status get_float(float* out, const char* key, const char* alt = nullptr) const {
    const Json* v = find(key, alt);
    if (!v) return missing(key, alt);
    // Range-checked as a double first: converting a double beyond FLT_MAX to float is undefined.
    if (!v->is_number() || !std::isfinite(v->get<double>()) ||
        std::fabs(v->get<double>()) > static_cast<double>(std::numeric_limits<float>::max())) {
      return mistyped(obj_.contains(key) ? key : alt, *v, "a finite number within the FP32 range");
    }
    *out = static_cast<float>(v->get<double>());
    return Status::ok();
  }
  // A finite number whose FP32 value lies in [lo, hi] (so it neither overflows to inf nor
  // underflows to 0 when rounded).
  Status get_float_in(float* out, float lo, float hi, const char* key) const {
    const Json* v = find(key);
    if (v != nullptr && v->is_number() && std::isfinite(v->get<double>()) &&
        !(std::fabs(v->get<double>()) <= static_cast<double>(std::numeric_limits<float>::max()))) {
      return invalid_argument(where_ + ": \"" + key + "\" = " + detail::json_quote(*v) +
                              " is outside the accepted range [" + fmt(lo) + ", " + fmt(hi) + "] (overflows FP32)");
    }
    K3_RETURN_IF_ERROR(get_float(out, key));
    const double d = v->get<double>();
    if (!(d >= static_cast<double>(lo) && d <= static_cast<double>(hi)) || !(*out >= lo && *out <= hi)) {
      return invalid_argument(where_ + ": \"" + key + "\" = " + detail::json_quote(*find(key)) +
                              " is outside the accepted range [" + fmt(lo) + ", " + fmt(hi) + "]" +
                              (*out == 0.0f && d != 0.0 ? " (underflows to 0 in FP32)" : ""));
    }
    return Status::ok();
  }
  static std::string fmt(float v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
    return buf;
  }
  Status get_bool(bool* out, const char* key, const char* alt = nullptr) const {
    const Json* v = find(key, alt);
    if (!v) return missing(key, alt);
    if (!v->is_boolean()) return mistyped(obj_.contains(key) ? key : alt, *v, "true or false");
    *out = v->get<bool>();
    return Status::ok();
  }
  Status get_string(std::string* out, const char* key, const char* alt = nullptr) const {
    const Json* v = find(key, alt);
    if (!v) return missing(key, alt);
    if (!v->is_string()) return mistyped(obj_.contains(key) ? key : alt, *v, "a string");
    *out = v->get<std::string>();
    return Status::ok();
  }
  const std::string& where() const { return where_; }

 private:
  const Json& obj_;
  std::string where_;
};

}  // namespace k3::detail
