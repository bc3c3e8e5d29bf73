// The fsdp-train job: the session, the loop and the reports in order (trainer.h). Only rank 0
// prints (besides errors) and writes metrics.
#include "trainer.h"

#include <utility>

#include "loop.h"
#include "report.h"
#include "session.h"

namespace train {

int run_training(const TrainConfig& config, const Flags& flags, const RunPlan& plan, Dataset data,
                 const TrainHooks& hooks) {
  Session session(config, flags, plan, std::move(data), hooks);
  session.join();
  if (flags.init_only) {
    report_baseline(session);
    return 0;
  }
  session.build();
  session.resume();
  Loop loop(session);
  report_header(session);
  const LoopResult result = loop.run();
  if (result.stop_signal != 0) return 128 + result.stop_signal;
  report_final(session, result);
  return 0;
}

}  // namespace train
