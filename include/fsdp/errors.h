// Exception types thrown by fsdp. Library code never exits or aborts on a user error: it throws one
// of these, with a message that names the thing that is wrong and, where there is one, the fix.
#pragma once

#include <stdexcept>
#include <string>

namespace fsdp {

// Base of every fsdp exception.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A bad or incomplete launch environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).
class EnvError : public Error {
 public:
  using Error::Error;
};

// A failed rendezvous or collective: a dead or stopped peer, a timeout, a transport error.
class DistError : public Error {
 public:
  using Error::Error;
};

// A collective that did not finish within its timeout.
class TimeoutError : public DistError {
 public:
  using DistError::DistError;
};

// A checkpoint that cannot be written, or a file that is missing, malformed or of another model.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// Invalid user options or configuration.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A sharded module used in a way fsdp cannot serve: its parameters read while they are not
// gathered (a forward run outside fsdp::call, or by a stock container that calls its children
// itself), or its gradients produced by a forward fsdp never saw. Thrown on every rank (each runs
// the same code), before any operator reads the missing parameter.
class UsageError : public Error {
 public:
  using Error::Error;
};

// The disk tier could not create, reserve or write its files (an unwritable offload.dir, a full
// disk, a file-size limit). Raised before training when the files are created up front, or at
// the step that first needs them, before any state of that step changes.
class OffloadError : public Error {
 public:
  using Error::Error;
};

// Training produced non-finite losses or gradients for more steps in a row than allowed (see
// GradScalerOptions::max_consecutive_skips): stopped rather than saving a poisoned model.
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

}  // namespace fsdp
