// CacheConfig validation and parsing (veloxquant/cache_config.h, docs/design.md §C6).
//
// One table lists every field once (name, kind, accessors); set_field, config_from_json and
// config_to_json all walk it, so a new field needs one line. Messages name the field, the value
// and what is allowed: "[cache_config] snap_budget: expected >= 1 but got 0".
// Keys: '-' and '_' are equivalent. One key rule serves specs ("snapkv:budget=256"), --cache-opt
// options and JSON with a method (resolve_key): a short key gets its method's prefix (snap_,
// skvq_, both tried for snapkv+skvq, streaming_); keys of another method and ambiguous short keys
// are refused. Integer fields are bounded above (kMaxCacheRows, kMaxCacheHeadDim) so the caches'
// sums of two fields cannot overflow.
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
#include <utility>

#include "core/utf8.h"
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
  static const std::vector<std::string> n = {"key_proxy", "query", "external"};
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
const std::vector<std::string>& axis_names() {
  static const std::vector<std::string> n = {"token", "channel"};
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
  std::string allowed = {};  // values validate() accepts, for messages ("" = any of the type)
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

// s for a message: printable ASCII as is, every other byte as \xHH.
std::string escaped(const std::string& s) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7F) {
      out += ch;
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

// Text settings are written into JSON (config_to_json, state files), whose strings are Unicode:
// bytes that are not UTF-8 (a Latin-1 file name, say) are refused, by name, where a setting is
// set (set_field) and where a config is checked (validate: one assigned member by member never
// passed set_field), rather than failing later where the config is written.
void check_utf8(const std::string& field, const std::string& s) {
  const size_t bad = utf8::valid_prefix(s);
  if (bad != s.size())
    fail(field, "UTF-8 text (settings are written as JSON)",
         "'" + escaped(s) + "', not UTF-8 at byte " + std::to_string(bad));
}

constexpr const char* kTextType = "a string";  // Field::type of the text settings

Field string_field(const char* name, std::string CacheConfig::*m) {
  const std::string n = name;
  return {n, kTextType,
          [n, m](CacheConfig& c, const std::string& s) {
            check_utf8(n, s);
            c.*m = s;
          },
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

Field allow(Field f, std::string allowed) {
  f.allowed = std::move(allowed);
  return f;
}

// Function-local statics only (fields() may run at any init time): the caps as text.
std::string rows_max() {
  return std::to_string(kMaxCacheRows);
}
std::string dim_max() {
  return std::to_string(kMaxCacheHeadDim);
}

const std::vector<Field>& fields() {
  static const std::vector<Field> f = {
      string_field("method", &CacheConfig::method),
      allow(int_field("head_dim", &CacheConfig::head_dim), "1.." + dim_max()),
      allow(int_field("snap_budget", &CacheConfig::snap_budget), "1.." + rows_max()),
      allow(int_field("snap_obs_window", &CacheConfig::snap_obs_window), "1.." + rows_max()),
      allow(int_field("snap_n_sink", &CacheConfig::snap_n_sink), "0..snap_budget - 1"),
      enum_field("snap_dtype", &CacheConfig::snap_dtype, snap_dtype_names()),
      enum_field("snap_scoring", &CacheConfig::snap_scoring, scoring_names()),
      allow(int_field("snap_pool_kernel", &CacheConfig::snap_pool_kernel), "odd, 1.." + rows_max()),
      enum_field("snap_pool", &CacheConfig::snap_pool, pool_names()),
      bool_field("snap_keep_window", &CacheConfig::snap_keep_window),
      enum_field("snap_evict_at", &CacheConfig::snap_evict_at, evict_at_names()),
      allow(int_field("snap_decode_budget", &CacheConfig::snap_decode_budget),
            "0 (off) or snap_n_sink + 1.." + rows_max()),
      allow(int_field("snap_decode_every", &CacheConfig::snap_decode_every), "1.." + rows_max()),
      allow(double_field("skvq_bits_key", &CacheConfig::skvq_bits_key),
            "an integer in 1..8 or 1.5"),
      allow(double_field("skvq_bits_value", &CacheConfig::skvq_bits_value),
            "an integer in 1..8 or 1.5"),
      allow(int_field("skvq_group_size", &CacheConfig::skvq_group_size), "1.." + dim_max()),
      allow(int_field("skvq_window", &CacheConfig::skvq_window), "2.." + rows_max()),
      allow(int_field("skvq_n_sink", &CacheConfig::skvq_n_sink), "0..skvq_window - 1"),
      bool_field("skvq_reorder", &CacheConfig::skvq_reorder),
      bool_field("skvq_clip_search", &CacheConfig::skvq_clip_search),
      allow(double_field("skvq_clip_alpha", &CacheConfig::skvq_clip_alpha), "a number in (0, 1]"),
      allow(double_field("skvq_value_clip_floor", &CacheConfig::skvq_value_clip_floor),
            "a number in [0.25, 0.85]"),
      allow(int_field("skvq_max_ctx", &CacheConfig::skvq_max_ctx), "0 (unlimited).." + rows_max()),
      enum_field("skvq_meta", &CacheConfig::skvq_meta, meta_names()),
      allow(int_field("skvq_recent", &CacheConfig::skvq_recent), "0.." + rows_max()),
      enum_field("skvq_rotation", &CacheConfig::skvq_rotation, rotation_names()),
      bool_field("skvq_rotate_values", &CacheConfig::skvq_rotate_values),
      u64_field("skvq_rotation_seed", &CacheConfig::skvq_rotation_seed),
      string_field("skvq_perm_file", &CacheConfig::skvq_perm_file),
      enum_field("skvq_key_axis", &CacheConfig::skvq_key_axis, axis_names()),
      allow(int_field("skvq_key_rows", &CacheConfig::skvq_key_rows),
            "0 (the whole chunk)..skvq_window - skvq_n_sink"),
      string_field("skvq_query_moments_file", &CacheConfig::skvq_query_moments_file),
      allow(string_field("skvq_layer_bits_key", &CacheConfig::skvq_layer_bits_key),
            "'' or '/'-separated skvq_bits_key values, one per layer"),
      allow(string_field("skvq_layer_key_rows", &CacheConfig::skvq_layer_key_rows),
            "'' or '/'-separated skvq_key_rows values, one per layer"),
      allow(string_field("skvq_layer_bits_value", &CacheConfig::skvq_layer_bits_value),
            "'' or '/'-separated skvq_bits_value values, one per layer"),
      allow(double_field("skvq_protect", &CacheConfig::skvq_protect), "a number in [0, 1)"),
      enum_field("skvq_protect_scoring", &CacheConfig::skvq_protect_scoring, scoring_names()),
      allow(int_field("skvq_protect_obs_window", &CacheConfig::skvq_protect_obs_window),
            "1.." + rows_max()),
      allow(int_field("skvq_protect_pool_kernel", &CacheConfig::skvq_protect_pool_kernel),
            "odd, 1.." + rows_max()),
      bool_field("skvq_protect_values", &CacheConfig::skvq_protect_values),
      allow(int_field("streaming_n_sink", &CacheConfig::streaming_n_sink), "0.." + rows_max()),
      allow(int_field("streaming_window", &CacheConfig::streaming_window), "1.." + rows_max()),
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

// lo <= v <= hi; the message keeps the seed's ">= lo" form for a low value and names the cap (and
// why it exists) for a high one.
void check_int(const char* field, int64_t v, int64_t lo, int64_t hi, const std::string& low_text,
               const std::string& why_hi) {
  if (v < lo) fail(field, low_text, std::to_string(v));
  if (v > hi) fail(field, "<= " + std::to_string(hi) + " (" + why_hi + ")", std::to_string(v));
}

constexpr const char* kWhyRows = "positions and row counts fit int32";
constexpr const char* kWhyDim = "the largest head_dim supported";

void check_bits(const char* field, double v) {
  const bool ok = v == 1.5 || (v >= 1 && v <= 8 && std::floor(v) == v);
  if (!ok) fail(field, "an integer in 1..8 or exactly 1.5", fmt_double(v));
}

// Every run of a chunk must be at least key_rows long (it holds its metadata, packed.h), and
// chunk 0, the shortest, has window - n_sink rows.
void check_key_rows(const char* field, int64_t rows, const CacheConfig& c) {
  if (rows < 0 || rows > c.skvq_window - c.skvq_n_sink)
    fail(field,
         "0 (the whole chunk) or 1..skvq_window - skvq_n_sink (" +
             std::to_string(c.skvq_window - c.skvq_n_sink) + ", chunk 0's rows)",
         std::to_string(rows));
  if (rows > 0 && c.skvq_key_axis != QuantAxis::kChannel)
    fail(field, "0 with skvq_key_axis=token (rows per key scale apply to channel-axis keys only)",
         std::to_string(rows));
}

// The entries of a per-layer list ("2/3/2"; "" = none). An empty entry is refused.
std::vector<std::string> split_layer_list(const std::string& list) {
  std::vector<std::string> out;
  if (list.empty()) return out;
  size_t start = 0;
  for (;;) {
    const size_t end = list.find('/', start);
    out.push_back(list.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (out.back().empty())
      fail("per-layer list '" + list + "'", "one value per layer between '/' separators",
           "an empty entry " + std::to_string(out.size() - 1));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}

template <typename E>
void check_enum(const char* field, E v, const std::vector<std::string>& names) {
  if (static_cast<size_t>(v) >= names.size())
    fail(field, "one of " + join(names), std::to_string(static_cast<int>(v)));
}

// Which method family a field belongs to ("" = every method: method, head_dim).
std::string owner_of(const std::string& field) {
  if (field.rfind("snap_", 0) == 0) return "snapkv";
  if (field.rfind("skvq_", 0) == 0) return "skvq";
  if (field.rfind("streaming_", 0) == 0) return "streaming";
  return "";
}

// Prefixes of the fields a method reads, in the order short keys are tried.
std::vector<std::string> prefixes_of(const std::string& method) {
  if (method == "snapkv") return {"snap_"};
  if (method == "skvq") return {"skvq_"};
  if (method == "snapkv+skvq") return {"snap_", "skvq_"};
  if (method == "streaming") return {"streaming_"};
  return {};
}

bool method_reads(const std::string& method, const std::string& field) {
  const std::string own = owner_of(field);
  if (own.empty()) return true;
  if (method == own) return true;
  // Decode-time eviction is the snapkv cache's alone (snapkv+skvq does not read it).
  if (field.rfind("snap_decode_", 0) == 0) return false;
  return method == "snapkv+skvq" && (own == "snapkv" || own == "skvq");
}

// The methods that read a field ("snapkv, snapkv+skvq").
std::string readers_of(const std::string& field) {
  std::string out;
  for (const auto& m : cache_methods())
    if (method_reads(m, field)) out += (out.empty() ? "" : ", ") + m;
  return out;
}

void check_method_known(const std::string& method) {
  const auto& methods = cache_methods();
  if (std::find(methods.begin(), methods.end(), method) == methods.end())
    fail("method", "one of " + join(methods), "'" + method + "'");
}

// "head_dim, snap_budget, ..." (the keys a method accepts) and the short forms' rule.
std::string allowed_keys(const std::string& method) {
  std::string keys = "head_dim";
  for (const auto& f : cache_method_fields(method)) keys += ", " + f;
  const auto pre = prefixes_of(method);
  if (!pre.empty()) {
    keys += " (or without the prefix ";
    for (size_t i = 0; i < pre.size(); ++i) keys += (i ? " / " : "") + pre[i];
    keys += ")";
  }
  return keys;
}

// The key rule of the user-input parser (cache_config.h): the field `key` names for `method`.
const Field& resolve_key(const std::string& method, const std::string& key) {
  const std::string k = normalize_key(key);
  if (k == "method")
    throw Error(
        "[cache_config] key 'method': expected the method as --cache or before the first "
        "':' of a spec but got it as an assignment");
  if (const Field* f = find_field(k)) {
    if (method_reads(method, f->name)) return *f;
    throw Error("[cache_config] key '" + key + "': expected a key of method " + method + " (" +
                allowed_keys(method) + ") but got a field of " + readers_of(f->name));
  }
  std::vector<const Field*> hits;
  for (const auto& p : prefixes_of(method))
    if (const Field* g = find_field(p + k)) hits.push_back(g);
  if (hits.size() > 1)
    throw Error("[cache_config] key '" + key + "' is ambiguous for method " + method +
                ": expected one of " + hits[0]->name + ", " + hits[1]->name +
                " (the full name) but got '" + key + "'");
  if (hits.size() == 1) return *hits[0];
  // A short key of another method's field, or an unknown key.
  std::string elsewhere;
  for (const char* p : {"snap_", "skvq_", "streaming_"})
    if (const Field* g = find_field(p + k))
      elsewhere += (elsewhere.empty() ? "" : ", ") + g->name + " of " + readers_of(g->name);
  std::string close;
  for (const auto& f : fields()) {
    if (f.name == "method" || !method_reads(method, f.name)) continue;
    const size_t us = owner_of(f.name).empty() ? std::string::npos : f.name.find('_');
    const std::string short_name = us == std::string::npos ? f.name : f.name.substr(us + 1);
    const bool near = edit_distance(k, f.name) <= 2 || edit_distance(k, short_name) <= 2 ||
                      (k.size() >= 3 && f.name.find(k) != std::string::npos);
    if (near) close += (close.empty() ? "" : ", ") + f.name;
  }
  std::string msg = "[cache_config] unknown key '" + key + "' for method " + method;
  if (!elsewhere.empty()) msg += " (it would be " + elsewhere + ")";
  if (!close.empty()) msg += " (did you mean: " + close + "?)";
  msg += ": expected one of " + allowed_keys(method);
  throw Error(msg);
}

// Sets a resolved field from text; a malformed value is reported with what the field allows.
void set_resolved(CacheConfig& cfg, const Field& f, const std::string& key,
                  const std::string& value) {
  try {
    f.set_text(cfg, value);
  } catch (const Error& e) {
    std::string msg = e.what();
    if (normalize_key(key) != f.name) msg += " (key '" + key + "')";
    if (!f.allowed.empty()) msg += "; allowed: " + f.allowed;
    throw Error(msg);
  }
}

std::pair<std::string, std::string> split_assignment(const std::string& a, const std::string& in) {
  const size_t eq = a.find('=');
  if (eq == std::string::npos || eq == 0)
    throw Error("[cache_config] expected key=value but got '" + a + "'" + in);
  return {a.substr(0, eq), a.substr(eq + 1)};
}

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

json all_fields_json(const CacheConfig& cfg) {
  json j = json::object();
  for (const auto& f : fields()) j[f.name] = f.get(cfg);
  return j;
}

}  // namespace

const std::vector<std::string>& cache_methods() {
  static const std::vector<std::string> m = {"full", "snapkv", "skvq", "snapkv+skvq", "streaming"};
  return m;
}

std::vector<std::string> cache_method_fields(const std::string& method) {
  check_method_known(method);
  std::vector<std::string> out;
  for (const auto& f : fields())
    if (!owner_of(f.name).empty() && method_reads(method, f.name)) out.push_back(f.name);
  return out;
}

std::string cache_enum_name(const std::string& field, int64_t code) {
  const std::vector<std::string>* names = nullptr;
  if (field == "snap_dtype") names = &snap_dtype_names();
  if (field == "snap_scoring" || field == "skvq_protect_scoring") names = &scoring_names();
  if (field == "snap_pool") names = &pool_names();
  if (field == "snap_evict_at") names = &evict_at_names();
  if (field == "skvq_meta") names = &meta_names();
  if (field == "skvq_rotation") names = &rotation_names();
  if (field == "skvq_key_axis") names = &axis_names();
  if (!names)
    throw Error(
        "[cache_config] expected an enum field (snap_dtype, snap_scoring, snap_pool, "
        "snap_evict_at, skvq_meta, skvq_rotation, skvq_key_axis) but got '" +
        field + "'");
  if (code < 0 || code >= static_cast<int64_t>(names->size()))
    return "code " + std::to_string(code);
  return (*names)[static_cast<size_t>(code)];
}

void validate(const CacheConfig& c) {
  for (const auto& f : fields())
    if (f.type == kTextType) check_utf8(f.name, f.get(c).get<std::string>());
  check_method_known(c.method);
  check_int("head_dim", c.head_dim, 1, kMaxCacheHeadDim, ">= 1", kWhyDim);
  check_int("kv_heads_total", c.kv_heads_total, 0, kMaxCacheRows, ">= 0 (0 = not sharded)",
            kWhyRows);
  if (c.kv_head_first < 0 || c.kv_head_first >= std::max<int64_t>(c.kv_heads_total, 1))
    fail("kv_head_first", "0 .. kv_heads_total - 1 (0 when not sharded)",
         std::to_string(c.kv_head_first) + " with kv_heads_total " +
             std::to_string(c.kv_heads_total));
  // snap_budget < 1 is refused here, at the config level. The seed clamps budget <= 0 to a
  // count of 1 at selection time (docs/design.md §C3); that clamp stays in the
  // selection primitive (its tests use budgets -1..n+4), but a cache asked to keep < 1 rows is
  // a configuration mistake worth reporting.
  check_int("snap_budget", c.snap_budget, 1, kMaxCacheRows, ">= 1", kWhyRows);
  check_int("snap_obs_window", c.snap_obs_window, 1, kMaxCacheRows, ">= 1", kWhyRows);
  check_int("snap_n_sink", c.snap_n_sink, 0, kMaxCacheRows, ">= 0", kWhyRows);
  check_enum("snap_dtype", c.snap_dtype, snap_dtype_names());
  check_enum("snap_scoring", c.snap_scoring, scoring_names());
  if (c.snap_pool_kernel < 1 || c.snap_pool_kernel % 2 == 0)
    fail("snap_pool_kernel", "an odd integer >= 1 (1 = no pooling)",
         std::to_string(c.snap_pool_kernel));
  check_int("snap_pool_kernel", c.snap_pool_kernel, 1, kMaxCacheRows, ">= 1", kWhyRows);
  check_enum("snap_pool", c.snap_pool, pool_names());
  check_enum("snap_evict_at", c.snap_evict_at, evict_at_names());
  // External scores are handed over once, for the whole prompt, before it ends.
  if (c.snap_scoring == SnapScoring::kExternal && c.snap_evict_at != SnapEvictAt::kPromptEnd)
    fail("snap_scoring",
         "key_proxy or query with snap_evict_at = prefill_call (external scores "
         "need snap_evict_at = prompt_end)",
         "external");
  check_int("snap_decode_budget", c.snap_decode_budget, 0, kMaxCacheRows, ">= 0 (0 = off)",
            kWhyRows);
  check_int("snap_decode_every", c.snap_decode_every, 1, kMaxCacheRows, ">= 1", kWhyRows);
  if (c.snap_decode_budget > 0 && c.method == "snapkv+skvq")
    fail("snap_decode_budget", "0 with method snapkv+skvq (decode-time eviction: method snapkv)",
         std::to_string(c.snap_decode_budget));
  check_bits("skvq_bits_key", c.skvq_bits_key);
  check_bits("skvq_bits_value", c.skvq_bits_value);
  check_int("skvq_group_size", c.skvq_group_size, 1, kMaxCacheHeadDim, ">= 1", kWhyDim);
  check_int("skvq_window", c.skvq_window, 2, kMaxCacheRows, ">= 2", kWhyRows);
  if (c.skvq_n_sink < 0 || c.skvq_n_sink >= c.skvq_window)
    fail("skvq_n_sink", "0 <= n < skvq_window (" + std::to_string(c.skvq_window) + ")",
         std::to_string(c.skvq_n_sink));
  // Checked even when skvq_clip_search is on (the search ignores it, but a bad value is a bug).
  if (!(c.skvq_clip_alpha > 0.0 && c.skvq_clip_alpha <= 1.0))
    fail("skvq_clip_alpha", "a value in (0, 1]", fmt_double(c.skvq_clip_alpha));
  // Checked even when skvq_clip_search is off (the floor extends the search only).
  if (!(c.skvq_value_clip_floor >= 0.25 && c.skvq_value_clip_floor <= 0.85))
    fail("skvq_value_clip_floor", "a value in [0.25, 0.85] (0.85 = the seed's grid)",
         fmt_double(c.skvq_value_clip_floor));
  check_int("skvq_max_ctx", c.skvq_max_ctx, 0, kMaxCacheRows, ">= 0 (0 = unlimited)", kWhyRows);
  check_enum("skvq_meta", c.skvq_meta, meta_names());
  check_int("skvq_recent", c.skvq_recent, 0, kMaxCacheRows, ">= 0", kWhyRows);
  check_enum("skvq_rotation", c.skvq_rotation, rotation_names());
  check_enum("skvq_key_axis", c.skvq_key_axis, axis_names());
  check_key_rows("skvq_key_rows", c.skvq_key_rows, c);
  if (!c.skvq_query_moments_file.empty() && c.skvq_key_axis != QuantAxis::kChannel)
    fail("skvq_query_moments_file",
         "'' with skvq_key_axis=token (the error-feedback rounding runs across the channels of a "
         "channel-axis key row)",
         "'" + c.skvq_query_moments_file + "'");
  // Per-layer lists: every entry as its single field.
  const std::vector<std::string> lb = split_layer_list(c.skvq_layer_bits_key);
  for (size_t i = 0; i < lb.size(); ++i) {
    const std::string f = "skvq_layer_bits_key entry " + std::to_string(i);
    check_bits(f.c_str(), parse_double(f, lb[i]));
  }
  const std::vector<std::string> lv = split_layer_list(c.skvq_layer_bits_value);
  for (size_t i = 0; i < lv.size(); ++i) {
    const std::string f = "skvq_layer_bits_value entry " + std::to_string(i);
    check_bits(f.c_str(), parse_double(f, lv[i]));
  }
  const std::vector<std::string> lr = split_layer_list(c.skvq_layer_key_rows);
  for (size_t i = 0; i < lr.size(); ++i) {
    const std::string f = "skvq_layer_key_rows entry " + std::to_string(i);
    check_key_rows(f.c_str(), parse_int(f, lr[i]), c);
  }
  if (!(c.skvq_protect >= 0.0 && c.skvq_protect < 1.0))
    fail("skvq_protect", "a fraction in [0, 1) (0 = off)", fmt_double(c.skvq_protect));
  check_enum("skvq_protect_scoring", c.skvq_protect_scoring, scoring_names());
  check_int("skvq_protect_obs_window", c.skvq_protect_obs_window, 1, kMaxCacheRows, ">= 1",
            kWhyRows);
  if (c.skvq_protect_pool_kernel < 1 || c.skvq_protect_pool_kernel % 2 == 0)
    fail("skvq_protect_pool_kernel", "an odd integer >= 1 (1 = no pooling)",
         std::to_string(c.skvq_protect_pool_kernel));
  check_int("skvq_protect_pool_kernel", c.skvq_protect_pool_kernel, 1, kMaxCacheRows, ">= 1",
            kWhyRows);
  if (c.skvq_protect > 0.0 && c.method == "snapkv+skvq")
    fail("skvq_protect", "0 with method snapkv+skvq (protected rows: method skvq)",
         fmt_double(c.skvq_protect));
  check_int("streaming_n_sink", c.streaming_n_sink, 0, kMaxCacheRows, ">= 0", kWhyRows);
  check_int("streaming_window", c.streaming_window, 1, kMaxCacheRows, ">= 1", kWhyRows);
  static_assert(
      2 * kMaxCacheRows + 2 * kMaxCacheRows <= kMax,
      "sums of a few bounded fields (window + recent, n_sink + window + slack) fit int64");
}

int64_t skvq_layer_list_size(const std::string& list) {
  return static_cast<int64_t>(split_layer_list(list).size());
}

namespace {

// Entry `layer` of a per-layer list (validated), or nullptr-equivalent "" when the list is empty.
std::string layer_entry(const std::string& field, const std::string& list, int64_t layer) {
  const std::vector<std::string> v = split_layer_list(list);
  if (v.empty()) return {};
  if (layer < 0 || layer >= static_cast<int64_t>(v.size()))
    fail(field, "an entry for layer " + std::to_string(layer),
         std::to_string(v.size()) + " entries ('" + list + "')");
  return v[static_cast<size_t>(layer)];
}

}  // namespace

double skvq_key_bits_of(const CacheConfig& c, int64_t layer) {
  const std::string e = layer_entry("skvq_layer_bits_key", c.skvq_layer_bits_key, layer);
  return e.empty() ? c.skvq_bits_key : parse_double("skvq_layer_bits_key", e);
}

double skvq_value_bits_of(const CacheConfig& c, int64_t layer) {
  const std::string e = layer_entry("skvq_layer_bits_value", c.skvq_layer_bits_value, layer);
  return e.empty() ? c.skvq_bits_value : parse_double("skvq_layer_bits_value", e);
}

int64_t skvq_key_rows_of(const CacheConfig& c, int64_t layer) {
  const std::string e = layer_entry("skvq_layer_key_rows", c.skvq_layer_key_rows, layer);
  return e.empty() ? c.skvq_key_rows : parse_int("skvq_layer_key_rows", e);
}

void check_cache_config(const CacheConfig& c) {
  validate(c);
  const CacheConfig d;
  const json mine = all_fields_json(c), dflt = all_fields_json(d);
  for (const auto& f : fields()) {
    if (method_reads(c.method, f.name) || mine.at(f.name) == dflt.at(f.name)) continue;
    fail(f.name,
         "no setting with method " + c.method + " (it is read by " + readers_of(f.name) +
             "; keys of " + c.method + ": " + allowed_keys(c.method) + ")",
         mine.at(f.name).dump());
  }
  if (method_reads(c.method, "snap_budget") && c.snap_decode_budget > 0 &&
      c.snap_n_sink >= c.snap_decode_budget)
    fail("snap_n_sink",
         "< snap_decode_budget (" + std::to_string(c.snap_decode_budget) +
             ": the budget counts the sinks, and a budget of sinks only keeps no scored row)",
         std::to_string(c.snap_n_sink));
  if (method_reads(c.method, "snap_budget") && c.snap_n_sink >= c.snap_budget)
    fail("snap_n_sink",
         "< snap_budget (" + std::to_string(c.snap_budget) +
             ": the budget counts the sinks, and a budget of sinks only keeps no scored row)",
         std::to_string(c.snap_n_sink));
}

void set_field(CacheConfig& cfg, const std::string& key, const std::string& value) {
  const Field* f = find_field(key);
  if (!f) unknown_key(key);
  CacheConfig tmp = cfg;  // a malformed value leaves cfg untouched
  f->set_text(tmp, value);
  cfg = std::move(tmp);
}

void apply_cache_arg(CacheConfig& cfg, const std::string& spec) {
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
  check_method_known(method);

  CacheConfig tmp = cfg;  // all or nothing
  tmp.method = method;
  std::set<std::string> seen;
  const std::string in = " in '" + spec + "'";
  for (size_t i = 1; i < parts.size(); ++i) {
    const auto [key, value] = split_assignment(parts[i], in);
    if (normalize_key(key) == "method")
      throw Error(
          "[cache_config] spec: expected the method only before the first ':' but got "
          "method=" +
          value);
    const Field& f = resolve_key(method, key);
    if (!seen.insert(f.name).second)
      throw Error("[cache_config] " + f.name + ": expected one value but got it twice" + in);
    set_resolved(tmp, f, key, value);
  }
  cfg = std::move(tmp);
}

CacheConfig parse_cache_arg(const std::string& method_or_spec) {
  CacheConfig cfg;
  apply_cache_arg(cfg, method_or_spec);
  check_cache_config(cfg);
  return cfg;
}

CacheConfig config_from_spec(const std::string& spec) {
  return parse_cache_arg(spec);
}

void apply_cache_option(CacheConfig& cfg, const std::string& key_eq_value) {
  const auto [key, value] = split_assignment(key_eq_value, " (a --cache-opt)");
  check_method_known(cfg.method);
  const Field& f = resolve_key(cfg.method, key);
  CacheConfig tmp = cfg;
  set_resolved(tmp, f, key, value);
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
  // The method first (wherever it appears): it decides which keys are allowed.
  const bool has_method = j.contains("method");
  if (has_method) {
    find_field("method")->set_json(cfg, j.at("method"));
    check_method_known(cfg.method);
  }
  std::set<std::string> seen;
  for (const auto& [key, val] : j.items()) {
    if (key == "method") continue;
    const Field* f = nullptr;
    if (has_method) {
      f = &resolve_key(cfg.method, key);
    } else {
      f = find_field(key);  // no method yet: full names of every method's fields
      if (!f) unknown_key(key);
    }
    if (!seen.insert(f->name).second)
      throw Error("[cache_config] " + f->name + ": expected one value but got it twice ('" + key +
                  "')");
    f->set_json(cfg, val);
  }
  if (has_method)
    check_cache_config(cfg);
  else
    validate(cfg);
  return cfg;
}

std::string config_to_json(const CacheConfig& cfg) {
  json j = json::object();
  for (const auto& f : fields())
    if (method_reads(cfg.method, f.name)) j[f.name] = f.get(cfg);
  return j.dump(2);
}

}  // namespace vq
