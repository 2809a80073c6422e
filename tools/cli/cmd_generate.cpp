// `veloxquant generate`: placeholder until its module lands.
#include <cstdio>

#include "commands.h"

namespace vq::cli {

void add_generate_command(CLI::App& app, int* status) {
  auto* cmd = app.add_subcommand("generate", "(not available in this build yet)");
  cmd->callback([status] {
    std::fprintf(stderr, "veloxquant generate: not available in this build yet\n");
    *status = 2;
  });
}

}  // namespace vq::cli
