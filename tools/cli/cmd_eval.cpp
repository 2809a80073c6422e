// `veloxquant eval`: placeholder until its module lands.
#include <cstdio>

#include "commands.h"

namespace vq::cli {

void add_eval_command(CLI::App& app, int* status) {
  auto* cmd = app.add_subcommand("eval", "(not available in this build yet)");
  cmd->callback([status] {
    std::fprintf(stderr, "veloxquant eval: not available in this build yet\n");
    *status = 2;
  });
}

}  // namespace vq::cli
