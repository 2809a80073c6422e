// veloxquant command-line tool: `demo` (every cache over a synthetic sequence), `compare` (every
// cache on one long prompt: answers and memory side by side), `generate`
// (text generation with a chosen cache, one prompt or many on an engine), `eval` (memory against
// quality) and `bench` (many sequences per method: tokens/s against the decode bound). Library
// errors (vq::Error) are printed as one line and give exit status 2.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"veloxquant: compressed KV caches for LLM inference"};
  app.require_subcommand(1);
  int status = 0;
  vq::cli::add_demo_command(app, &status);
  vq::cli::add_generate_command(app, &status);
  vq::cli::add_eval_command(app, &status);
  vq::cli::add_calibrate_command(app, &status);
  vq::cli::add_compare_command(app, &status);
  vq::cli::add_bench_command(app, &status);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "veloxquant: error: %s\n", e.what());
    return 2;
  }
  return status;
}
