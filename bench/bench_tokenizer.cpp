// Tokenizer throughput (Google Benchmark): encode of a 1 MB text (the held-out documents of
// data/eval/heldout.jsonl, concatenated and cut to 1,000,000 bytes at a character boundary)
// with the shipped model's tokenizer and the small test tokenizers, warm (word cache filled by
// earlier iterations) and cold (a freshly loaded tokenizer each iteration, load not timed);
// decode and streaming decode of the resulting ids. Reported as bytes/s of UTF-8 text.
// Run: build-*/bench/bench_tokenizer [--benchmark_repetitions=5]
#include <benchmark/benchmark.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "veloxquant/tokenizer.h"

namespace {

namespace fs = std::filesystem;

std::string repo_path(const std::string& rel) {
  if (const char* root = std::getenv("VQ_SOURCE_DIR")) return std::string(root) + "/" + rel;
  return (fs::path(__FILE__).parent_path().parent_path() / rel).string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// 1,000,000 bytes of held-out text (repeated if the file is shorter), or "" when absent.
const std::string& megabyte_text() {
  static const std::string text = [] {
    std::string all;
    std::istringstream lines(read_file(repo_path("data/eval/heldout.jsonl")));
    std::string line;
    while (std::getline(lines, line)) {
      if (!line.empty()) all += nlohmann::json::parse(line).at("text").get<std::string>() + "\n";
    }
    if (all.empty()) return std::string();
    std::string out;
    while (out.size() < 1'000'000) out += all;
    size_t n = 1'000'000;
    while (n > 0 && (static_cast<unsigned char>(out[n]) & 0xC0) == 0x80) --n;
    out.resize(n);
    return out;
  }();
  return text;
}

void bm_encode(benchmark::State& state, const std::string& rel, bool cold) {
  const std::string path = repo_path(rel);
  const std::string& text = megabyte_text();
  if (text.empty() || !fs::exists(path)) {
    state.SkipWithError("data/eval/heldout.jsonl or the tokenizer file is missing");
    return;
  }
  std::optional<vq::Tokenizer> tok(vq::Tokenizer::from_file(path));
  size_t n_tokens = 0;
  for (auto _ : state) {
    if (cold) {
      state.PauseTiming();
      tok.emplace(vq::Tokenizer::from_file(path));
      state.ResumeTiming();
    }
    const auto ids = tok->encode(text, false);
    n_tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(n_tokens);
}

void bm_decode(benchmark::State& state, bool streaming) {
  const std::string path = repo_path("models/vq-mini-llama/tokenizer.json");
  const std::string& text = megabyte_text();
  if (text.empty() || !fs::exists(path)) {
    state.SkipWithError("data/eval/heldout.jsonl or the model tokenizer is missing");
    return;
  }
  const vq::Tokenizer tok = vq::Tokenizer::from_file(path);
  const std::vector<int32_t> ids = tok.encode(text, false);
  for (auto _ : state) {
    if (streaming) {
      vq::StreamDecoder stream(tok);
      size_t bytes = 0;
      for (int32_t id : ids) bytes += stream.push(id).size();
      bytes += stream.flush().size();
      benchmark::DoNotOptimize(bytes);
    } else {
      const std::string out = tok.decode(ids);
      benchmark::DoNotOptimize(out.data());
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(ids.size());
}

}  // namespace

BENCHMARK_CAPTURE(bm_encode, model_warm, "models/vq-mini-llama/tokenizer.json", false)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_encode, model_cold, "models/vq-mini-llama/tokenizer.json", true)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_encode, bl_bpe_warm, "tests/data/tokenizers/bl_bpe.json", false)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_encode, sp_meta_warm, "tests/data/tokenizers/sp_meta.json", false)
    ->Unit(benchmark::kMillisecond);
// Llama-2 legacy layout: no pre-tokenizer, so the whole megabyte is one BPE word (worst case).
BENCHMARK_CAPTURE(bm_encode, sp_bpe_one_word, "tests/data/tokenizers/sp_bpe.json", false)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_decode, model_full, false)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_decode, model_stream, true)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
