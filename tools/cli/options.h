// Option helpers shared by the veloxquant subcommands: integer options parsed with range checks
// (a value outside its range, or not a plain base-10 integer, is refused naming the option and
// the allowed range instead of being saturated by the parser), the thread-count bound, and
// reading a text file given by an option (a directory or an unreadable path is refused).
// Errors are vq::Error ("[cmd] --opt: expected ... but got ..."): main.cpp prints them and
// exits with status 2.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "veloxquant/engine.h"

namespace vq::cli {

// Largest value an integer option that counts tokens or positions accepts (positions fit 32 bits).
inline constexpr int64_t kMaxTokenCount = 2147483647;

// text as a base-10 integer (optional leading '-' or '+', digits only) in [lo, hi]; anything
// else throws "[cmd] option: expected an integer in [lo, hi]<note> but got 'text'".
int64_t parse_int_in_range(const std::string& text, int64_t lo, int64_t hi, const std::string& cmd,
                           const std::string& option, const std::string& note = "");
// The same for an unsigned 64-bit value in [0, UINT64_MAX] (seeds).
uint64_t parse_uint64(const std::string& text, const std::string& cmd, const std::string& option);

// Registers an integer option whose value is parsed with parse_int_in_range into *target (which
// must outlive the parse). The default shown in --help is *target's value at registration.
CLI::Option* add_int_option(CLI::App* app, const std::string& name, int64_t* target, int64_t lo,
                            int64_t hi, const std::string& help, const std::string& cmd,
                            const std::string& note = "");
// Same for a comma-separated list of integers, each in [lo, hi].
CLI::Option* add_int_list_option(CLI::App* app, const std::string& name,
                                 std::vector<int64_t>* target, int64_t lo, int64_t hi,
                                 const std::string& help, const std::string& cmd);
// An unsigned 64-bit option (seeds).
CLI::Option* add_uint64_option(CLI::App* app, const std::string& name, uint64_t* target,
                               const std::string& help, const std::string& cmd);

// Thread counts: 0 = every hardware thread; at most kThreadsPerCore x the hardware threads
// (OpenMP runtimes crash on absurd team sizes, e.g. 100000). hardware_threads() >= 1.
inline constexpr int64_t kThreadsPerCore = 4;
int64_t hardware_threads();
int64_t max_threads();
// Registers --threads into *target with that range.
CLI::Option* add_threads_option(CLI::App* app, int64_t* target, const std::string& cmd);
// Applies a --threads value (0 leaves OpenMP's default: every core).
void apply_threads(int64_t threads);

// --tensor-parallel N (1 .. 4096): ranks of tensor parallelism (veloxquant/tensor_parallel.h);
// with `simulate`, also the flag --tp-simulate (EngineOptions::tp_simulate: N simulated ranks on
// one CUDA device, a test/diagnostic of the sharding).
CLI::Option* add_tensor_parallel_option(CLI::App* app, int64_t* target, const std::string& cmd,
                                        bool* simulate = nullptr);
// N for this model and device, checked before any engine is made: N divides the KV heads
// (naming the allowed N); on cuda N <= the visible devices and, for N > 1, a build with NCCL,
// unless `simulate` (check_cuda_tensor_parallel); --tp-simulate on cpu is refused. vq::Error
// prefixed "[cmd] ".
void check_tensor_parallel(const ModelConfig& mc, Device dev, int64_t n, const std::string& cmd,
                           bool simulate = false);

// Memory the planner (veloxquant/memory_plan.h) may give weights, workspace and caches on a
// device: cuda, the card's global memory less kCudaReserveBytes (the CUDA context, cuBLAS
// workspaces and the allocator's slack, which the planner does not model); cpu, the machine's
// physical memory.
inline constexpr int64_t kCudaReserveBytes = int64_t{1} << 30;
int64_t plannable_device_bytes(bool cuda);

// The whole content of the file at path (pipes such as /dev/stdin included); a directory, a
// missing or an unreadable file is refused: "[cmd] option: expected a readable file but '<path>' is
// a directory".
std::string read_text_file(const std::string& path, const std::string& cmd,
                           const std::string& option);

// --device NAME of command cmd: parse_device's refusals, and "[cmd] --device cuda: expected a
// CUDA device ..." (or "... a build with CUDA ...") where this build or machine has none, so the
// command is refused (exit status 2) before anything loads.
Device checked_device(const std::string& name, const std::string& cmd);

}  // namespace vq::cli
