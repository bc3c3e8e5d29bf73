// Entry point of fsdp-run, the local multi-process launcher (see launcher.h for what it
// does and which exit status means what). Kept thin so the logic stays testable as a library.
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "launcher.h"

int main(int argc, char** argv) {
  try {
    const std::vector<std::string> args(argv + 1, argv + argc);
    const fsdp::LaunchOptions options = fsdp::parse_launch_args(args);
    if (options.show_help) {
      std::cout << fsdp::launch_usage();
      return 0;
    }
    return fsdp::run_launcher(options);
  } catch (const std::exception& e) {
    // Usage errors and launcher failures share one status; the message tells them apart.
    std::cerr << "fsdp-run: error: " << e.what() << "\n";
    return fsdp::kExitLauncherError;
  }
}
