// Option helpers shared by the veloxquant subcommands (see options.h).
#include "options.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "veloxquant/cuda.h"
#include "veloxquant/engine.h"
#include "veloxquant/error.h"
#include "veloxquant/multi_gpu.h"
#include "veloxquant/tensor_parallel.h"

namespace vq::cli {

namespace {

std::string range_text(int64_t lo, int64_t hi, const std::string& note) {
  return "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]" + note;
}

// The digits of text after an optional '+' (from_chars accepts '-' itself but not '+').
// The digits of text after an optional '+' ("+-5" is no number: empty).
std::string_view number_part(const std::string& text) {
  std::string_view s(text);
  if (!s.empty() && s[0] == '+') {
    s.remove_prefix(1);
    if (!s.empty() && (s[0] == '-' || s[0] == '+')) return {};
  }
  return s;
}

}  // namespace

int64_t parse_int_in_range(const std::string& text, int64_t lo, int64_t hi, const std::string& cmd,
                           const std::string& option, const std::string& note) {
  const std::string_view s = number_part(text);
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  const bool whole = !s.empty() && ec == std::errc() && end == s.data() + s.size();
  if (!whole || v < lo || v > hi)
    throw Error("[" + cmd + "] " + option + ": expected " + range_text(lo, hi, note) +
                " but got '" + text + "'");
  return v;
}

uint64_t parse_uint64(const std::string& text, const std::string& cmd, const std::string& option) {
  const std::string_view s = number_part(text);
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 10);
  if (s.empty() || s[0] == '-' || ec != std::errc() || end != s.data() + s.size())
    throw Error("[" + cmd + "] " + option + ": expected an integer in [0, " +
                std::to_string(UINT64_MAX) + "] but got '" + text + "'");
  return v;
}

CLI::Option* add_int_option(CLI::App* app, const std::string& name, int64_t* target, int64_t lo,
                            int64_t hi, const std::string& help, const std::string& cmd,
                            const std::string& note) {
  const std::string opt = name.substr(0, name.find(','));
  auto* o = app->add_option_function<std::string>(
      name, [=](const std::string& s) { *target = parse_int_in_range(s, lo, hi, cmd, opt, note); },
      help + "; " + range_text(lo, hi, note));
  o->type_name("INT");
  o->default_str(std::to_string(*target));
  return o;
}

CLI::Option* add_int_list_option(CLI::App* app, const std::string& name,
                                 std::vector<int64_t>* target, int64_t lo, int64_t hi,
                                 const std::string& help, const std::string& cmd) {
  const std::string opt = name.substr(0, name.find(','));
  auto* o = app->add_option_function<std::vector<std::string>>(
      name,
      [=](const std::vector<std::string>& items) {
        target->clear();
        for (const auto& s : items) target->push_back(parse_int_in_range(s, lo, hi, cmd, opt));
      },
      help + "; integers in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  o->type_name("INT,...");
  o->delimiter(',');
  return o;
}

CLI::Option* add_uint64_option(CLI::App* app, const std::string& name, uint64_t* target,
                               const std::string& help, const std::string& cmd) {
  const std::string opt = name.substr(0, name.find(','));
  auto* o = app->add_option_function<std::string>(
      name, [=](const std::string& s) { *target = parse_uint64(s, cmd, opt); },
      help + "; an integer in [0, " + std::to_string(UINT64_MAX) + "]");
  o->type_name("INT");
  o->default_str(std::to_string(*target));
  return o;
}

int64_t hardware_threads() {
  return std::max(1, omp_get_num_procs());
}

int64_t max_threads() {
  return kThreadsPerCore * hardware_threads();
}

CLI::Option* add_threads_option(CLI::App* app, int64_t* target, const std::string& cmd) {
  const std::string note = " (0 = all cores; at most " + std::to_string(kThreadsPerCore) +
                           "x this machine's " + std::to_string(hardware_threads()) +
                           " hardware threads)";
  return add_int_option(app, "--threads", target, 0, max_threads(), "OpenMP threads", cmd, note);
}

CLI::Option* add_tensor_parallel_option(CLI::App* app, int64_t* target, const std::string& cmd,
                                        bool* simulate) {
  if (simulate)
    app->add_flag("--tp-simulate", *simulate,
                  "cuda: run the --tensor-parallel ranks as simulated ranks on one device (each "
                  "its own weight shard, caches and scratch; rank-order all-reduce): a check of "
                  "the sharding, not a speed-up");
  return add_int_option(app, "--tensor-parallel", target, 1, 4096,
                        "ranks the model's heads and caches are split over (must divide the KV "
                        "heads; cpu: simulated ranks with the reference all-reduce; cuda: one "
                        "device per rank over NCCL, or --tp-simulate)",
                        cmd);
}

void check_tensor_parallel(const ModelConfig& mc, Device dev, int64_t n, const std::string& cmd,
                           bool simulate) {
  try {
    if (dev == Device::kCuda) {
      check_cuda_tensor_parallel(mc, n, cuda::device_count(), cuda::has_nccl(), simulate);
    } else {
      VQ_CHECK(!simulate,
               "--tp-simulate: expected --device cuda (the CPU engine's ranks are "
               "always simulated) but got --device cpu");
      make_shard_plan(mc, n);
    }
  } catch (const Error& e) {
    throw Error("[" + cmd + "] " + e.what());
  }
}

void apply_threads(int64_t threads) {
  VQ_CHECK(threads >= 0 && threads <= max_threads(), "[threads] expected a thread count in [0, " +
                                                         std::to_string(max_threads()) +
                                                         "] but got " + std::to_string(threads));
  if (threads > 0) omp_set_num_threads(static_cast<int>(threads));
}

std::string read_text_file(const std::string& path, const std::string& cmd,
                           const std::string& option) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto st = fs::status(path, ec);
  const std::string head = "[" + cmd + "] " + option + ": expected a readable file but ";
  if (ec || !fs::exists(st)) throw Error(head + "'" + path + "' does not exist");
  if (fs::is_directory(st)) throw Error(head + "'" + path + "' is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(head + "'" + path + "' could not be opened");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error(head + "reading '" + path + "' failed");
  return ss.str();
}

int64_t plannable_device_bytes(bool cuda) {
  if (cuda) return std::max<int64_t>(cuda::device_info().global_bytes - kCudaReserveBytes, 0);
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) *
         static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

Device checked_device(const std::string& name, const std::string& cmd) {
  const Device d = parse_device(name);
  if (d == Device::kCuda && !cuda::is_available()) {
#ifdef VQ_HAVE_CUDA
    throw Error("[" + cmd + "] --device cuda: expected a CUDA device but none was found");
#else
    throw Error("[" + cmd +
                "] --device cuda: expected a build with CUDA but this one has none (configure "
                "with -DVQ_CUDA=ON); use --device cpu");
#endif
  }
  return d;
}

}  // namespace vq::cli
