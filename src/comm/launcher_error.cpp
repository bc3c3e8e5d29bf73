// A failing rank's error, written where its launcher looks for it: torchrun's
// TORCHELASTIC_ERROR_FILE, which its agent reads when the rank exits with a non-zero code
// (torch.distributed.elastic.multiprocessing.errors.ProcessFailure) and shows in its summary.
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <string>

#include <nlohmann/json.hpp>

#include "fsdp/launcher_error.h"

namespace fsdp {

bool write_launcher_error(const std::exception& e) noexcept {
  try {
    const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
    if (path == nullptr || *path == '\0') return false;  // torchrun sets it empty when it keeps no logs
    const std::string message = e.what();
    // The agent takes the earliest timestamp (a string of seconds) as the root cause, and its summary
    // prints py_callstack, else the message.
    const nlohmann::json error = {
        {"message",
         {{"message", message},
          {"extraInfo", {{"py_callstack", message}, {"timestamp", std::to_string(std::time(nullptr))}}}}}};
    // Invalid UTF-8 in a message (a file name) is replaced rather than failing the dump.
    const std::string text = error.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    const int fd = ::open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return false;  // exists (an earlier error stays) or cannot be created
    const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
    return ::close(fd) == 0 && written;
  } catch (...) {  // bad_alloc: the caller is already reporting an error
    return false;
  }
}

}  // namespace fsdp
