// Passkey retrieval under compressed caches (docs/design.md §5): exact-match accuracy by context
// length and depth, question-aware and question-agnostic.
//
// Each prompt is split at the last occurrence of the question text: context ids = encode(context)
// with the tokenizer's special prefix (BOS), question ids = encode(question) without. Both modes
// use context ++ question, so they see the same tokens. The answer is decoded greedily for as many
// tokens as encode(" " + key) has; a prompt is correct when the decoded text, whitespace-stripped,
// equals the key. Question-aware: prefill context ++ question in chunks. Question-agnostic: prefill
// the context in chunks, then one decode step per question token (the compression of the context
// is done before any question token is seen, and decode steps never evict by the question).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "eval/eval_internal.h"
#include "veloxquant/error.h"
#include "veloxquant/eval.h"
#include "veloxquant/model.h"
#include "veloxquant/tokenizer.h"

namespace vq {

std::vector<PasskeyPrompt> load_passkey_jsonl(const std::string& path) {
  std::ifstream in(path);
  VQ_CHECK(in.is_open(),
           "[passkey] expected a readable JSONL file but could not open '" + path + "'");
  std::vector<PasskeyPrompt> out;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = "[passkey] " + path + " line " + std::to_string(line_no) + ": ";
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw Error(where + "expected a JSON object but got a parse error: " + e.what());
    }
    VQ_CHECK(j.is_object(), where + "expected a JSON object but got " + j.dump().substr(0, 80));
    // Required fields: a missing or mistyped one is refused by name (a prompt set with other
    // field names would otherwise run with every prompt in one length bucket).
    auto need = [&](const char* field, const char* what, bool ok) {
      VQ_CHECK(j.contains(field),
               where + "expected the field \"" + field + "\" (" + what + ") but it is absent");
      VQ_CHECK(ok, where + "field \"" + field + "\": expected " + what + " but got " +
                       j.at(field).dump().substr(0, 80));
    };
    auto is_str = [&](const char* k) { return j.contains(k) && j.at(k).is_string(); };
    auto is_int = [&](const char* k) { return j.contains(k) && j.at(k).is_number_integer(); };
    PasskeyPrompt p;
    need("prompt", "a string", is_str("prompt"));
    need("answer", "a non-empty string",
         is_str("answer") && !j.at("answer").get_ref<const std::string&>().empty());
    p.prompt = j.at("prompt").get<std::string>();
    p.answer = j.at("answer").get<std::string>();
    if (j.contains("id")) need("id", "an integer", is_int("id"));
    p.id = j.contains("id") ? j.at("id").get<int64_t>() : static_cast<int64_t>(out.size());
    // The length bucket: target_length, or length when the set has only that.
    const char* len_key = j.contains("target_length") ? "target_length" : "length";
    need(len_key, "an integer >= 1 (the prompt's length bucket; target_length or length)",
         is_int(len_key) && j.at(len_key).get<int64_t>() >= 1);
    p.target_length = j.at(len_key).get<int64_t>();
    if (j.contains("length")) {
      need("length", "an integer >= 1", is_int("length") && j.at("length").get<int64_t>() >= 1);
      p.length = j.at("length").get<int64_t>();
    } else {
      p.length = p.target_length;
    }
    need("depth", "a number in [0, 1] (fraction of filler before the needle)",
         j.contains("depth") && j.at("depth").is_number() && j.at("depth").get<double>() >= 0 &&
             j.at("depth").get<double>() <= 1);
    p.depth = j.at("depth").get<double>();
    if (j.contains("question")) {
      need("question", "a non-empty string",
           is_str("question") && !j.at("question").get_ref<const std::string&>().empty());
      p.question = j.at("question").get<std::string>();
    }
    out.push_back(std::move(p));
  }
  VQ_CHECK(!out.empty(), "[passkey] expected at least one prompt in '" + path + "' but got none");
  return out;
}

namespace {

struct EncodedPrompt {
  std::vector<int32_t> context, question;  // context starts with the special prefix
  int64_t n_answer = 0;
  const PasskeyPrompt* src = nullptr;
  // Token positions of each occurrence of the key in the context (the needle states the key
  // twice): the tokens whose text overlaps it; empty when the key is not in the context.
  std::vector<std::vector<int32_t>> key_positions;
};

// Every occurrence of the key in the context, as the run of token indices whose text overlaps it.
// The key is located in the decoded text (a StreamDecoder gives each token's character span), so
// it is found whatever the tokenizer merged it with: " 22030" after "is", "22030." before a
// full stop. An occurrence must not continue a longer word or number (no letter or digit on
// either side).
std::vector<std::vector<int32_t>> find_key_runs(const Tokenizer& tok,
                                                const std::vector<int32_t>& ids,
                                                const std::string& key) {
  std::vector<std::vector<int32_t>> out;
  if (key.empty()) return out;
  StreamDecoder dec(tok, /*skip_special_tokens=*/true);
  std::string text;
  std::vector<size_t> end_of(ids.size());  // text.size() after token i
  for (size_t i = 0; i < ids.size(); ++i) {
    text += dec.push(ids[i]);
    end_of[i] = text.size();
  }
  auto word_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; };
  for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + 1)) {
    const size_t stop = at + key.size();
    if ((at > 0 && word_char(text[at - 1])) || (stop < text.size() && word_char(text[stop])))
      continue;
    std::vector<int32_t> run;
    for (size_t i = 0; i < ids.size(); ++i) {
      const size_t begin = i == 0 ? 0 : end_of[i - 1];
      if (end_of[i] > at && begin < stop) run.push_back(static_cast<int32_t>(i));
    }
    if (!run.empty()) out.push_back(std::move(run));
  }
  return out;
}

// Needle survival over every (layer, KV head) of batch row 0: (fraction of key digit rows stored,
// fraction of heads keeping at least one occurrence whole).
std::pair<double, double> needle_survival(const eval_detail::EvalSeq& seq,
                                          const std::vector<std::vector<int32_t>>& runs) {
  double kept = 0, whole = 0;
  int64_t n_heads = 0, n_rows = 0;
  for (const auto& run : runs) n_rows += static_cast<int64_t>(run.size());
  for (int64_t l = 0; l < seq.n_layers(); ++l)
    for (int64_t h = 0; h < seq.n_kv_heads(); ++h) {
      const std::vector<int32_t> pos = seq.stored_positions(l, h);
      int64_t hit = 0;
      bool any_whole = false;
      for (const auto& run : runs) {
        int64_t run_hit = 0;
        for (int32_t p : run)
          if (std::binary_search(pos.begin(), pos.end(), p)) ++run_hit;
        hit += run_hit;
        any_whole = any_whole || run_hit == static_cast<int64_t>(run.size());
      }
      kept += static_cast<double>(hit) / static_cast<double>(n_rows);
      whole += any_whole ? 1.0 : 0.0;
      ++n_heads;
    }
  return {n_heads ? kept / n_heads : 0.0, n_heads ? whole / n_heads : 0.0};
}

std::string strip(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\n\r");
  if (a == std::string::npos) return "";
  const size_t b = s.find_last_not_of(" \t\n\r");
  return s.substr(a, b - a + 1);
}

// Greedy continuation of n tokens after the cache consumed everything; first = the logits of the
// last consumed position. mem (if not null) is taken after the first decode step.
std::vector<int32_t> greedy(const Model& model, eval_detail::EvalSeq& seq,
                            std::vector<float>& logits, int64_t n, MemoryFigures* mem) {
  const int64_t V = model.config().vocab_size;
  std::vector<int32_t> out;
  int32_t tok = static_cast<int32_t>(eval_detail::argmax(logits.data(), V));
  out.push_back(tok);
  for (int64_t i = 1; i < n; ++i) {
    seq.decode(tok, &logits);
    if (i == 1 && mem) *mem = seq.memory();
    tok = static_cast<int32_t>(eval_detail::argmax(logits.data(), V));
    out.push_back(tok);
  }
  if (n <= 1 && mem) *mem = seq.memory();
  return out;
}

// Runs one prompt in one mode (on `engine`, or the CPU when null); returns whether the answer
// matched.
bool run_prompt(const Model& model, Engine* engine, const Tokenizer& tok, const EncodedPrompt& p,
                const EvalMethod& method, bool aware, const EvalSettings& st,
                ForwardScratch& scratch, MemoryFigures* mem, PasskeyModeScore& score) {
  const int64_t n_context =
      static_cast<int64_t>(p.context.size() + (aware ? p.question.size() : 0));
  eval_detail::EvalSeq seq(model, engine, config_for_context(method, n_context), st, scratch);
  std::vector<float> logits;
  if (aware) {
    std::vector<int32_t> all = p.context;
    all.insert(all.end(), p.question.begin(), p.question.end());
    seq.prefill(all.data(), static_cast<int64_t>(all.size()), &logits);
  } else {
    seq.prefill(p.context.data(), static_cast<int64_t>(p.context.size()), &logits);
  }
  if (!p.key_positions.empty()) {
    // Right after the compression of the context (aware: of the whole prompt).
    const auto [kept, whole] = needle_survival(seq, p.key_positions);
    score.needle_rows_kept_sum += kept;
    score.needle_heads_whole_sum += whole;
    score.needle_prompts += 1;
  }
  if (!aware) {
    for (int32_t q : p.question) seq.decode(q, &logits);
  }
  const std::vector<int32_t> gen = greedy(model, seq, logits, p.n_answer, mem);
  return strip(tok.decode(gen, true)) == p.src->answer;
}

void add_score(PasskeyModeScore& s, const PasskeyPrompt& p, bool ok) {
  s.total += 1;
  s.correct += ok ? 1 : 0;
  auto& l = s.by_length[p.target_length];
  l.first += ok ? 1 : 0;
  l.second += 1;
  auto& d = s.by_depth[static_cast<int64_t>(std::llround(p.depth * 100.0))];
  d.first += ok ? 1 : 0;
  d.second += 1;
}

}  // namespace

PasskeyResult eval_passkey(const Model& model, const Tokenizer& tokenizer,
                           const std::vector<PasskeyPrompt>& prompts,
                           const std::vector<EvalMethod>& methods, const PasskeyOptions& opts,
                           const EvalSettings& settings) {
  VQ_CHECK(opts.question_aware || opts.question_agnostic,
           "[passkey] expected at least one mode (question-aware or question-agnostic) but got "
           "none");
  VQ_CHECK(!opts.question.empty(), "[passkey] expected a question text but got an empty one");
  // Filter by length, then an even spread of max_prompts over what is left.
  std::vector<const PasskeyPrompt*> pool;
  for (const auto& p : prompts)
    if (opts.lengths.empty() ||
        std::find(opts.lengths.begin(), opts.lengths.end(), p.target_length) != opts.lengths.end())
      pool.push_back(&p);
  VQ_CHECK(!pool.empty(), "[passkey] expected prompts of the requested lengths but none matched");
  std::vector<const PasskeyPrompt*> chosen;
  const int64_t n_pool = static_cast<int64_t>(pool.size());
  if (opts.max_prompts > 0 && opts.max_prompts < n_pool) {
    for (int64_t i = 0; i < opts.max_prompts; ++i)
      chosen.push_back(pool[static_cast<size_t>(i * n_pool / opts.max_prompts)]);
  } else {
    chosen = pool;
  }

  const int64_t max_pos = model.config().max_position_embeddings;
  std::vector<EncodedPrompt> enc;
  for (const PasskeyPrompt* p : chosen) {
    // The prompt's own question (its "question" field), else opts.question; the prompt is split at
    // its last occurrence, or, when a prompt's own question is not in it, the question follows.
    const std::string& question = p->question.empty() ? opts.question : p->question;
    const size_t at = p->prompt.rfind(question);
    VQ_CHECK(at != std::string::npos || !p->question.empty(),
             "[passkey] prompt " + std::to_string(p->id) + ": expected the question '" + question +
                 "' in the prompt but it is absent (give the prompt set's question with "
                 "--question, or a \"question\" field per prompt)");
    EncodedPrompt e;
    e.src = p;
    const std::string context = at == std::string::npos ? p->prompt : p->prompt.substr(0, at);
    e.context = tokenizer.encode(context, true);
    e.question = tokenizer.encode(at == std::string::npos ? question : p->prompt.substr(at), false);
    e.n_answer = static_cast<int64_t>(tokenizer.encode(" " + p->answer, false).size());
    e.key_positions = find_key_runs(tokenizer, e.context, p->answer);
    const int64_t total = static_cast<int64_t>(e.context.size() + e.question.size()) + e.n_answer;
    VQ_CHECK(max_pos <= 0 || total <= max_pos,
             "[passkey] prompt " + std::to_string(p->id) + ": expected prompt + answer within " +
                 std::to_string(max_pos) + " positions but got " + std::to_string(total));
    enc.push_back(std::move(e));
  }
  int64_t longest = 0;
  for (const auto& e : enc)
    longest = std::max(longest, static_cast<int64_t>(e.context.size() + e.question.size()));

  PasskeyResult res;
  res.options = opts;
  res.settings = settings;
  res.n_prompts = static_cast<int64_t>(enc.size());
  ForwardScratch scratch;
  eval_detail::Progress prog(settings.progress, "passkey");
  // On settings.device (one engine for every prompt and method; null on the CPU with one rank).
  const std::unique_ptr<Engine> engine = eval_detail::make_eval_engine(model, settings, methods);

  auto run_method = [&](const EvalMethod& cfg) {
    const std::string& label = cfg.label;
    PasskeyRow row;
    row.label = label;
    row.family = cfg.family;
    bool mem_taken = false;
    for (size_t i = 0; i < enc.size(); ++i) {
      const EncodedPrompt& e = enc[i];
      const PasskeyPrompt& p = *e.src;
      const bool is_longest =
          !mem_taken && static_cast<int64_t>(e.context.size() + e.question.size()) == longest;
      if (opts.question_aware) {
        const bool ok = run_prompt(model, engine.get(), tokenizer, e, cfg, true, settings, scratch,
                                   is_longest ? &row.mem : nullptr, row.aware);
        add_score(row.aware, p, ok);
        if (is_longest) mem_taken = true;
      }
      if (opts.question_agnostic) {
        MemoryFigures m;
        const bool ok =
            run_prompt(model, engine.get(), tokenizer, e, cfg, false, settings, scratch,
                       (is_longest && !opts.question_aware) ? &row.mem : &m, row.agnostic);
        add_score(row.agnostic, p, ok);
        if (is_longest) mem_taken = true;
      }
      prog.line(label + " prompt " + std::to_string(i + 1) + "/" + std::to_string(enc.size()) +
                " aware " + std::to_string(row.aware.correct) + "/" +
                std::to_string(row.aware.total) + " agnostic " +
                std::to_string(row.agnostic.correct) + "/" + std::to_string(row.agnostic.total));
    }
    prog.line(label + " done: aware " + std::to_string(row.aware.correct) + "/" +
                  std::to_string(row.aware.total) + " agnostic " +
                  std::to_string(row.agnostic.correct) + "/" + std::to_string(row.agnostic.total),
              true);
    return row;
  };

  EvalMethod full;
  full.label = "full (baseline)";
  full.family = "full";
  full.cfg.method = "full";
  res.full = run_method(full);
  for (const EvalMethod& m : methods) res.rows.push_back(run_method(m));
  return res;
}

}  // namespace vq
