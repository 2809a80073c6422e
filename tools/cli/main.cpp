// veloxquant command-line tool: subcommands demo, generate, eval (as they land).
#include <CLI/CLI.hpp>
#include <cstdio>

int main(int argc, char** argv) {
  CLI::App app{"veloxquant: compressed KV caches for LLM inference"};
  app.require_subcommand(0, 1);
  CLI11_PARSE(app, argc, argv);
  std::printf("veloxquant 0.1.0\n");
  return 0;
}
