// Reads a layer's JSON fields with PyTorch-style defaults and errors that name the layer and the
// field. Every accessor declares its field as known, so finish() can list them. Local.
#pragma once

#include <array>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tessera/engine/model_spec.hpp"

namespace tessera {

using Pair = std::array<std::int64_t, 2>;  // [h, w]

class Fields {
 public:
  explicit Fields(const LayerSpec& spec) : spec_(spec) {}

  // An integer >= min_value; required when `fallback` is empty (a missing one is reported by
  // finish(), after unknown fields: a misspelt name is the likelier mistake).
  std::int64_t integer(const std::string& key, std::optional<std::int64_t> fallback,
                       std::int64_t min_value);
  // An integer or [h, w], each >= min_value; required when `fallback` is empty.
  Pair pair(const std::string& key, std::optional<Pair> fallback, std::int64_t min_value);
  // A number in [min_value, max_value].
  double number(const std::string& key, double fallback, double min_value, double max_value);
  bool boolean(const std::string& key, bool fallback);
  // The raw value, or nullptr when absent (the key becomes known).
  const nlohmann::json* raw(const std::string& key);

  [[noreturn]] void fail(const std::string& what) const;
  // Fails on a field no accessor asked for, then on a missing required field. Call it before
  // checks that combine fields.
  void finish() const;

 private:
  const LayerSpec& spec_;
  std::set<std::string> known_{"name", "type", "inputs"};
  std::vector<std::string> missing_;
};

}  // namespace tessera
