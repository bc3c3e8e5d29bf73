// A failing rank's error, handed to its launcher: torchrun's TORCHELASTIC_ERROR_FILE.
#pragma once

#include <exception>

namespace fsdp {

// For a program's top-level catch on a failing rank: under torchrun (TORCHELASTIC_ERROR_FILE set
// and not empty) writes e.what() to that file in torchrun's JSON error format (that of
// torch.distributed.elastic's ErrorHandler: {"message": {"message", "extraInfo": {"py_callstack",
// "timestamp"}}}, the message standing in for the Python stack), so that torchrun's failure
// summary shows it instead of a bare exit code. The file is created, never replaced: torchrun
// gives each attempt a fresh one, so one that exists holds an error recorded earlier, the root
// cause. Returns whether it wrote the file; never throws (a file that cannot be written is skipped).
bool write_launcher_error(const std::exception& e) noexcept;

}  // namespace fsdp
