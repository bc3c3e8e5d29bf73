// fsdp-train-test: fsdp-train with test hooks (apps/fsdp-train/hooks.h) read from the environment.
// Built in the tests tree and never installed; the e2e tests run it where they need a hook:
//   FSDP_TRAIN_TEST_STOP_SAVE_PAUSE_S=S        a stop's checkpoint save (one that commits after this
//                                              process got SIGTERM or SIGINT) pauses S seconds
//                                              (0..600) before its commit (preemption_e2e_test.sh)
//   FSDP_TRAIN_TEST_INF_GRAD=RANK:STEP[,STEP...]  an inf in the gradient of the logits on rank RANK
//                                              during optimizer steps STEP (1 = the first)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "fsdp/stop.h"
#include "hooks.h"

namespace {

double stop_save_pause_s() {
  const char* v = std::getenv("FSDP_TRAIN_TEST_STOP_SAVE_PAUSE_S");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  if (end == v || *end != '\0' || !(s >= 0 && s <= 600)) {
    throw std::invalid_argument(std::string("FSDP_TRAIN_TEST_STOP_SAVE_PAUSE_S=") + v +
                                " must be a number of seconds in [0, 600]");
  }
  return s;
}

class EnvHooks : public train::TrainHooks {
 public:
  void check() const override { stop_save_pause_s(); }

  std::function<void(const std::string& phase)> save_phases(int rank) const override {
    const double pause_s = stop_save_pause_s();
    if (pause_s <= 0) return nullptr;
    return [rank, pause_s](const std::string& phase) {
      if (phase != "commit" || fsdp::StopRequest::signal() == 0) return;
      if (rank == 0) std::fprintf(stderr, "fsdp-train: test hook: pausing %g s before the commit\n", pause_s);
      std::this_thread::sleep_for(std::chrono::duration<double>(pause_s));
    };
  }

  std::set<int64_t> inf_grad_steps(int rank) const override {
    std::set<int64_t> steps;
    const char* env = std::getenv("FSDP_TRAIN_TEST_INF_GRAD");
    if (env == nullptr || *env == '\0') return steps;
    const std::string spec = env;
    const size_t colon = spec.find(':');
    try {
      if (colon == std::string::npos) throw std::invalid_argument("no ':'");
      if (std::stoi(spec.substr(0, colon)) != rank) return steps;
      std::stringstream list(spec.substr(colon + 1));
      for (std::string item; std::getline(list, item, ',');) steps.insert(std::stoll(item));
    } catch (const std::exception&) {
      throw std::invalid_argument("FSDP_TRAIN_TEST_INF_GRAD=" + spec + ": expected RANK:STEP[,STEP...]");
    }
    return steps;
  }
};

}  // namespace

int main(int argc, char** argv) { return train::main_with_hooks(argc, argv, EnvHooks{}); }
