// Subcommands of the veloxquant tool. Each lives in its own cmd_<name>.cpp and registers itself
// on the CLI11 app; the callback it installs runs the command and returns the exit status
// through *status.
#pragma once

#include <CLI/CLI.hpp>

namespace vq::cli {

void add_demo_command(CLI::App& app, int* status);
void add_generate_command(CLI::App& app, int* status);
void add_eval_command(CLI::App& app, int* status);
void add_calibrate_command(CLI::App& app, int* status);
void add_compare_command(CLI::App& app, int* status);
void add_bench_command(CLI::App& app, int* status);

}  // namespace vq::cli
