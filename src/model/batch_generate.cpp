// The batch scheduler (veloxquant/batch_generate.h): admission, prefill steps of whole chunks,
// decode steps over every decoding sequence, per-sequence sampling as vq::generate does it.
#include "veloxquant/batch_generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <optional>

#include "veloxquant/error.h"
#include "veloxquant/prefill_schedule.h"

namespace vq {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Seq {
  int64_t index = 0;  // prompt index
  int64_t id = -1;    // engine sequence id
  std::vector<int64_t> chunks;
  size_t next_chunk = 0;
  int64_t done_tokens = 0;
  int64_t max_tokens = 0;
  std::optional<Sampler> sampler;
  bool finished = false;
};

}  // namespace

BatchGenerateResult batch_generate(Engine& engine, std::span<const BatchPrompt> prompts,
                                   const BatchGenerateOptions& o) {
  const ModelConfig& cfg = engine.config();
  const GenerateOptions& g = o.gen;
  // ---- refusals, before any sequence exists
  VQ_CHECK(!prompts.empty(), "[batch_generate] expected at least one prompt but got none");
  VQ_CHECK(o.max_batch >= 1,
           "[batch_generate] max_batch: expected >= 1 but got " + std::to_string(o.max_batch));
  VQ_CHECK(g.prefill_step_size >= 1, "[batch_generate] prefill_step_size: expected >= 1 but got " +
                                         std::to_string(g.prefill_step_size));
  VQ_CHECK(g.sample_vocab >= 0 && g.sample_vocab <= cfg.vocab_size,
           "[batch_generate] sample_vocab: expected a value in [0, " +
               std::to_string(cfg.vocab_size) + "] (0 = all) but got " +
               std::to_string(g.sample_vocab));
  const int64_t max_pos = cfg.max_position_embeddings;
  int64_t longest = 0;  // prompt + max_tokens of the longest request (the plan's context)
  int64_t longest_prompt = 1, longest_new = 0;
  int64_t max_prompt = 0;  // the most prompt tokens of any request (warm_up's prefill step)
  for (size_t i = 0; i < prompts.size(); ++i) {
    const BatchPrompt& p = prompts[i];
    const std::string which = "prompt " + std::to_string(i);
    VQ_CHECK(!p.ids.empty(),
             "[batch_generate] expected at least one token in " + which + " but got none");
    for (size_t t = 0; t < p.ids.size(); ++t)
      VQ_CHECK(p.ids[t] >= 0 && p.ids[t] < cfg.vocab_size,
               "[batch_generate] expected token ids in [0, " + std::to_string(cfg.vocab_size) +
                   ") but " + which + " has " + std::to_string(p.ids[t]) + " at token " +
                   std::to_string(t));
    const int64_t n = static_cast<int64_t>(p.ids.size());
    max_prompt = std::max(max_prompt, n);
    if (max_pos > 0)
      VQ_CHECK(n <= max_pos, "[batch_generate] expected " + which +
                                 " to fit the model's max_position_embeddings " +
                                 std::to_string(max_pos) + " but it has " + std::to_string(n) +
                                 " tokens");
    const int64_t mt = p.max_tokens >= 0 ? p.max_tokens : g.max_tokens;
    VQ_CHECK(mt >= 0, "[batch_generate] max_tokens: expected >= 0 but got " + std::to_string(mt) +
                          " for " + which);
    int64_t ctx = n + mt;
    if (max_pos > 0) ctx = std::min(ctx, max_pos + 1);  // generation stops at max_pos
    if (ctx > longest) {
      longest = ctx;
      longest_prompt = n;
      longest_new = ctx - n;
    }
  }

  BatchGenerateResult res;
  res.results.resize(prompts.size());
  int64_t live_cap = std::min<int64_t>(o.max_batch, static_cast<int64_t>(prompts.size()));
  if (o.device_bytes > 0) {
    MemoryPlanRequest req;
    req.model = cfg;
    req.cache = engine.options().cache;
    req.kv_dtype = engine.options().kv_dtype;
    req.prompt_tokens = longest_prompt;
    req.max_new_tokens = longest_new;
    req.prefill_step = g.prefill_step_size;
    req.weight_bytes = o.weight_bytes;
    req.device_bytes = o.device_bytes;
    req.max_batch = live_cap;
    req.tensor_parallel = engine.options().tensor_parallel;
    const bool one_memory = engine.options().tp_simulate || engine.device() == Device::kCpu;
    req.ranks_per_device = one_memory ? req.tensor_parallel : 1;
    req.reserve_capacity = engine.reserves_capacity();  // each sequence reserves below (admission)
    res.plan = plan_memory(req);
    check_fits(res.plan, req, o.require_full_batch ? live_cap : 1);
    live_cap = std::min(live_cap, res.plan.max_sequences);
  }
  // Every step has at most live_cap logit rows and decode rows, and a prefill step at most
  // min(prefill_step_size, longest prompt) tokens (its usual count).
  if (o.warm_up)
    res.warm_up_seconds = engine.warm_up(live_cap, std::min(g.prefill_step_size, max_prompt));

  const int64_t n_sample = g.sample_vocab > 0 ? g.sample_vocab : cfg.vocab_size;
  const std::vector<int32_t>& stop = g.stop_ids.empty() ? cfg.eos_token_ids : g.stop_ids;
  std::deque<int64_t> waiting;
  for (size_t i = 0; i < prompts.size(); ++i) waiting.push_back(static_cast<int64_t>(i));
  std::vector<Seq> live;  // admission order
  std::vector<float> logits;

  // Samples token i = tokens.size() of s from logit row `row` and decides whether s goes on;
  // marks it finished (stop_reason set) otherwise. Mirrors vq::generate's decode loop.
  // Greedy decoding picks on the engine (Engine::step_greedy: on the CUDA engine only the ids
  // leave the device); `row` is then null and `picked` the engine's id (-1: no finite logit).
  const bool greedy = g.sampling.temperature <= 0.0f;
  std::vector<int32_t> picked_ids;
  auto advance = [&](Seq& s, const float* row, int32_t picked) {
    GenerateResult& r = res.results[static_cast<size_t>(s.index)];
    const int64_t n = r.prompt_tokens;
    const int64_t i = static_cast<int64_t>(r.tokens.size());
    if (max_pos > 0 && n + i >= max_pos) {
      r.stop_reason = "max_position";
      s.finished = true;
      return;
    }
    bool finite = !row && picked >= 0;
    for (int64_t v = 0; row && v < cfg.vocab_size && !finite; ++v) finite = std::isfinite(row[v]);
    VQ_CHECK(finite, "[batch_generate] expected finite logits but all " +
                         std::to_string(cfg.vocab_size) + " logits for generated token " +
                         std::to_string(i) + " of prompt " + std::to_string(s.index) +
                         " (position " + std::to_string(n + i) + ") are NaN or infinite");
    const int32_t token = row ? s.sampler->sample(row, n_sample) : picked;
    r.tokens.push_back(token);
    const bool keep_going = !o.on_token || o.on_token(s.index, token);
    if (g.stop_at_eos && std::find(stop.begin(), stop.end(), token) != stop.end()) {
      r.stop_reason = "eos";
      s.finished = true;
    } else if (!keep_going) {
      r.stop_reason = "callback";
      s.finished = true;
    } else if (static_cast<int64_t>(r.tokens.size()) >= s.max_tokens) {
      s.finished = true;  // "max_tokens"
    } else if (max_pos > 0 && n + i + 1 >= max_pos) {
      r.stop_reason = "max_position";  // the next token would not fit
      s.finished = true;
    }
  };
  auto retire = [&](Seq& s) {
    GenerateResult& r = res.results[static_cast<size_t>(s.index)];
    r.cache_bytes_end = engine.memory(s.id).bytes_resident;
    engine.remove_sequence(s.id);
  };

  std::vector<SeqChunk> chunks;
  std::vector<Seq*> in_step;
  std::vector<int32_t> decode_tokens;
  while (!waiting.empty() || !live.empty()) {
    // ---- admission
    while (!waiting.empty() && static_cast<int64_t>(live.size()) < live_cap) {
      Seq s;
      s.index = waiting.front();
      waiting.pop_front();
      const BatchPrompt& p = prompts[static_cast<size_t>(s.index)];
      GenerateResult& r = res.results[static_cast<size_t>(s.index)];
      r.prompt_tokens = static_cast<int64_t>(p.ids.size());
      r.stop_reason = "max_tokens";
      s.max_tokens = p.max_tokens >= 0 ? p.max_tokens : g.max_tokens;
      s.chunks = prefill_chunks(r.prompt_tokens, g.prefill_step_size);
      SamplingParams sp = g.sampling;
      sp.seed = g.sampling.seed + static_cast<uint64_t>(s.index);
      s.sampler.emplace(sp);
      s.id = engine.add_sequence();
      // its whole length up front: no cache growth on the first decode steps
      engine.reserve(s.id, r.prompt_tokens + std::max<int64_t>(s.max_tokens - 1, 0));
      live.push_back(std::move(s));
    }
    res.max_live = std::max<int64_t>(res.max_live, static_cast<int64_t>(live.size()));

    // ---- one step: prefill chunks while any sequence prefills, else decode
    chunks.clear();
    in_step.clear();
    const bool prefill = std::any_of(live.begin(), live.end(),
                                     [](const Seq& s) { return s.next_chunk < s.chunks.size(); });
    if (prefill) {
      int64_t budget = g.prefill_step_size;
      for (Seq& s : live) {
        if (s.next_chunk >= s.chunks.size()) continue;
        const int64_t c = s.chunks[s.next_chunk];
        if (!chunks.empty() && c > budget) break;  // admission order: no overtaking
        const bool last = s.next_chunk + 1 == s.chunks.size();
        const auto& ids = prompts[static_cast<size_t>(s.index)].ids;
        SeqChunk ch;
        ch.seq = s.id;
        ch.tokens = std::span<const int32_t>(ids.data() + s.done_tokens, static_cast<size_t>(c));
        ch.logits = last && s.max_tokens > 0;
        ch.end_prompt = last;
        chunks.push_back(ch);
        in_step.push_back(&s);
        budget -= c;
        if (budget <= 0) break;
      }
    } else {
      decode_tokens.resize(live.size());
      for (size_t k = 0; k < live.size(); ++k) {
        Seq& s = live[k];
        decode_tokens[k] = res.results[static_cast<size_t>(s.index)].tokens.back();
        SeqChunk ch;
        ch.seq = s.id;
        ch.tokens = std::span<const int32_t>(&decode_tokens[k], 1);
        chunks.push_back(ch);
        in_step.push_back(&s);
      }
    }

    const auto t0 = std::chrono::steady_clock::now();
    if (greedy)
      engine.step_greedy(chunks, n_sample, &picked_ids);
    else
      engine.step(chunks, &logits);
    int64_t row = 0;
    for (size_t k = 0; k < chunks.size(); ++k) {
      Seq& s = *in_step[k];
      GenerateResult& r = res.results[static_cast<size_t>(s.index)];
      if (prefill) {
        s.done_tokens += s.chunks[s.next_chunk];
        ++s.next_chunk;
        if (s.next_chunk == s.chunks.size()) {
          r.cache_bytes_prompt = engine.memory(s.id).bytes_resident;
          if (s.max_tokens == 0) s.finished = true;
        }
      } else {
        ++r.decode_steps;
      }
      if (chunks[k].logits) {
        if (greedy)
          advance(s, nullptr, picked_ids[static_cast<size_t>(row++)]);
        else
          advance(s, logits.data() + static_cast<size_t>(row++ * cfg.vocab_size), -1);
      }
    }
    const double dt = seconds_since(t0);
    for (Seq* s : in_step) {
      GenerateResult& r = res.results[static_cast<size_t>(s->index)];
      (prefill ? r.prefill_seconds : r.decode_seconds) += dt;
    }
    if (prefill) {
      res.prefill_seconds += dt;
      ++res.prefill_steps;
      for (const SeqChunk& ch : chunks)
        res.prefill_tokens += static_cast<int64_t>(ch.tokens.size());
    } else {
      res.decode_seconds += dt;
      if (res.decode_steps == 0) res.first_decode_step_seconds = dt;
      ++res.decode_steps;
      res.decode_tokens += static_cast<int64_t>(chunks.size());
    }

    // ---- memory, then retire the finished sequences (their caches freed)
    int64_t resident = 0, accounted = 0;
    for (const Seq& s : live) {
      const CacheMemory m = engine.memory(s.id);
      resident += m.bytes_resident;
      accounted += m.bytes_accounted;
    }
    res.peak_cache_bytes_resident = std::max(res.peak_cache_bytes_resident, resident);
    res.peak_cache_bytes_accounted = std::max(res.peak_cache_bytes_accounted, accounted);
    if (!prefill) res.decode_cache_bytes += accounted;
    for (Seq& s : live)
      if (s.finished) retire(s);
    live.erase(std::remove_if(live.begin(), live.end(), [](const Seq& s) { return s.finished; }),
               live.end());
  }
  return res;
}

}  // namespace vq
