// `veloxquant demo`: placeholder until the caches land.
#include <cstdio>

#include "commands.h"

namespace vq::cli {

void add_demo_command(CLI::App& app, int* status) {
  auto* cmd = app.add_subcommand("demo", "every cache method over one synthetic sequence");
  cmd->callback([status] { *status = 0; });
}

}  // namespace vq::cli
