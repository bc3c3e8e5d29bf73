// See worker_queue.h.
#include "base/worker_queue.h"

namespace fsdp::base {

std::string error_text(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace fsdp::base
