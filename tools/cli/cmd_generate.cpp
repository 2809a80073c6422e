// `veloxquant generate`: text generation with a chosen KV cache.
//
//   veloxquant generate [--model DIR] [--cache METHOD] [--cache-opt key=value ...]
//       [--cache-config FILE.json] (--prompt TEXT | --prompt-file F | --prompt-ids 1,2,3)
//       [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
//       [--prefill-step N] [--threads N] [--kv-dtype float16|bfloat16|float32] [--ignore-eos]
//       [--no-check-weights] [--json] [--device cpu|cuda] [--prompts-file F.jsonl] [--max-batch N]
//       [--tensor-parallel N]
//
// Many prompts (--prompts-file: one JSON object per line, {"prompt": "..."} or
// {"prompt_ids": [..]} with an optional "max_tokens", or one JSON array of such objects) and
// --device cuda go through an Engine and the batch scheduler (veloxquant/batch_generate.h):
// up to --max-batch sequences at once, each with its own sampler (seed + prompt index); the
// output lists every prompt's text in prompt order, then the totals. On cuda the memory planner
// (veloxquant/memory_plan.h) refuses a request of which not one sequence fits the card before
// anything is allocated. --device cuda without a CUDA build or device: exit status 2.
// --tensor-parallel N splits the heads and caches over N ranks (veloxquant/tensor_parallel.h):
// on the CPU the engine runs them as simulated ranks (one prompt goes through the engine too),
// which checks a checkpoint's sharding end to end; on cuda N must not exceed the visible devices
// and N > 1 needs a build with NCCL (refused, exit status 2, naming what is missing).
//
// Streams the generated text to stdout (complete UTF-8 characters only), shows a prefill
// progress bar on stderr when stderr is a terminal and the prompt spans several chunks, and ends
// with a summary on stderr: tokens, prefill/decode tokens/s, the caches' memory summed over
// layers, and the peak memory with its parts: measured peak RSS = mapped weights + activation
// buffers of the prefill chunk (GenerateResult::activation_bytes) + the caches' peak resident
// bytes + the rest (runtime, tokenizer, allocator). --json prints one JSON object with the same
// content to stdout instead. Integer options are range-checked (options.h); the prompt must fit
// the model's max_position_embeddings and generation stops at it (stop: max_position).
// --model defaults to the shipped model (find_shipped_model). A model folder without
// tokenizer.json needs --prompt-ids and prints ids.
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "options.h"
#include "veloxquant/batch_generate.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/cuda.h"
#include "veloxquant/engine.h"
#include "veloxquant/error.h"
#include "veloxquant/generate.h"
#include "veloxquant/memory_plan.h"
#include "veloxquant/model.h"
#include "veloxquant/tensor_parallel.h"
#include "veloxquant/tokenizer.h"

namespace vq::cli {

namespace {

struct GenerateArgs {
  std::string model_dir;
  std::string cache = "";
  std::vector<std::string> cache_opts;
  std::string cache_config;
  std::string prompt, prompt_file, prompt_ids;
  int64_t max_tokens = 128;
  float temperature = 0.0f;
  int64_t top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
  int64_t prefill_step = 512;
  int64_t threads = 0;
  std::string kv_dtype = "float16";
  std::string matmul = "exact";
  bool ignore_eos = false;
  bool no_check_weights = false;
  bool json = false;
  std::string device = "cpu";
  std::string prompts_file;
  int64_t max_batch = 8;
  int64_t tensor_parallel = 1;
  bool tp_simulate = false;  // --tp-simulate
};

MatmulPrecision matmul_from_string(const std::string& s) {
  if (s == "exact") return MatmulPrecision::kExact;
  if (s == "bf16") return MatmulPrecision::kBF16;
  throw Error("[generate] --matmul: expected exact or bf16 but got " + s);
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v < 0 || v > INT32_MAX)
      throw Error("[generate] --prompt-ids: expected comma-separated token ids but got '" + item +
                  "'");
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) throw Error("[generate] --prompt-ids: expected at least one id");
  return ids;
}

long peak_rss_kib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;  // KiB on Linux
}

void progress_bar(int64_t done, int64_t total) {
  const int width = 40;
  const int filled = static_cast<int>(width * done / std::max<int64_t>(total, 1));
  std::fprintf(stderr, "\r\033[Kprefill [%.*s%*s] %lld/%lld tokens", filled,
               "########################################", width - filled, "",
               static_cast<long long>(done), static_cast<long long>(total));
  if (done == total) std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
}

// One prompt of a --prompts-file: ids, or text to encode; max_tokens < 0 = --max-tokens.
struct FilePrompt {
  std::vector<int32_t> ids;
  std::string text;
  bool has_text = false;
  int64_t max_tokens = -1;
};

FilePrompt prompt_from_json(const nlohmann::json& j, const std::string& where) {
  const std::string pre = "[generate] --prompts-file: " + where + ": ";
  if (!j.is_object())
    throw Error(pre +
                "expected a JSON object {\"prompt\": ...} or {\"prompt_ids\": [...]} but got " +
                std::string(j.type_name()));
  FilePrompt p;
  for (const auto& [key, v] : j.items()) {
    if (key == "prompt") {
      if (!v.is_string()) throw Error(pre + "\"prompt\": expected a string");
      p.text = v.get<std::string>();
      p.has_text = true;
    } else if (key == "prompt_ids") {
      if (!v.is_array() || v.empty())
        throw Error(pre + "\"prompt_ids\": expected a non-empty array of token ids");
      for (const auto& id : v) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
          throw Error(pre + "\"prompt_ids\": expected token ids in [0, 2147483647] but got " +
                      id.dump());
        p.ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
    } else if (key == "max_tokens") {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxTokenCount)
        throw Error(pre + "\"max_tokens\": expected an integer in [0, 2147483647] but got " +
                    v.dump());
      p.max_tokens = v.get<int64_t>();
    } else {
      throw Error(pre + "expected the keys prompt, prompt_ids, max_tokens but got \"" + key + "\"");
    }
  }
  if (p.has_text == !p.ids.empty())
    throw Error(pre + "expected exactly one of \"prompt\" and \"prompt_ids\"");
  if (p.has_text && p.text.empty()) throw Error(pre + "\"prompt\": expected a non-empty text");
  return p;
}

// JSONL (one object per non-empty line) or one JSON array of objects.
std::vector<FilePrompt> read_prompts_file(const std::string& path) {
  const std::string text = read_text_file(path, "generate", "--prompts-file");
  std::vector<FilePrompt> out;
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && text[first] == '[') {
    nlohmann::json arr;
    try {
      arr = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw Error("[generate] --prompts-file: expected a JSON array but '" + path +
                  "' does not parse: " + e.what());
    }
    for (size_t i = 0; i < arr.size(); ++i)
      out.push_back(prompt_from_json(arr[i], "element " + std::to_string(i)));
  } else {
    std::stringstream ss(text);
    std::string line;
    for (int64_t ln = 1; std::getline(ss, line); ++ln) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        throw Error("[generate] --prompts-file: line " + std::to_string(ln) +
                    ": expected one JSON object but it does not parse: " + e.what());
      }
      out.push_back(prompt_from_json(j, "line " + std::to_string(ln)));
    }
  }
  if (out.empty())
    throw Error("[generate] --prompts-file: expected at least one prompt but '" + path +
                "' has none");
  return out;
}

int run_generate_batch(const GenerateArgs& a, Device dev, const Model& model,
                       const std::string& model_dir, const std::optional<Tokenizer>& tok,
                       const CacheConfig& cfg, std::vector<FilePrompt> fps) {
  const ModelConfig& mc = model.config();
  std::vector<BatchPrompt> prompts;
  for (size_t i = 0; i < fps.size(); ++i) {
    FilePrompt& p = fps[i];
    if (p.has_text) {
      if (!tok)
        throw Error("[generate] " + model_dir + " has no tokenizer.json: prompt " +
                    std::to_string(i) + " must be given as \"prompt_ids\"");
      p.ids = tok->encode(p.text, /*add_special_tokens=*/true);
    }
    for (int32_t id : p.ids)
      if (id >= mc.vocab_size)
        throw Error("[generate] prompt " + std::to_string(i) + ": token " + std::to_string(id) +
                    " is outside the vocabulary (" + std::to_string(mc.vocab_size) + ")");
    prompts.push_back({p.ids, p.max_tokens});
  }
  EngineOptions eo;
  eo.cache = cfg;
  eo.kv_dtype = dtype_from_string(a.kv_dtype);
  eo.matmul = matmul_from_string(a.matmul);
  eo.tensor_parallel = a.tensor_parallel;
  eo.tp_simulate = a.tp_simulate;
  BatchGenerateOptions bo;
  bo.gen.max_tokens = a.max_tokens;
  bo.gen.prefill_step_size = a.prefill_step;
  bo.gen.sampling = {a.temperature, a.top_k, a.top_p, a.seed};
  bo.gen.stop_at_eos = !a.ignore_eos;
  if (tok) bo.gen.sample_vocab = std::min<int64_t>(tok->vocab_size(), mc.vocab_size);
  bo.max_batch = a.max_batch;
  if (dev == Device::kCuda) {
    bo.device_bytes = plannable_device_bytes(true);
    bo.weight_bytes = device_weight_bytes(model, a.tensor_parallel, a.tp_simulate);
  }
  const auto engine = make_engine(dev, model, eo);
  const BatchGenerateResult r = batch_generate(*engine, prompts, bo);

  std::vector<std::string> texts;
  for (const auto& res : r.results) {
    std::string t;
    if (tok) {
      t = tok->decode(res.tokens, /*skip_special_tokens=*/true);
    } else {
      for (int32_t id : res.tokens) t += std::to_string(id) + " ";
    }
    texts.push_back(t);
  }
  const int64_t peak_dev = engine->peak_memory_bytes();
  if (a.json) {
    nlohmann::json results = nlohmann::json::array();
    for (size_t i = 0; i < r.results.size(); ++i) {
      const GenerateResult& x = r.results[i];
      results.push_back({{"index", i},
                         {"prompt_tokens", x.prompt_tokens},
                         {"generated_tokens", x.tokens.size()},
                         {"stop_reason", x.stop_reason},
                         {"tokens", x.tokens},
                         {"text", texts[i]},
                         {"prefill_seconds", x.prefill_seconds},
                         {"decode_seconds", x.decode_seconds},
                         {"decode_steps", x.decode_steps},
                         {"cache_bytes_prompt", x.cache_bytes_prompt},
                         {"cache_bytes_end", x.cache_bytes_end}});
    }
    nlohmann::json j = {{"model", model_dir},
                        {"device", device_name(dev)},
                        {"cache", nlohmann::json::parse(config_to_json(cfg))},
                        {"kv_dtype", a.kv_dtype},
                        {"matmul", a.matmul},
                        {"max_batch", a.max_batch},
                        {"max_live", r.max_live},
                        {"results", results},
                        {"totals",
                         {{"prefill_tokens", r.prefill_tokens},
                          {"prefill_seconds", r.prefill_seconds},
                          {"prefill_tokens_per_s", r.prefill_tokens_per_s()},
                          {"decode_tokens", r.decode_tokens},
                          {"decode_seconds", r.decode_seconds},
                          {"decode_tokens_per_s", r.decode_tokens_per_s()},
                          {"warm_up_seconds", r.warm_up_seconds},
                          {"peak_cache_bytes_resident", r.peak_cache_bytes_resident},
                          {"peak_cache_bytes_accounted", r.peak_cache_bytes_accounted},
                          {"peak_device_bytes", peak_dev}}}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  for (size_t i = 0; i < r.results.size(); ++i) {
    const GenerateResult& x = r.results[i];
    std::printf("--- prompt %zu (%lld tokens, %zu generated, stop: %s)\n%s\n", i,
                static_cast<long long>(x.prompt_tokens), x.tokens.size(), x.stop_reason.c_str(),
                texts[i].c_str());
  }
  std::fflush(stdout);
  std::fprintf(stderr,
               "\n--- %s | %s | cache %s | %zu prompts, at most %lld at once (max batch %lld)\n"
               "prefill  : %8.1f tokens/s (%lld tokens, %.3f s)\n"
               "decode   : %8.1f tokens/s (%lld tokens in %lld steps, %.3f s)\n"
               "cache    : peak %.1f MiB resident, %.1f MiB accounted (live sequences summed)\n",
               model_dir.c_str(), device_name(dev), cfg.method.c_str(), r.results.size(),
               static_cast<long long>(r.max_live), static_cast<long long>(a.max_batch),
               r.prefill_tokens_per_s(), static_cast<long long>(r.prefill_tokens),
               r.prefill_seconds, r.decode_tokens_per_s(), static_cast<long long>(r.decode_tokens),
               static_cast<long long>(r.decode_steps), r.decode_seconds,
               static_cast<double>(r.peak_cache_bytes_resident) / (1024.0 * 1024.0),
               static_cast<double>(r.peak_cache_bytes_accounted) / (1024.0 * 1024.0));
  if (dev == Device::kCuda)
    std::fprintf(stderr,
                 "warm-up  : %.3f s (first use of the steps' product shapes; before them)\n",
                 r.warm_up_seconds);
  return 0;
}

int run_generate(const GenerateArgs& a) {
  const Device dev = checked_device(a.device, "generate");  // before anything loads
  // Model.
  std::string model_dir = a.model_dir;
  if (model_dir.empty()) {
    model_dir = find_shipped_model();
    if (model_dir.empty())
      throw Error(
          "[generate] --model: no model folder given and the shipped model "
          "(models/vq-mini-llama) was not found");
  }
  apply_threads(a.threads);
  LoadOptions lo;
  lo.check_finite = !a.no_check_weights;
  const auto model = Model::load(model_dir, lo);
  const ModelConfig& mc = model->config();
  check_tensor_parallel(mc, dev, a.tensor_parallel, "generate", a.tp_simulate);
  std::optional<Tokenizer> tok;
  if (std::filesystem::exists(model_dir + "/tokenizer.json")) {
    tok.emplace(Tokenizer::from_file(model_dir + "/tokenizer.json"));
    check_tokenizer_vocab(tok->vocab_size(), mc, model_dir + "/tokenizer.json");
  }

  // Cache config: file, then --cache, then --cache-opt assignments.
  CacheConfig cfg;
  if (!a.cache_config.empty())
    cfg = config_from_json(read_text_file(a.cache_config, "generate", "--cache-config"));
  if (!a.cache.empty()) apply_cache_arg(cfg, a.cache);  // a method or a compact spec
  for (const auto& o : a.cache_opts) apply_cache_option(cfg, o);
  check_cache_config(cfg);

  // Prompt.
  const int n_sources =
      !a.prompt.empty() + !a.prompt_file.empty() + !a.prompt_ids.empty() + !a.prompts_file.empty();
  if (n_sources != 1)
    throw Error(
        "[generate] expected exactly one of --prompt, --prompt-file, --prompt-ids, "
        "--prompts-file but got " +
        std::to_string(n_sources));
  if (!a.prompts_file.empty())
    return run_generate_batch(a, dev, *model, model_dir, tok, cfg,
                              read_prompts_file(a.prompts_file));
  if (dev == Device::kCuda || a.tensor_parallel > 1) {  // one prompt through the engine
    FilePrompt p;
    if (!a.prompt_ids.empty()) {
      p.ids = parse_ids(a.prompt_ids);
    } else {
      p.text =
          a.prompt.empty() ? read_text_file(a.prompt_file, "generate", "--prompt-file") : a.prompt;
      p.has_text = true;
    }
    return run_generate_batch(a, dev, *model, model_dir, tok, cfg, {p});
  }
  auto caches = model->make_caches(cfg);
  std::vector<int32_t> ids;
  if (!a.prompt_ids.empty()) {
    ids = parse_ids(a.prompt_ids);
  } else {
    if (!tok)
      throw Error("[generate] " + model_dir +
                  " has no tokenizer.json: give the prompt as --prompt-ids");
    const std::string text =
        a.prompt.empty() ? read_text_file(a.prompt_file, "generate", "--prompt-file") : a.prompt;
    if (text.empty())
      throw Error("[generate] --prompt-file: expected a prompt but '" + a.prompt_file +
                  "' is empty");
    ids = tok->encode(text, /*add_special_tokens=*/true);
  }
  for (int32_t id : ids)
    if (id >= mc.vocab_size)
      throw Error("[generate] prompt token " + std::to_string(id) + " is outside the vocabulary (" +
                  std::to_string(mc.vocab_size) + ")");

  GenerateOptions o;
  o.max_tokens = a.max_tokens;
  o.prefill_step_size = a.prefill_step;
  o.sampling = {a.temperature, a.top_k, a.top_p, a.seed};
  o.stop_at_eos = !a.ignore_eos;
  o.kv_dtype = dtype_from_string(a.kv_dtype);
  o.matmul = matmul_from_string(a.matmul);
  if (tok) o.sample_vocab = std::min<int64_t>(tok->vocab_size(), mc.vocab_size);
  std::string text;
  std::optional<StreamDecoder> stream;
  if (tok) stream.emplace(*tok, /*skip_special_tokens=*/true);
  const bool stream_out = !a.json;
  o.on_token = [&](int32_t id) {
    std::string piece;
    if (stream) {
      piece = stream->push(id);
    } else {
      piece = std::to_string(id) + " ";
    }
    text += piece;
    if (stream_out && !piece.empty()) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
    return true;
  };
  const bool bar =
      isatty(STDERR_FILENO) && !a.json && static_cast<int64_t>(ids.size()) > a.prefill_step;
  if (bar) o.on_prefill_progress = progress_bar;

  const GenerateResult r = generate(*model, ids, caches, o);
  if (stream) {
    const std::string rest = stream->flush();
    text += rest;
    if (stream_out) std::fwrite(rest.data(), 1, rest.size(), stdout);
  }
  const CacheMemory mem = cache_memory(caches, mc.n_kv_heads);
  const long rss = peak_rss_kib();
  const int threads = omp_get_max_threads();
  // Peak memory and its parts: the measured peak RSS, the mapped weights (every page is read by
  // a forward pass), the activation buffers (sized by the prefill chunk) and the caches at their
  // peak; the rest is the runtime, the tokenizer and the allocator.
  const int64_t rss_bytes = static_cast<int64_t>(rss) * 1024;
  const int64_t weight_bytes = static_cast<int64_t>(model->checkpoint_bytes());
  const int64_t other_bytes = rss_bytes - weight_bytes - r.activation_bytes - r.cache_bytes_peak();
  const int64_t chunk = prefill_chunks(r.prompt_tokens, a.prefill_step).front();
  const bool hit_max_pos = r.stop_reason == "max_position";

  if (a.json) {
    nlohmann::json j = {
        {"model", model_dir},
        {"cache", nlohmann::json::parse(config_to_json(cfg))},
        {"kv_dtype", dtype_name(o.kv_dtype)},
        {"matmul", a.matmul},
        {"threads", threads},
        {"prompt_tokens", r.prompt_tokens},
        {"generated_tokens", r.tokens.size()},
        {"stop_reason", r.stop_reason},
        {"tokens", r.tokens},
        {"text", text},
        {"prefill", {{"seconds", r.prefill_seconds}, {"tokens_per_s", r.prefill_tokens_per_s()}}},
        {"decode",
         {{"steps", r.decode_steps},
          {"seconds", r.decode_seconds},
          {"tokens_per_s", r.decode_tokens_per_s()}}},
        {"memory",
         {{"summed_over_layers", true},
          {"method", mem.method},
          {"layers", mem.n_layers},
          {"tokens_seen", mem.tokens_seen},
          {"rows_kept", mem.rows_kept},
          {"rows_kept_per_head", mem.rows_kept_per_head},
          {"bytes_accounted", mem.bytes_accounted},
          {"bytes_resident", mem.bytes_resident},
          {"fp16_bytes", mem.fp16_bytes},
          {"ratio_to_fp16", mem.ratio_to_fp16()}}},
        {"peak_rss_bytes", rss_bytes},
        {"peak_memory",
         {{"peak_rss_bytes", rss_bytes},
          {"weights_bytes", weight_bytes},
          {"activation_bytes", r.activation_bytes},
          {"prefill_chunk_tokens", chunk},
          {"cache_bytes_peak", r.cache_bytes_peak()},
          {"cache_bytes_prompt", r.cache_bytes_prompt},
          {"cache_bytes_end", r.cache_bytes_end},
          {"other_bytes", other_bytes}}},
        {"max_position_embeddings", mc.max_position_embeddings}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("\n");
  std::fflush(stdout);
  const auto mib = [](int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  if (hit_max_pos)
    std::fprintf(stderr,
                 "\nveloxquant: generation stopped at the model's max_position_embeddings (%lld "
                 "positions: %lld prompt + %zu generated tokens)\n",
                 static_cast<long long>(mc.max_position_embeddings),
                 static_cast<long long>(r.prompt_tokens), r.tokens.size());
  std::fprintf(
      stderr,
      "\n--- %s | cache %s | kv %s | matmul %s | %d threads\n"
      "tokens   : %lld prompt, %zu generated (stop: %s)\n"
      "prefill  : %8.1f tokens/s (%.3f s)\n"
      "decode   : %8.1f tokens/s (%lld steps, %.3f s)\n"
      "cache    : summed over %lld layers: %lld tokens seen, %lld rows kept "
      "(%lld per head), %lld bytes accounted, %lld bytes resident, ratio to fp16 %.3f\n"
      "peak RSS : %.1f MiB = weights %.1f MiB (mapped) + activations %.1f MiB (prefill chunk "
      "of %lld tokens) + cache %.1f MiB (peak resident) + other %.1f MiB (runtime, tokenizer, "
      "allocator)\n"
      "           cache resident %.1f MiB at the prompt's end, %.1f MiB at the run's end; "
      "--prefill-step bounds the activations\n",
      model_dir.c_str(), cfg.method.c_str(), dtype_name(o.kv_dtype), a.matmul.c_str(), threads,
      static_cast<long long>(r.prompt_tokens), r.tokens.size(), r.stop_reason.c_str(),
      r.prefill_tokens_per_s(), r.prefill_seconds, r.decode_tokens_per_s(),
      static_cast<long long>(r.decode_steps), r.decode_seconds,
      static_cast<long long>(mem.n_layers), static_cast<long long>(mem.tokens_seen),
      static_cast<long long>(mem.rows_kept), static_cast<long long>(mem.rows_kept_per_head),
      static_cast<long long>(mem.bytes_accounted), static_cast<long long>(mem.bytes_resident),
      mem.ratio_to_fp16(), static_cast<double>(rss) / 1024.0, mib(weight_bytes),
      mib(r.activation_bytes), static_cast<long long>(chunk), mib(r.cache_bytes_peak()),
      mib(other_bytes), mib(r.cache_bytes_prompt), mib(r.cache_bytes_end));
  return 0;
}

}  // namespace

void add_generate_command(CLI::App& app, int* status) {
  auto* cmd = app.add_subcommand("generate", "generate text with a chosen KV cache");
  auto a = std::make_shared<GenerateArgs>();
  cmd->add_option("--model", a->model_dir,
                  "model folder (config.json, safetensors, tokenizer.json); default: the shipped "
                  "model");
  cmd->add_option("--cache", a->cache,
                  "cache method (full, snapkv, skvq, snapkv+skvq, streaming) or compact spec, e.g. "
                  "skvq:bits_key=4:bits_value=4");
  cmd->add_option("--cache-opt", a->cache_opts,
                  "cache field as key=value (repeatable), e.g. snap_budget=256 or budget=256");
  cmd->add_option("--cache-config", a->cache_config, "cache config JSON file");
  cmd->add_option("--prompt", a->prompt, "prompt text");
  cmd->add_option("--prompt-file", a->prompt_file, "file holding the prompt text");
  cmd->add_option("--prompt-ids", a->prompt_ids, "prompt as comma-separated token ids");
  add_int_option(cmd, "--max-tokens", &a->max_tokens, 0, kMaxTokenCount,
                 "tokens to generate at most (generation also stops at the model's "
                 "max_position_embeddings)",
                 "generate");
  cmd->add_option("--temperature", a->temperature, "0 = greedy")->capture_default_str();
  add_int_option(cmd, "--top-k", &a->top_k, 0, kMaxTokenCount, "0 = off", "generate");
  cmd->add_option("--top-p", a->top_p, "1 = off")->capture_default_str();
  add_uint64_option(cmd, "--seed", &a->seed, "sampling seed", "generate");
  add_int_option(cmd, "--prefill-step", &a->prefill_step, 1, kMaxTokenCount,
                 "prompt tokens per prefill chunk at most (smaller: less activation memory, "
                 "slower prefill)",
                 "generate");
  add_threads_option(cmd, &a->threads, "generate");
  cmd->add_option("--kv-dtype", a->kv_dtype,
                  "K/V dtype handed to the caches: float16, bfloat16, float32")
      ->capture_default_str();
  cmd->add_option("--matmul", a->matmul,
                  "matrix-product arithmetic: exact (fp32) or bf16 (activations rounded to bf16, "
                  "fp32 sums; bf16 weights only)")
      ->check(CLI::IsMember({"exact", "bf16"}))
      ->capture_default_str();
  cmd->add_flag("--ignore-eos", a->ignore_eos, "do not stop at the end-of-sequence token");
  cmd->add_flag("--no-check-weights", a->no_check_weights,
                "skip the scan of the weights for NaN/Inf at load (faster start)");
  cmd->add_flag("--json", a->json, "print the result as one JSON object");
  cmd->add_option("--device", a->device, "cpu or cuda (cuda: the CUDA engine; needs a CUDA build)")
      ->capture_default_str();
  cmd->add_option("--prompts-file", a->prompts_file,
                  "many prompts: JSONL, one {\"prompt\": \"...\"} or {\"prompt_ids\": [..]} per "
                  "line (optional \"max_tokens\"), or one JSON array of them");
  add_int_option(cmd, "--max-batch", &a->max_batch, 1, 4096,
                 "sequences generated at once at most (--prompts-file, --device cuda)", "generate");
  add_tensor_parallel_option(cmd, &a->tensor_parallel, "generate", &a->tp_simulate);
  cmd->callback([a, status] { *status = run_generate(*a); });
}

}  // namespace vq::cli
