// CacheConfig validation and parsing (veloxquant/cache_config.h, caches.md §6).
//
// One table lists every field once (name, kind, accessors); set_field, config_from_json and
// config_to_json all walk it, so a new field needs one line. Messages name the field, the value
// and what is allowed: "[cache_config] snap_budget: expected >= 1 but got 0".
// Keys: '-' and '_' are equivalent. Spec strings ("snapkv:budget=256:obs_window=16") give short
// keys their method's prefix (snap_, skvq_, both tried for snapkv+skvq, streaming_).
#include "veloxquant/cache_config.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "veloxquant/error.h"

namespace vq {

namespace {

using nlohmann::json;

[[noreturn]] void fail(const std::string& field, const std::string& expected,
                       const std::string& got) {
  throw Error("[cache_config] " + field + ": expected " + expected + " but got " + got);
}

std::string fmt_double(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

// Names of enum values, index = enum value (function-local statics: safe at any init time).
const std::vector<std::string>& snap_dtype_names() {
  static const std::vector<std::string> n = {"auto", "float16", "bfloat16"};
  return n;
}
const std::vector<std::string>& scoring_names() {
  static const std::vector<std::string> n = {"key_proxy", "query"};
  return n;
}
const std::vector<std::string>& evict_at_names() {
  static const std::vector<std::string> n = {"prefill_call", "prompt_end"};
  return n;
}
const std::vector<std::string>& pool_names() {
  static const std::vector<std::string> n = {"max", "avg"};
  return n;
}
const std::vector<std::string>& meta_names() {
  static const std::vector<std::string> n = {"float16", "float32", "fp8_e4m3"};
  return n;
}
const std::vector<std::string>& rotation_names() {
  static const std::vector<std::string> n = {"none", "hadamard"};
  return n;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

std::string normalize_key(std::string k) {
  std::replace(k.begin(), k.end(), '-', '_');
  return k;
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// ---- string -> value parsers (whole string must be consumed)

int64_t parse_int(const std::string& field, const std::string& s) {
  int64_t v = 0;
  const char* end = s.data() + s.size();
  const auto [p, ec] = std::from_chars(s.data(), end, v);
  if (s.empty() || ec != std::errc() || p != end) fail(field, "an integer", "'" + s + "'");
  return v;
}

uint64_t parse_u64(const std::string& field, const std::string& s) {
  uint64_t v = 0;
  int base = 10;
  size_t start = 0;
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    base = 16;
    start = 2;
  }
  const char* begin = s.data() + start;
  const char* end = s.data() + s.size();
  const auto [p, ec] = std::from_chars(begin, end, v, base);
  if (begin == end || ec != std::errc() || p != end)
    fail(field, "an unsigned integer (decimal or 0x hex)", "'" + s + "'");
  return v;
}

double parse_double(const std::string& field, const std::string& s) {
  if (s.empty()) fail(field, "a number", "''");
  char* endp = nullptr;
  const double v = std::strtod(s.c_str(), &endp);
  if (endp != s.c_str() + s.size() || !std::isfinite(v))
    fail(field, "a finite number", "'" + s + "'");
  return v;
}

bool parse_bool(const std::string& field, const std::string& s) {
  const std::string l = lower(s);
  if (l == "true" || l == "1" || l == "on") return true;
  if (l == "false" || l == "0" || l == "off") return false;
  fail(field, "a bool (true/false/1/0/on/off)", "'" + s + "'");
}

int parse_enum(const std::string& field, const std::vector<std::string>& names,
               const std::string& s) {
  const std::string l = lower(s);
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == l) return static_cast<int>(i);
  fail(field, "one of " + join(names), "'" + s + "'");
}

// ---- the field table

struct Field {
  std::string name;
  std::string type;  // for messages: "an integer", ...
  std::function<void(CacheConfig&, const std::string&)> set_text;
  std::function<void(CacheConfig&, const json&)> set_json;
  std::function<json(const CacheConfig&)> get;
};

Field int_field(const char* name, int64_t CacheConfig::*m) {
  const std::string n = name;
  return {n, "an integer", [n, m](CacheConfig& c, const std::string& s) { c.*m = parse_int(n, s); },
          [n, m](CacheConfig& c, const json& j) {
            if (!j.is_number_integer()) fail(n, "an integer", j.dump());
            if (j.is_number_unsigned() &&
                j.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
              fail(n, "an integer that fits int64", j.dump());
            c.*m = j.get<int64_t>();
          },
          [m](const CacheConfig& c) { return json(c.*m); }};
}

Field u64_field(const char* name, uint64_t CacheConfig::*m) {
  const std::string n = name;
  return {n, "an unsigned integer",
          [n, m](CacheConfig& c, const std::string& s) { c.*m = parse_u64(n, s); },
          [n, m](CacheConfig& c, const json& j) {
            if (!j.is_number_integer() || (!j.is_number_unsigned() && j.get<int64_t>() < 0))
              fail(n, "an unsigned integer", j.dump());
            c.*m = j.get<uint64_t>();
          },
          [m](const CacheConfig& c) { return json(c.*m); }};
}

Field double_field(const char* name, double CacheConfig::*m) {
  const std::string n = name;
  return {n, "a number",
          [n, m](CacheConfig& c, const std::string& s) { c.*m = parse_double(n, s); },
          [n, m](CacheConfig& c, const json& j) {
            if (!j.is_number()) fail(n, "a number", j.dump());
            c.*m = j.get<double>();
          },
          [m](const CacheConfig& c) { return json(c.*m); }};
}

Field bool_field(const char* name, bool CacheConfig::*m) {
  const std::string n = name;
  return {n, "a bool", [n, m](CacheConfig& c, const std::string& s) { c.*m = parse_bool(n, s); },
          [n, m](CacheConfig& c, const json& j) {
            if (!j.is_boolean()) fail(n, "a bool (true/false)", j.dump());
            c.*m = j.get<bool>();
          },
          [m](const CacheConfig& c) { return json(c.*m); }};
}

Field string_field(const char* name, std::string CacheConfig::*m) {
  const std::string n = name;
  return {n, "a string", [m](CacheConfig& c, const std::string& s) { c.*m = s; },
          [n, m](CacheConfig& c, const json& j) {
            if (!j.is_string()) fail(n, "a string", j.dump());
            c.*m = j.get<std::string>();
          },
          [m](const CacheConfig& c) { return json(c.*m); }};
}

template <typename E>
Field enum_field(const char* name, E CacheConfig::*m, const std::vector<std::string>& names) {
  const std::string n = name;
  const std::vector<std::string>* nm = &names;
  return {n, "one of " + join(names),
          [n, m, nm](CacheConfig& c, const std::string& s) {
            c.*m = static_cast<E>(parse_enum(n, *nm, s));
          },
          [n, m, nm](CacheConfig& c, const json& j) {
            if (!j.is_string()) fail(n, "a string, one of " + join(*nm), j.dump());
            c.*m = static_cast<E>(parse_enum(n, *nm, j.get<std::string>()));
          },
          [n, m, nm](const CacheConfig& c) {
            const auto i = static_cast<size_t>(c.*m);
            if (i >= nm->size()) fail(n, "one of " + join(*nm), std::to_string(i));
            return json((*nm)[i]);
          }};
}

const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      string_field("method", &CacheConfig::method),
      int_field("head_dim", &CacheConfig::head_dim),
      int_field("snap_budget", &CacheConfig::snap_budget),
      int_field("snap_obs_window", &CacheConfig::snap_obs_window),
      int_field("snap_n_sink", &CacheConfig::snap_n_sink),
      enum_field("snap_dtype", &CacheConfig::snap_dtype, snap_dtype_names()),
      enum_field("snap_scoring", &CacheConfig::snap_scoring, scoring_names()),
      int_field("snap_pool_kernel", &CacheConfig::snap_pool_kernel),
      enum_field("snap_pool", &CacheConfig::snap_pool, pool_names()),
      bool_field("snap_keep_window", &CacheConfig::snap_keep_window),
      enum_field("snap_evict_at", &CacheConfig::snap_evict_at, evict_at_names()),
      double_field("skvq_bits_key", &CacheConfig::skvq_bits_key),
      double_field("skvq_bits_value", &CacheConfig::skvq_bits_value),
      int_field("skvq_group_size", &CacheConfig::skvq_group_size),
      int_field("skvq_window", &CacheConfig::skvq_window),
      int_field("skvq_n_sink", &CacheConfig::skvq_n_sink),
      bool_field("skvq_reorder", &CacheConfig::skvq_reorder),
      bool_field("skvq_clip_search", &CacheConfig::skvq_clip_search),
      double_field("skvq_clip_alpha", &CacheConfig::skvq_clip_alpha),
      int_field("skvq_max_ctx", &CacheConfig::skvq_max_ctx),
      enum_field("skvq_meta", &CacheConfig::skvq_meta, meta_names()),
      int_field("skvq_recent", &CacheConfig::skvq_recent),
      enum_field("skvq_rotation", &CacheConfig::skvq_rotation, rotation_names()),
      bool_field("skvq_rotate_values", &CacheConfig::skvq_rotate_values),
      u64_field("skvq_rotation_seed", &CacheConfig::skvq_rotation_seed),
      string_field("skvq_perm_file", &CacheConfig::skvq_perm_file),
      int_field("streaming_n_sink", &CacheConfig::streaming_n_sink),
      int_field("streaming_window", &CacheConfig::streaming_window),
  };
  return f;
}

const Field* find_field(const std::string& key) {
  const std::string k = normalize_key(key);
  for (const auto& f : fields())
    if (f.name == k) return &f;
  return nullptr;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

[[noreturn]] void unknown_key(const std::string& key) {
  const std::string k = normalize_key(key);
  std::string close, all;
  for (const auto& f : fields()) {
    all += (all.empty() ? "" : ", ") + f.name;
    const bool near =
        edit_distance(k, f.name) <= 2 || (k.size() >= 3 && f.name.find(k) != std::string::npos);
    if (near) close += (close.empty() ? "" : ", ") + f.name;
  }
  std::string msg = "[cache_config] unknown key '" + key + "'";
  if (!close.empty()) msg += " (did you mean: " + close + "?)";
  msg += "; valid keys: " + all;
  throw Error(msg);
}

void check_int(const char* field, int64_t v, int64_t lo, int64_t hi, const std::string& allowed) {
  if (v < lo || v > hi) fail(field, allowed, std::to_string(v));
}

void check_bits(const char* field, double v) {
  const bool ok = v == 1.5 || (v >= 1 && v <= 8 && std::floor(v) == v);
  if (!ok) fail(field, "an integer in 1..8 or exactly 1.5", fmt_double(v));
}

template <typename E>
void check_enum(const char* field, E v, const std::vector<std::string>& names) {
  if (static_cast<size_t>(v) >= names.size())
    fail(field, "one of " + join(names), std::to_string(static_cast<int>(v)));
}

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

}  // namespace

const std::vector<std::string>& cache_methods() {
  static const std::vector<std::string> m = {"full", "snapkv", "skvq", "snapkv+skvq", "streaming"};
  return m;
}

void validate(const CacheConfig& c) {
  const auto& methods = cache_methods();
  if (std::find(methods.begin(), methods.end(), c.method) == methods.end())
    fail("method", "one of " + join(methods), "'" + c.method + "'");
  check_int("head_dim", c.head_dim, 1, kMax, ">= 1");
  // snap_budget < 1 is refused here, at the config level. The seed clamps budget <= 0 to a
  // count of 1 at selection time (reference-behaviour §2.3, §2.10); that clamp stays in the
  // selection primitive (its tests use budgets -1..n+4), but a cache asked to keep < 1 rows is
  // a configuration mistake worth reporting.
  check_int("snap_budget", c.snap_budget, 1, kMax, ">= 1");
  check_int("snap_obs_window", c.snap_obs_window, 1, kMax, ">= 1");
  check_int("snap_n_sink", c.snap_n_sink, 0, kMax, ">= 0");
  check_enum("snap_dtype", c.snap_dtype, snap_dtype_names());
  check_enum("snap_scoring", c.snap_scoring, scoring_names());
  if (c.snap_pool_kernel < 1 || c.snap_pool_kernel % 2 == 0)
    fail("snap_pool_kernel", "an odd integer >= 1 (1 = no pooling)",
         std::to_string(c.snap_pool_kernel));
  check_enum("snap_pool", c.snap_pool, pool_names());
  check_enum("snap_evict_at", c.snap_evict_at, evict_at_names());
  check_bits("skvq_bits_key", c.skvq_bits_key);
  check_bits("skvq_bits_value", c.skvq_bits_value);
  check_int("skvq_group_size", c.skvq_group_size, 1, kMax, ">= 1");
  check_int("skvq_window", c.skvq_window, 2, kMax, ">= 2");
  if (c.skvq_n_sink < 0 || c.skvq_n_sink >= c.skvq_window)
    fail("skvq_n_sink", "0 <= n < skvq_window (" + std::to_string(c.skvq_window) + ")",
         std::to_string(c.skvq_n_sink));
  // Checked even when skvq_clip_search is on (the search ignores it, but a bad value is a bug).
  if (!(c.skvq_clip_alpha > 0.0 && c.skvq_clip_alpha <= 1.0))
    fail("skvq_clip_alpha", "a value in (0, 1]", fmt_double(c.skvq_clip_alpha));
  check_int("skvq_max_ctx", c.skvq_max_ctx, 0, kMax, ">= 0 (0 = unlimited)");
  check_enum("skvq_meta", c.skvq_meta, meta_names());
  check_int("skvq_recent", c.skvq_recent, 0, kMax, ">= 0");
  check_enum("skvq_rotation", c.skvq_rotation, rotation_names());
  check_int("streaming_n_sink", c.streaming_n_sink, 0, kMax, ">= 0");
  check_int("streaming_window", c.streaming_window, 1, kMax, ">= 1");
}

void set_field(CacheConfig& cfg, const std::string& key, const std::string& value) {
  const Field* f = find_field(key);
  if (!f) unknown_key(key);
  CacheConfig tmp = cfg;  // a malformed value leaves cfg untouched
  f->set_text(tmp, value);
  cfg = std::move(tmp);
}

CacheConfig config_from_json(const std::string& json_text) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    throw Error(std::string("[cache_config] expected a JSON object but got invalid JSON: ") +
                e.what());
  }
  if (!j.is_object())
    throw Error("[cache_config] expected a JSON object but got " + std::string(j.type_name()));
  CacheConfig cfg;
  std::set<std::string> seen;
  for (const auto& [key, val] : j.items()) {
    const Field* f = find_field(key);
    if (!f) unknown_key(key);
    if (!seen.insert(f->name).second)
      throw Error("[cache_config] " + f->name + ": expected one value but got it twice ('" + key +
                  "')");
    f->set_json(cfg, val);
  }
  validate(cfg);
  return cfg;
}

std::string config_to_json(const CacheConfig& cfg) {
  json j = json::object();
  for (const auto& f : fields()) j[f.name] = f.get(cfg);
  return j.dump(2);
}

CacheConfig config_from_spec(const std::string& spec) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t colon = spec.find(':', start);
    parts.push_back(
        spec.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  const std::string method = parts[0];
  if (method.empty() || method.find('=') != std::string::npos)
    throw Error("[cache_config] spec: expected the method first (\"snapkv:budget=256\") but got '" +
                spec + "'");
  const auto& methods = cache_methods();
  if (std::find(methods.begin(), methods.end(), method) == methods.end())
    fail("method", "one of " + join(methods), "'" + method + "'");

  std::vector<std::string> prefixes;
  if (method == "snapkv") prefixes = {"snap_"};
  if (method == "skvq") prefixes = {"skvq_"};
  if (method == "snapkv+skvq") prefixes = {"snap_", "skvq_"};
  if (method == "streaming") prefixes = {"streaming_"};

  CacheConfig cfg;
  cfg.method = method;
  std::set<std::string> seen;
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string& a = parts[i];
    const size_t eq = a.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error("[cache_config] spec: expected key=value but got '" + a + "' in '" + spec + "'");
    const std::string key = normalize_key(a.substr(0, eq));
    const std::string value = a.substr(eq + 1);
    if (key == "method")
      throw Error(
          "[cache_config] spec: expected the method only before the first ':' but got "
          "method=" +
          value);
    const Field* f = find_field(key);
    if (!f) {
      std::vector<const Field*> hits;
      for (const auto& p : prefixes)
        if (const Field* g = find_field(p + key)) hits.push_back(g);
      if (hits.size() > 1)
        throw Error("[cache_config] spec: key '" + key + "' is ambiguous for " + method +
                    ": expected one of " + hits[0]->name + ", " + hits[1]->name +
                    " (use the full name)");
      if (hits.empty()) unknown_key(key);
      f = hits[0];
    }
    if (!seen.insert(f->name).second)
      throw Error("[cache_config] " + f->name + ": expected one value but got it twice in '" +
                  spec + "'");
    f->set_text(cfg, value);
  }
  validate(cfg);
  return cfg;
}

}  // namespace vq
