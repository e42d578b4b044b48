// k3/status.hpp — errors are values. Every fallible public function returns Status or Result<T>;
// the message names the argument, the limit and the value. No exception crosses the public API.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace k3 {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // a value outside its documented domain (shape, dtype, option)
  kUnsupported,       // a valid configuration this build or backend cannot run
  kOutOfRange,        // an index or offset past the end of a buffer or file
  kInexact,           // a requested exact conversion would have to round (e.g. MX -> BF16)
  kIoError,           // file system or parse failure
  kUnavailable,       // a device or capability is missing at run time
  kInternal,          // a broken invariant inside k3: a bug, please report
  kCheckFailed,       // a result was computed but did not pass its check (k3 validate: exit code 1)
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok() { return {}; }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: cols = 33 must be a multiple of 32"
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
inline Status unsupported(std::string msg) { return {StatusCode::kUnsupported, std::move(msg)}; }
inline Status out_of_range(std::string msg) { return {StatusCode::kOutOfRange, std::move(msg)}; }
inline Status io_error(std::string msg) { return {StatusCode::kIoError, std::move(msg)}; }
inline Status unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg)}; }
inline Status check_failed(std::string msg) { return {StatusCode::kCheckFailed, std::move(msg)}; }

// Result<T>: a value or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOkStatus;
    return is_ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace k3

// Propagate a non-ok Status from an expression.
#define K3_RETURN_IF_ERROR(expr)              \
  do {                                        \
    ::k3::Status k3_status_ = (expr);         \
    if (!k3_status_.is_ok()) return k3_status_; \
  } while (0)

// Evaluate a Result<T> expression; on error return its Status, else move its value into `lhs`
// (a declaration such as `auto plan` or an existing variable).
#define K3_ASSIGN_OR_RETURN(lhs, expr) K3_ASSIGN_OR_RETURN_IMPL_(K3_STATUS_CONCAT_(k3_result_, __LINE__), lhs, expr)
#define K3_STATUS_CONCAT_INNER_(a, b) a##b
#define K3_STATUS_CONCAT_(a, b) K3_STATUS_CONCAT_INNER_(a, b)
#define K3_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.is_ok()) return tmp.status();          \
  lhs = std::move(tmp).value()
