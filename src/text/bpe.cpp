// BPE model of tokenizer.json ("model": {"type": "BPE", ...}): vocab (token -> id), merges
// (as "a b" strings or [a, b] pairs; rank = position), unk_token, fuse_unk, byte_fallback
// (<0xNN> tokens for characters outside the vocab), continuing_subword_prefix,
// end_of_word_suffix, ignore_merges. One word is split into characters, then the pair of lowest
// merge rank (leftmost on ties) is merged repeatedly through a priority queue, which is how the
// reference `tokenizers` library orders merges; results of words under 256 bytes are cached.
#include <algorithm>
#include <cstdio>
#include <queue>

#include "text/text_internal.h"
#include "veloxquant/error.h"

namespace vq::text {

namespace {

constexpr size_t kMaxCachedWordBytes = 256;      // as the reference: long words are not cached
constexpr size_t kCacheSlots = size_t{1} << 16;  // table size; filled to half at most

// FNV-1a 64, never 0 (0 marks an empty cache slot).
uint64_t word_hash(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return h | 1;
}

std::string quote_token(std::string_view s) {
  return "'" + truncate_utf8(s, 80) + "'";
}

// One symbol of the word being merged: a doubly linked list over a vector (as the reference).
struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  bool alive;
};

struct MergeCandidate {
  int32_t pos;
  int32_t rank;
  int32_t new_id;
};

// Lowest rank first, then leftmost position.
struct MergeLater {
  bool operator()(const MergeCandidate& a, const MergeCandidate& b) const {
    if (a.rank != b.rank) return a.rank > b.rank;
    return a.pos > b.pos;
  }
};

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

BpeModel::BpeModel(const json& j) {
  const std::string where = "model";
  if (!j.is_object()) throw Error("[tokenizer] model: expected an object but got " + json_kind(j));
  if (j.contains("type")) {
    const std::string type = get_string(j, "type", where);
    if (type != "BPE") {
      throw Error("[tokenizer] model: expected type BPE but got unsupported model type '" + type +
                  "'");
    }
  } else if (!j.contains("merges")) {
    throw Error("[tokenizer] model: expected a \"type\" field (BPE) but got none");
  }

  // Vocabulary.
  if (!j.contains("vocab"))
    throw Error("[tokenizer] model: expected a \"vocab\" but it is missing");
  const json& vocab = j.at("vocab");
  if (!vocab.is_object()) {
    throw Error("[tokenizer] model.vocab: expected an object but got " + json_kind(vocab));
  }
  vocab_.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const json& v = it.value();
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= INT32_MAX) {
      throw Error("[tokenizer] model.vocab[" + quote_token(it.key()) +
                  "]: expected an id in [0, 2^31-1) but got " + json_kind(v));
    }
    const auto id = static_cast<int32_t>(v.get<int64_t>());
    vocab_.emplace(it.key(), id);
    max_id_ = std::max(max_id_, id);
  }

  // Options.
  if (j.contains("dropout") && !j.at("dropout").is_null()) {
    const json& d = j.at("dropout");
    if (!d.is_number() || d.get<double>() != 0.0) {
      throw Error(
          "[tokenizer] model.dropout: expected null or 0 (BPE dropout is random and not "
          "supported) but got " +
          json_kind(d));
    }
  }
  auto optional_string = [&](const char* key) -> std::string {
    if (!j.contains(key) || j.at(key).is_null()) return {};
    return get_string(j, key, where);
  };
  unk_token_ = optional_string("unk_token");
  continuing_subword_prefix_ = optional_string("continuing_subword_prefix");
  end_of_word_suffix_ = optional_string("end_of_word_suffix");
  fuse_unk_ = get_bool(j, "fuse_unk", where, false);
  byte_fallback_ = get_bool(j, "byte_fallback", where, false);
  ignore_merges_ = get_bool(j, "ignore_merges", where, false);
  if (!unk_token_.empty()) {
    auto it = vocab_.find(unk_token_);
    if (it == vocab_.end()) {
      throw Error("[tokenizer] model.unk_token: expected a token of the vocab but got " +
                  quote_token(unk_token_) + ", which is not in it");
    }
    unk_id_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = vocab_.find(std::string_view(name));
    byte_fallback_ids_[static_cast<size_t>(b)] = it == vocab_.end() ? -1 : it->second;
  }

  // Merges: rank = index in the list; a repeated pair keeps its last rank (as the reference,
  // which collects them into a hash map).
  if (j.contains("merges")) {
    const json& merges = j.at("merges");
    if (!merges.is_array()) {
      throw Error("[tokenizer] model.merges: expected an array but got " + json_kind(merges));
    }
    merges_.reserve(merges.size());
    std::string left, right;
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const json& m = merges[rank];
      const std::string at = "[tokenizer] model.merges[" + std::to_string(rank) + "]";
      if (m.is_string()) {
        const std::string& s = m.get_ref<const std::string&>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
          throw Error(at + ": expected \"a b\" (two tokens separated by one space) but got " +
                      quote_token(s));
        }
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        left = m[0].get<std::string>();
        right = m[1].get<std::string>();
      } else {
        throw Error(at + ": expected \"a b\" or [\"a\", \"b\"] but got " + json_kind(m));
      }
      auto a = vocab_.find(left);
      auto b = vocab_.find(right);
      if (a == vocab_.end() || b == vocab_.end()) {
        throw Error(at + ": expected both tokens in the vocab but " +
                    quote_token(a == vocab_.end() ? left : right) + " is not in it");
      }
      std::string_view tail = right;
      if (!continuing_subword_prefix_.empty() && tail.starts_with(continuing_subword_prefix_)) {
        tail.remove_prefix(continuing_subword_prefix_.size());
      }
      std::string merged = left;
      merged.append(tail);
      auto m_it = vocab_.find(merged);
      if (m_it == vocab_.end()) {
        throw Error(at + ": expected the merged token " + quote_token(merged) +
                    " in the vocab but it is not in it");
      }
      merges_[pair_key(a->second, b->second)] = {static_cast<int32_t>(rank), m_it->second};
    }
  }
}

std::string BpeModel::describe() const {
  std::string out =
      "BPE vocab " + std::to_string(vocab_.size()) + ", merges " + std::to_string(merges_.size());
  if (byte_fallback_) out += ", byte_fallback";
  if (!unk_token_.empty()) out += ", unk " + unk_token_ + (fuse_unk_ ? " (fused)" : "");
  if (ignore_merges_) out += ", ignore_merges";
  return out;
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() < kMaxCachedWordBytes;
  const uint64_t hash = cacheable ? word_hash(word) : 0;
  if (cacheable && cache_find(word, hash, out)) return;
  const size_t first = out.size();
  merge_word(word, out);
  if (cacheable) cache_insert(word, hash, out.data() + first, out.size() - first);
}

bool BpeModel::cache_find(std::string_view word, uint64_t hash, std::vector<int32_t>& out) const {
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_slots_.empty()) return false;
  const size_t mask = cache_slots_.size() - 1;
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    const CacheSlot& slot = cache_slots_[i];
    if (slot.hash == 0) return false;
    if (slot.hash == hash && slot.key_length == word.size() &&
        std::string_view(cache_keys_).substr(slot.key_offset, slot.key_length) == word) {
      const int32_t* ids = cache_ids_.data() + slot.ids_offset;
      out.insert(out.end(), ids, ids + slot.ids_length);
      return true;
    }
  }
}

void BpeModel::cache_insert(std::string_view word, uint64_t hash, const int32_t* ids,
                            size_t n) const {
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_slots_.empty()) cache_slots_.resize(kCacheSlots);
  if (2 * (cache_used_ + 1) > cache_slots_.size()) return;  // half full: stop caching
  const size_t mask = cache_slots_.size() - 1;
  size_t i = hash & mask;
  for (; cache_slots_[i].hash != 0; i = (i + 1) & mask) {
    const CacheSlot& slot = cache_slots_[i];
    if (slot.hash == hash && slot.key_length == word.size() &&
        std::string_view(cache_keys_).substr(slot.key_offset, slot.key_length) == word) {
      return;  // another thread cached it first
    }
  }
  CacheSlot& slot = cache_slots_[i];
  slot.hash = hash;
  slot.key_offset = static_cast<uint32_t>(cache_keys_.size());
  slot.key_length = static_cast<uint32_t>(word.size());
  slot.ids_offset = static_cast<uint32_t>(cache_ids_.size());
  slot.ids_length = static_cast<uint32_t>(n);
  cache_keys_.append(word);
  cache_ids_.insert(cache_ids_.end(), ids, ids + n);
  ++cache_used_;
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add = [&symbols](int32_t id) {
    const auto n = static_cast<int32_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back({id, n - 1, -1, true});
  };

  // 1. Characters -> initial symbols (unknown characters: byte fallback, else unk).
  int32_t pending_unk = -1;  // an unk symbol not added yet (fuse_unk merges consecutive ones)
  std::string scratch;
  for (size_t i = 0; i < word.size();) {
    const size_t n = std::min(utf8_len(static_cast<unsigned char>(word[i])), word.size() - i);
    const bool is_first = i == 0;
    const bool is_last = i + n == word.size();
    std::string_view piece = word.substr(i, n);
    i += n;
    std::string_view key = piece;
    if ((!is_first && !continuing_subword_prefix_.empty()) ||
        (is_last && !end_of_word_suffix_.empty())) {
      scratch.clear();
      if (!is_first) scratch += continuing_subword_prefix_;
      scratch.append(piece);
      if (is_last) scratch += end_of_word_suffix_;
      key = scratch;
    }
    auto it = vocab_.find(key);
    if (it != vocab_.end()) {
      if (pending_unk >= 0) {
        add(pending_unk);
        pending_unk = -1;
      }
      add(it->second);
      continue;
    }
    if (byte_fallback_) {
      // Every byte of the (prefixed) character must have its <0xNN> token. As the reference,
      // a pending unk is not flushed first.
      bool all = true;
      for (char c : key) all = all && byte_fallback_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        for (char c : key) add(byte_fallback_ids_[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    if (unk_id_ >= 0) {
      if (pending_unk >= 0 && !fuse_unk_) add(pending_unk);
      pending_unk = unk_id_;
    }
    // No unk token: the character is dropped, as the reference does.
  }
  if (pending_unk >= 0) add(pending_unk);

  // 2. Merge the lowest-ranked adjacent pair until none is left.
  if (symbols.size() > 1 && !merges_.empty()) {
    std::priority_queue<MergeCandidate, std::vector<MergeCandidate>, MergeLater> queue;
    for (size_t p = 0; p + 1 < symbols.size(); ++p) {
      auto it = merges_.find(pair_key(symbols[p].id, symbols[p + 1].id));
      if (it != merges_.end()) {
        queue.push({static_cast<int32_t>(p), it->second.first, it->second.second});
      }
    }
    while (!queue.empty()) {
      const MergeCandidate top = queue.top();
      queue.pop();
      Symbol& cur = symbols[static_cast<size_t>(top.pos)];
      if (!cur.alive || cur.next < 0) continue;
      const int32_t next_pos = cur.next;
      const Symbol right = symbols[static_cast<size_t>(next_pos)];
      // Skip stale entries: the pair here must still merge into the same token.
      auto now = merges_.find(pair_key(cur.id, right.id));
      if (now == merges_.end() || now->second.second != top.new_id) continue;
      cur.id = top.new_id;
      cur.next = right.next;
      symbols[static_cast<size_t>(next_pos)].alive = false;
      if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
      if (cur.prev >= 0) {
        auto it = merges_.find(pair_key(symbols[static_cast<size_t>(cur.prev)].id, cur.id));
        if (it != merges_.end()) queue.push({cur.prev, it->second.first, it->second.second});
      }
      if (cur.next >= 0) {
        auto it = merges_.find(pair_key(cur.id, symbols[static_cast<size_t>(cur.next)].id));
        if (it != merges_.end()) queue.push({top.pos, it->second.first, it->second.second});
      }
    }
  }
  for (const Symbol& s : symbols) {
    if (s.alive) out.push_back(s.id);
  }
}

}  // namespace vq::text
