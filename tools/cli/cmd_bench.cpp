// `veloxquant bench`: end-to-end throughput of many sequences per cache method on one engine.
//
//   veloxquant bench [--model DIR] [--device cpu|cuda] --methods "full,skvq:bits_key=4:..."
//       [--batch 8] [--context 32768] [--gen 32] [--prompt-ids random] [--prefill-step N]
//       [--max-batch-fit] [--plan-only] [--seed S] [--threads N] [--kv-dtype ...] [--json]
//       [--tensor-parallel N] [--phases] [--synthetic-prefill] [--no-reserve]
//       [--no-batch-decode] [--no-warm-up]
//
// Per method: --batch sequences of --context random prompt ids (seeded, one prompt per sequence)
// and --gen generated tokens each (greedy, no EOS stop) through the batch scheduler
// (veloxquant/batch_generate.h), all of them live at once (refused by the memory planner before
// anything is allocated when they cannot fit). Prints prefill and decode tokens/s, the caches'
// peak bytes (summed over the live sequences), the engine's peak device memory (cuda), and the
// decode bound: decode tokens / ((decode steps x weight bytes per token + cache bytes the decode
// steps read) / copy bandwidth), the copy bandwidth measured in the same run by the engine
// (Engine::copy_bandwidth: a memcpy of 256 MiB on the CPU), with the decode figure as % of it.
// --max-batch-fit runs each method at the largest batch the planner fits in the device's memory
// (plannable_device_bytes, options.h: cuda, the card's memory less 1 GiB; cpu, the machine's
// physical memory) with that batch's own workspace (its logit rows) counted, instead of --batch;
// --tensor-parallel N splits every sequence's heads and caches over N ranks: on the CPU the
// engine's simulated ranks (one machine holds them all, so the planner's single-device figures
// stay right); on cuda N must not exceed the visible devices and N > 1 needs NCCL.
// --plan-only prints the planner's figures without running anything;
// --phases (cuda) adds the time of each phase of the engine's steps (EngineOptions::time_phases);
// --synthetic-prefill fills the caches with pseudo-random K/V instead of prefilling (no prefill
// figure; decode only, see synthetic_run);
// --no-reserve / --no-batch-decode / --no-batch-writes (cuda) turn off EngineOptions::
// reserve_capacity / batch_decode / batch_cache_writes
// (the engine as before session 9, for a before / after in one run).
// Before the first step each run calls Engine::warm_up (cuBLAS's first use of the steps' product
// shapes, engine.h) and reports its time apart ("warm_up_seconds", the "warm-up" lines): it is
// in no prefill or decode figure. --no-warm-up leaves each shape's first use to the step that
// first runs it (the engine before session 11, for a before / after).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "options.h"
#include "veloxquant/batch_generate.h"
#include "veloxquant/cache_config.h"
#include "veloxquant/cuda.h"
#include "veloxquant/dtype.h"
#include "veloxquant/engine.h"
#include "veloxquant/error.h"
#include "veloxquant/memory_plan.h"
#include "veloxquant/model.h"
#include "veloxquant/tensor_parallel.h"

namespace vq::cli {

namespace {

struct BenchArgs {
  std::string model_dir;
  std::string device = "cpu";
  std::string methods = "full";
  int64_t batch = 8;
  int64_t context = 4096;
  int64_t gen = 32;
  std::string prompt_ids = "random";
  int64_t prefill_step = 512;
  uint64_t seed = 0;
  int64_t threads = 0;
  std::string kv_dtype = "float16";
  bool max_batch_fit = false;
  bool plan_only = false;
  bool no_check_weights = false;
  bool json = false;
  int64_t tensor_parallel = 1;
  bool tp_simulate = false;  // --tp-simulate
  bool phases = false;
  bool synthetic_prefill = false;
  bool no_reserve = false;       // --no-reserve (cuda): caches grow on demand (before session 9)
  bool no_batch_decode = false;  // --no-batch-decode (cuda): one decode launch per sequence
  bool no_batch_writes = false;  // --no-batch-writes (cuda): each cache row write on its own
  bool no_warm_up = false;       // --no-warm-up: no Engine::warm_up before the first step
};

std::vector<std::string> split_methods(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  if (out.empty()) throw Error("[bench] --methods: expected at least one cache spec but got none");
  return out;
}

struct Row {
  std::string spec;
  MemoryPlan plan;
  int64_t batch = 0;
  bool ran = false;
  BatchGenerateResult r;
  double bandwidth = 0;  // bytes/s
  double bound_tps = 0;  // decode tokens/s bound
  int64_t peak_device = 0;
  std::vector<PhaseTime> phases;  // --phases (cuda)
  double fill_seconds = 0;        // --synthetic-prefill: time to fill the caches (not a prefill)
};

// --synthetic-prefill: every sequence's caches filled by Engine::fill_synthetic (no model
// forward, so no prefill figure), then (with warm_up) Engine::warm_up for decode steps of up to
// batch rows, then gen - 1 greedy decode steps over all of them at once, timed as batch_generate
// times its decode steps (step_greedy; cache bytes summed after each step for the bound). The
// first decode token is fed as id 1 (any id: the caches decide the work).
BatchGenerateResult synthetic_run(Engine& engine, int64_t batch, int64_t context, int64_t gen,
                                  int64_t chunk, uint64_t seed, bool warm_up,
                                  double* fill_seconds) {
  BatchGenerateResult r;
  std::vector<int64_t> ids;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t b = 0; b < batch; ++b) {
    ids.push_back(engine.add_sequence());
    engine.reserve(ids.back(), context + std::max<int64_t>(gen - 1, 0));  // as batch_generate
    engine.fill_synthetic(ids.back(), context, chunk, seed);
  }
  *fill_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (warm_up) r.warm_up_seconds = engine.warm_up(batch);
  r.max_live = batch;
  std::vector<int32_t> tokens(static_cast<size_t>(batch), 1), picked;
  std::vector<SeqChunk> chunks(static_cast<size_t>(batch));
  const int64_t V = engine.config().vocab_size;
  for (int64_t step = 1; step < gen; ++step) {
    for (size_t i = 0; i < chunks.size(); ++i) {
      chunks[i].seq = ids[i];
      chunks[i].tokens = std::span<const int32_t>(&tokens[i], 1);
    }
    const auto s0 = std::chrono::steady_clock::now();
    engine.step_greedy(chunks, V, &picked);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
    r.decode_seconds += dt;
    if (step == 1) r.first_decode_step_seconds = dt;  // as batch_generate's
    ++r.decode_steps;
    r.decode_tokens += batch;
    int64_t resident = 0, accounted = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      tokens[i] = std::max(picked[i], 0);
      const CacheMemory m = engine.memory(ids[i]);
      resident += m.bytes_resident;
      accounted += m.bytes_accounted;
    }
    r.peak_cache_bytes_resident = std::max(r.peak_cache_bytes_resident, resident);
    r.peak_cache_bytes_accounted = std::max(r.peak_cache_bytes_accounted, accounted);
    r.decode_cache_bytes += accounted;
  }
  return r;
}

// --phases: ms per step of each phase (device time between CUDA events, and the host's), per
// step kind, with each phase's share of the kind's device time.
void print_phases(const std::string& spec, const std::vector<PhaseTime>& phases) {
  if (phases.empty()) return;
  std::printf(
      "\nphases of %s (ms per step; device time between CUDA events, host time between "
      "the same points; syncs, mallocs, frees: calls per step that wait):\n\n"
      "| steps | phase | device ms | host ms | share | syncs | mallocs | frees |\n"
      "|---|---|---:|---:|---:|---:|---:|---:|\n",
      spec.c_str());
  for (int decode = 1; decode >= 0; --decode) {
    double total = 0;
    for (const PhaseTime& p : phases)
      if (p.decode == (decode == 1)) total += p.gpu_seconds;
    for (const PhaseTime& p : phases) {
      if (p.decode != (decode == 1) || p.steps == 0) continue;
      const double n = static_cast<double>(p.steps);
      std::printf("| %s (%lld) | %s | %.3f | %.3f | %.1f%% | %.1f | %.1f | %.1f |\n",
                  decode ? "decode" : "prefill", static_cast<long long>(p.steps), p.phase.c_str(),
                  1e3 * p.gpu_seconds / n, 1e3 * p.host_seconds / n,
                  total > 0 ? 100.0 * p.gpu_seconds / total : 0.0, static_cast<double>(p.syncs) / n,
                  static_cast<double>(p.mallocs) / n, static_cast<double>(p.frees) / n);
    }
  }
}

// --max-batch-fit: the largest n whose own plan (max_batch = n: n logit rows and a step of
// max(prefill_step, n) tokens in the workspace) fits n sequences. The workspace grows with n, so
// max_sequences(n) - n falls as n grows: a binary search over 1 .. max_sequences(1). Returns that
// plan (req.max_batch = n), or the max_batch = 1 plan when not even one fits.
MemoryPlan plan_largest_batch(MemoryPlanRequest& req) {
  req.max_batch = 1;
  const MemoryPlan one = plan_memory(req);
  int64_t lo = 1, hi = one.max_sequences;  // fits(lo) once one fits; the answer is <= hi
  if (hi < 1) return one;
  while (lo < hi) {
    req.max_batch = lo + (hi - lo + 1) / 2;
    if (plan_memory(req).max_sequences >= req.max_batch)
      lo = req.max_batch;
    else
      hi = req.max_batch - 1;
  }
  req.max_batch = lo;
  return plan_memory(req);
}

int run_bench(const BenchArgs& a) {
  const Device dev = checked_device(a.device, "bench");  // before anything loads
  if (a.prompt_ids != "random")
    throw Error("[bench] --prompt-ids: expected random but got '" + a.prompt_ids + "'");
  const auto specs = split_methods(a.methods);
  std::vector<CacheConfig> cfgs;
  for (const auto& s : specs) cfgs.push_back(parse_cache_arg(s));  // all checked before loading
  std::string model_dir = a.model_dir;
  if (model_dir.empty()) model_dir = find_shipped_model();
  if (model_dir.empty())
    throw Error("[bench] --model: no model folder given and the shipped model was not found");
  apply_threads(a.threads);
  LoadOptions lo;
  lo.check_finite = !a.no_check_weights;
  const auto model = Model::load(model_dir, lo);
  const ModelConfig& mc = model->config();
  check_tensor_parallel(mc, dev, a.tensor_parallel, "bench", a.tp_simulate);
  const DType kv = dtype_from_string(a.kv_dtype);
  // cuda with tensor_parallel > 1: the plan is the busiest device's (memory_plan.h); the CPU
  // engine's ranks share one memory and the mapped checkpoint
  const bool one_memory = a.tp_simulate || dev == Device::kCpu;
  const int64_t weight_bytes = dev == Device::kCpu
                                   ? static_cast<int64_t>(model->checkpoint_bytes())
                                   : device_weight_bytes(*model, a.tensor_parallel, a.tp_simulate);
  const int64_t mem = plannable_device_bytes(dev == Device::kCuda);

  std::vector<Row> rows;
  for (size_t m = 0; m < cfgs.size(); ++m) {
    Row row;
    row.spec = specs[m];
    MemoryPlanRequest req;
    req.model = mc;
    req.cache = cfgs[m];
    req.kv_dtype = kv;
    req.prompt_tokens = a.context;
    req.max_new_tokens = a.gen;
    req.prefill_step = a.prefill_step;
    req.weight_bytes = weight_bytes;
    req.device_bytes = mem;
    req.max_batch = a.batch;
    req.tensor_parallel = a.tensor_parallel;
    req.ranks_per_device = one_memory ? a.tensor_parallel : 1;
    req.reserve_capacity = dev == Device::kCuda && !a.no_reserve;  // the CUDA engine reserves
    row.plan = a.max_batch_fit ? plan_largest_batch(req) : plan_memory(req);
    row.batch = a.max_batch_fit ? std::min(row.plan.max_sequences, req.max_batch) : a.batch;
    if (a.max_batch_fit && row.batch < 1) check_fits(row.plan, req, 1);  // refuses, naming why
    if (!a.plan_only) {
      EngineOptions eo;
      eo.cache = cfgs[m];
      eo.kv_dtype = kv;
      eo.tensor_parallel = a.tensor_parallel;
      eo.tp_simulate = a.tp_simulate;
      eo.time_phases = a.phases;
      eo.reserve_capacity = !a.no_reserve;
      eo.batch_decode = !a.no_batch_decode;
      eo.batch_cache_writes = !a.no_batch_writes;
      if (dev == Device::kCuda) {  // refused before the engine uploads anything
        req.max_batch = row.batch;
        check_fits(plan_memory(req), req, row.batch);
      }
      std::vector<BatchPrompt> prompts(static_cast<size_t>(row.batch));
      std::mt19937_64 rng(a.seed);
      for (auto& p : prompts) {
        p.ids.resize(static_cast<size_t>(a.context));
        for (auto& id : p.ids)
          id = static_cast<int32_t>(rng() % static_cast<uint64_t>(mc.vocab_size));
      }
      BatchGenerateOptions bo;
      bo.gen.max_tokens = a.gen;
      bo.gen.prefill_step_size = a.prefill_step;
      bo.gen.stop_at_eos = false;
      bo.max_batch = row.batch;
      bo.require_full_batch = true;
      bo.warm_up = !a.no_warm_up;
      if (dev == Device::kCuda) {
        bo.device_bytes = mem;
        bo.weight_bytes = weight_bytes;
      }
      if (!a.json)
        std::fprintf(stderr, "bench: %s, %lld x %lld tokens + %lld generated...\n",
                     row.spec.c_str(), static_cast<long long>(row.batch),
                     static_cast<long long>(a.context), static_cast<long long>(a.gen));
      auto engine = make_engine(dev, *model, eo);
      if (a.synthetic_prefill)
        row.r = synthetic_run(*engine, row.batch, a.context, a.gen, a.prefill_step, a.seed,
                              !a.no_warm_up, &row.fill_seconds);
      else
        row.r = batch_generate(*engine, prompts, bo);
      row.bandwidth = engine->copy_bandwidth();
      row.peak_device = engine->peak_memory_bytes();
      row.phases = engine->phase_times();
      const double step_bytes = static_cast<double>(row.r.decode_steps) *
                                    static_cast<double>(model->weight_bytes_per_token()) +
                                static_cast<double>(row.r.decode_cache_bytes);
      row.bound_tps = step_bytes > 0
                          ? static_cast<double>(row.r.decode_tokens) * row.bandwidth / step_bytes
                          : 0.0;
      row.ran = true;
    }
    rows.push_back(std::move(row));
  }

  const auto mib = [](int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const Row& r : rows) {
      nlohmann::json j = {{"method", r.spec},
                          {"batch", r.batch},
                          {"context", a.context},
                          {"gen", a.gen},
                          {"plan",
                           {{"cache_bytes_per_sequence", r.plan.cache_bytes_peak},
                            {"cache_bytes_exact", r.plan.cache_bytes_exact},
                            {"cache_bytes_resident_per_sequence", r.plan.cache_bytes_resident},
                            {"weight_bytes", r.plan.weight_bytes},
                            {"workspace_bytes", r.plan.workspace_bytes},
                            {"device_bytes", mem},
                            {"max_sequences", r.plan.max_sequences}}}};
      if (r.ran)
        j["run"] = {
            {"prefill_tokens_per_s", r.r.prefill_tokens_per_s()},
            {"decode_tokens_per_s", r.r.decode_tokens_per_s()},
            {"prefill_seconds", r.r.prefill_seconds},
            {"decode_seconds", r.r.decode_seconds},
            {"decode_steps", r.r.decode_steps},
            {"synthetic_prefill", a.synthetic_prefill},
            {"synthetic_fill_seconds", r.fill_seconds},
            {"warm_up_seconds", r.r.warm_up_seconds},
            {"first_decode_step_seconds", r.r.first_decode_step_seconds},
            {"steady_decode_tokens_per_s", r.r.steady_decode_tokens_per_s()},
            {"steady_decode_pct_of_bound",
             r.bound_tps > 0 ? 100.0 * r.r.steady_decode_tokens_per_s() / r.bound_tps : 0.0},
            {"peak_cache_bytes_resident", r.r.peak_cache_bytes_resident},
            {"peak_cache_bytes_accounted", r.r.peak_cache_bytes_accounted},
            {"peak_device_bytes", r.peak_device},
            {"copy_bandwidth_bytes_per_s", r.bandwidth},
            {"decode_bound_tokens_per_s", r.bound_tps},
            {"decode_pct_of_bound",
             r.bound_tps > 0 ? 100.0 * r.r.decode_tokens_per_s() / r.bound_tps : 0.0}};
      if (!r.phases.empty()) {
        nlohmann::json ph = nlohmann::json::array();
        for (const PhaseTime& p : r.phases)
          ph.push_back({{"phase", p.phase},
                        {"decode", p.decode},
                        {"steps", p.steps},
                        {"gpu_seconds", p.gpu_seconds},
                        {"host_seconds", p.host_seconds},
                        {"syncs", p.syncs},
                        {"mallocs", p.mallocs},
                        {"frees", p.frees}});
        j["phases"] = ph;
      }
      out.push_back(j);
    }
    nlohmann::json top = {{"model", model_dir},
                          {"device", device_name(dev)},
                          {"kv_dtype", a.kv_dtype},
                          {"weight_bytes_per_token", model->weight_bytes_per_token()},
                          {"reserve", !a.no_reserve},
                          {"batch_decode", !a.no_batch_decode},
                          {"batch_cache_writes", !a.no_batch_writes},
                          {"warm_up", !a.no_warm_up},
                          {"methods", out}};
    std::printf("%s\n", top.dump(2).c_str());
    return 0;
  }
  std::printf("%s on %s: %lld-token prompts + %lld generated, device memory %.0f MiB\n\n",
              model_dir.c_str(), device_name(dev), static_cast<long long>(a.context),
              static_cast<long long>(a.gen), mib(mem));
  std::printf(
      "| method | batch | fits | cache MiB/seq (plan) | prefill tok/s | decode tok/s | peak cache "
      "MiB | peak device MiB | bound tok/s | %% of bound |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    std::printf("| %s | %lld | %lld | %.1f%s |", r.spec.c_str(), static_cast<long long>(r.batch),
                static_cast<long long>(r.plan.max_sequences), mib(r.plan.cache_bytes_peak),
                r.plan.cache_bytes_exact ? "" : " (bound)");
    if (!r.ran) {
      std::printf(" - | - | - | - | - | - |\n");
      continue;
    }
    std::printf(" %.1f | %.2f | %.1f | %s | %.2f | %.1f |\n", r.r.prefill_tokens_per_s(),
                r.r.decode_tokens_per_s(), mib(r.r.peak_cache_bytes_resident),
                r.peak_device > 0 ? std::to_string(mib(r.peak_device)).c_str() : "-", r.bound_tps,
                r.bound_tps > 0 ? 100.0 * r.r.decode_tokens_per_s() / r.bound_tps : 0);
  }
  if (!rows.empty() && rows.front().ran)
    std::printf("\ncopy bandwidth %.1f GB/s (measured after each run; the bound's divisor)\n",
                rows.front().bandwidth / 1e9);
  if (a.synthetic_prefill)
    for (const Row& r : rows)
      if (r.ran)
        std::printf(
            "%s: caches filled with pseudo-random K/V in %.1f s (--synthetic-prefill: no "
            "prefill figure)\n",
            r.spec.c_str(), r.fill_seconds);
  for (const Row& r : rows)
    if (r.ran && dev == Device::kCuda)  // the CPU engine has nothing to warm
      std::printf("%s: warm-up %.3f s (%s; in no prefill or decode figure)\n", r.spec.c_str(),
                  r.r.warm_up_seconds,
                  a.no_warm_up ? "off: --no-warm-up" : "first use of the steps' product shapes");
  for (const Row& r : rows) print_phases(r.spec, r.phases);
  return 0;
}

}  // namespace

void add_bench_command(CLI::App& app, int* status) {
  auto* cmd =
      app.add_subcommand("bench", "prefill/decode tokens/s of many sequences per cache method");
  auto a = std::make_shared<BenchArgs>();
  cmd->add_option("--model", a->model_dir, "model folder; default: the shipped model");
  cmd->add_option("--device", a->device, "cpu or cuda")->capture_default_str();
  cmd->add_option("--methods", a->methods,
                  "comma-separated cache specs, e.g. full,skvq:bits_key=4:bits_value=4")
      ->capture_default_str();
  add_int_option(cmd, "--batch", &a->batch, 1, 65536, "sequences at once", "bench");
  add_int_option(cmd, "--context", &a->context, 1, kMaxTokenCount, "prompt tokens per sequence",
                 "bench");
  add_int_option(cmd, "--gen", &a->gen, 0, kMaxTokenCount, "generated tokens per sequence",
                 "bench");
  cmd->add_option("--prompt-ids", a->prompt_ids, "random (seeded ids in [0, vocab))")
      ->capture_default_str();
  add_int_option(cmd, "--prefill-step", &a->prefill_step, 1, kMaxTokenCount,
                 "tokens per prefill chunk and per prefill step", "bench");
  add_uint64_option(cmd, "--seed", &a->seed, "prompt ids seed", "bench");
  add_threads_option(cmd, &a->threads, "bench");
  add_tensor_parallel_option(cmd, &a->tensor_parallel, "bench", &a->tp_simulate);
  cmd->add_option("--kv-dtype", a->kv_dtype, "K/V dtype handed to the caches")
      ->capture_default_str();
  cmd->add_flag("--max-batch-fit", a->max_batch_fit,
                "run each method at the largest batch the memory planner fits (instead of "
                "--batch)");
  cmd->add_flag("--plan-only", a->plan_only, "print the planner's figures only; run nothing");
  cmd->add_flag("--no-check-weights", a->no_check_weights, "skip the NaN/Inf scan at load");
  cmd->add_flag("--json", a->json, "print one JSON object");
  cmd->add_flag("--synthetic-prefill", a->synthetic_prefill,
                "fill each sequence's caches with pseudo-random K/V (Engine::fill_synthetic, no "
                "model forward: no prefill figure) and time gen - 1 greedy decode steps: decode "
                "at batches whose real prefill would take minutes");
  cmd->add_flag("--no-reserve", a->no_reserve,
                "cuda: caches grow on demand instead of reserving each sequence's length (for "
                "comparison)");
  cmd->add_flag("--no-batch-decode", a->no_batch_decode,
                "cuda: one decode-attention launch per sequence and layer (for comparison)");
  cmd->add_flag("--no-batch-writes", a->no_batch_writes,
                "cuda: each cache row write launches on its own (for comparison)");
  cmd->add_flag("--no-warm-up", a->no_warm_up,
                "no Engine::warm_up before the first step: each product shape's first use "
                "falls in the step that first runs it (for comparison)");
  cmd->add_flag("--phases", a->phases,
                "cuda: time each phase of the engine's steps with CUDA events (one host sync per "
                "step) and print ms per step per phase");
  cmd->callback([a, status] { *status = run_bench(*a); });
}

}  // namespace vq::cli
