// A lock file, held the way a checkpoint save holds its NAME.tmp (Note [Orphaned saves],
// src/checkpoint/save.cpp). Defined in file_io.cpp.
#pragma once

#include <memory>
#include <string>

namespace fsdp::io {

// An exclusive flock(2) on `path`, taken at once and held until the result is released; null when
// it cannot be taken: held by another process, or by this one (a registry of this process's locks,
// checked before the file is opened: where flock is per process, as emulated over NFS, opening and
// closing a file whose lock this process holds would drop that lock), or a file system without
// locks. `create` makes the file first, and registers it even where it cannot be locked.
std::shared_ptr<void> try_lock_file(const std::string& path, bool create);

}  // namespace fsdp::io
