#include "tessera/layers/fields.hpp"

#include "tessera/error.hpp"

namespace tessera {

const nlohmann::json* Fields::raw(const std::string& key) {
  known_.insert(key);
  auto it = spec_.fields.find(key);
  return it == spec_.fields.end() ? nullptr : &*it;
}

void Fields::fail(const std::string& what) const {
  throw Error(spec_.where + ": " + what);
}

std::int64_t Fields::integer(const std::string& key, std::optional<std::int64_t> fallback,
                             std::int64_t min_value) {
  const nlohmann::json* v = raw(key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    missing_.push_back(key);
    return min_value;
  }
  if (!v->is_number_integer() || v->get<std::int64_t>() < min_value)
    fail("field '" + key + "' must be an integer >= " + std::to_string(min_value) + ", got " +
         v->dump());
  return v->get<std::int64_t>();
}

Pair Fields::pair(const std::string& key, std::optional<Pair> fallback, std::int64_t min_value) {
  const nlohmann::json* v = raw(key);
  if (v == nullptr) {
    if (fallback) return *fallback;
    missing_.push_back(key);
    return {min_value, min_value};
  }
  auto one = [&](const nlohmann::json& x) {
    if (!x.is_number_integer() || x.get<std::int64_t>() < min_value)
      fail("field '" + key + "' must be an integer >= " + std::to_string(min_value) +
           " or [h, w] of them, got " + v->dump());
    return x.get<std::int64_t>();
  };
  if (v->is_array()) {
    if (v->size() != 2) fail("field '" + key + "' must be an integer or [h, w], got " + v->dump());
    return {one((*v)[0]), one((*v)[1])};
  }
  const std::int64_t x = one(*v);
  return {x, x};
}

double Fields::number(const std::string& key, double fallback, double min_value, double max_value) {
  const nlohmann::json* v = raw(key);
  if (v == nullptr) return fallback;
  if (!v->is_number() || v->get<double>() < min_value || v->get<double>() > max_value)
    fail("field '" + key + "' must be a number in [" + nlohmann::json(min_value).dump() + ", " +
         nlohmann::json(max_value).dump() + "], got " + v->dump());
  return v->get<double>();
}

bool Fields::boolean(const std::string& key, bool fallback) {
  const nlohmann::json* v = raw(key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) fail("field '" + key + "' must be true or false, got " + v->dump());
  return v->get<bool>();
}

void Fields::finish() const {
  for (const auto& [key, value] : spec_.fields.items()) {
    if (known_.count(key)) continue;
    std::string list;
    for (const auto& k : known_)
      list += (list.empty() ? "" : ", ") + k;
    fail("unknown field '" + key + "' (allowed: " + list + ")");
  }
  if (!missing_.empty()) fail("missing field '" + missing_.front() + "'");
}

}  // namespace tessera
