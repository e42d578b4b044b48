// JSON pieces shared by the harness's benchmarks (private to src/harness).
#pragma once

#include <nlohmann/json.hpp>

#include "k3/harness/bench.hpp"
#include "k3/harness/limits.hpp"

namespace k3::harness {

inline nlohmann::json to_json(const Timing& t) {
  return {{"median_s", t.median}, {"min_s", t.min}, {"max_s", t.max}, {"iterations", t.iterations}};
}
inline nlohmann::json to_json(const MeasuredRate& r) {
  nlohmann::json j = {{"value", r.value}, {"median", r.median}, {"min", r.min}, {"max", r.max}, {"what", r.what}};
  if (r.arithmetic > 0) j["clock_x_width"] = r.arithmetic;
  if (!r.note.empty()) j["note"] = r.note;
  return j;
}
inline nlohmann::json machine(int threads, IsaLevel isa) { return nlohmann::json::parse(machine_json(threads, isa)); }

// A benchmark's document as it grows: each record goes to the hooks as it is measured, and the
// whole document after it (a run stopped half way keeps what it measured).
struct Document {
  nlohmann::json doc;
  const BenchHooks& hooks;

  Document(nlohmann::json head, const BenchHooks& h) : doc(std::move(head)), hooks(h) {
    doc["records"] = nlohmann::json::array();
    publish();
  }
  void add(nlohmann::json rec) {
    if (hooks.record) hooks.record(rec.dump());
    doc["records"].push_back(std::move(rec));
    publish();
  }
  void publish() const {
    if (hooks.partial) hooks.partial(text());
  }
  std::string text() const { return doc.dump(2) + "\n"; }
};

}  // namespace k3::harness
