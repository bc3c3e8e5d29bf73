// io::DirectWriter, the checkpoint's file writer (Note [Direct writes of a checkpoint]): disjoint
// spans from several writers at once land byte for byte, runs longer than its buffer included;
// the whole pages of a run go to the disk directly and only its partial end pages through the page
// cache; a file system that refuses O_DIRECT gets everything buffered; a write that fails on the
// writer's thread is reported by the caller's next write() or by finish(), naming the file.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "base/direct_writer.h"
#include "base/file_io.h"
#include "fsdp/errors.h"
#include "support/ranks.h"

namespace fsdp::io {
namespace {

constexpr int64_t kPage = 4096;

std::string prepared_file(const std::string& stem, int64_t size) {
  const std::string dir = testing::temp_path(stem);
  make_dirs(dir);
  const std::string path = join(dir, "data.bin");
  File f = File::open_write(path, true);
  f.truncate(static_cast<uint64_t>(size));
  f.close();
  return path;
}

bool takes_direct_io(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
  if (fd >= 0) ::close(fd);
  return fd >= 0;
}

std::vector<char> contents(const std::string& path) {
  File f = File::open_read(path);
  std::vector<char> out(f.size());
  if (!out.empty()) f.pread_all(out.data(), out.size(), 0);
  return out;
}

TEST(DirectWriter, InterleavedWritersLandByteForByte) {
  // Three writers own interleaved stretches of one file (as ranks own the shards of a checkpoint's
  // tensors); each writes its stretches in pieces, some continuing a run, with a 3-page buffer so
  // that long runs go out several times before they end.
  const int64_t size = 300 * kPage + 123;
  const std::string path = prepared_file("direct-writer", size);
  std::vector<char> expected(static_cast<size_t>(size), 0);
  std::mt19937 gen(7);
  for (auto& c : expected) c = static_cast<char>(gen());
  std::vector<int64_t> cuts{0, 1000, 5000, 5001, 40000, 40960, 90000, 300000, 700000, size};
  std::vector<std::unique_ptr<DirectWriter>> writers;
  for (int w = 0; w < 3; ++w) writers.push_back(std::make_unique<DirectWriter>(path, 3 * kPage));
  for (size_t s = 0; s + 1 < cuts.size(); ++s) {
    DirectWriter& w = *writers[s % 3];
    for (int64_t at = cuts[s]; at < cuts[s + 1];) {  // pieces of 1 to 20,000 bytes
      const int64_t n = std::min<int64_t>(cuts[s + 1] - at, 1 + static_cast<int64_t>(gen() % 20000));
      w.write(expected.data() + at, n, at);
      at += n;
    }
  }
  for (auto& w : writers) w->finish();
  EXPECT_TRUE(contents(path) == expected);
  remove_tree(parent_dir(path));
}

TEST(DirectWriter, WholePagesGoDirectlyAndOnlyTheEndsThroughThePageCache) {
  const int64_t size = 64 * kPage;
  const std::string path = prepared_file("direct-writer-pages", size);
  if (!takes_direct_io(path)) GTEST_SKIP() << "the file system under " << path << " refuses O_DIRECT";
  std::vector<char> data(static_cast<size_t>(size), 'x');
  DirectWriter w(path, 8 * kPage);
  const int64_t begin = 100, end = size - 200;  // one run with a partial first and last page
  for (int64_t at = begin; at < end; at += 7 * kPage + 5) {
    w.write(data.data() + at, std::min<int64_t>(7 * kPage + 5, end - at), at);
  }
  w.finish();
  const DirectWriteCounters& c = w.counters();
  EXPECT_EQ(c.buffered_bytes, (kPage - begin) + (kPage - 200));
  EXPECT_EQ(c.direct_bytes, end - begin - c.buffered_bytes);
  EXPECT_EQ(c.buffered_writes, 2);
  EXPECT_EQ(c.direct_writes, (62 + 7) / 8);  // the buffer's 8 pages at a time: 62 whole pages
  std::vector<char> expected(static_cast<size_t>(size), 0);
  std::fill(expected.begin() + begin, expected.begin() + end, 'x');
  EXPECT_TRUE(contents(path) == expected);
  remove_tree(parent_dir(path));
}

TEST(DirectWriter, AFailedWriteOnItsThreadIsReportedNamingTheFile) {
  // /dev/full takes the open and fails every write with ENOSPC. The first buffer's write fails on
  // the thread while the caller fills the second; the caller hears of it before finish() returns.
  if (!exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  std::vector<char> data(static_cast<size_t>(16 * kPage), 'y');
  DirectWriter w("/dev/full", 2 * kPage);
  try {
    for (int64_t at = 0; at < 16 * kPage; at += kPage) w.write(data.data() + at, kPage, at);
    w.finish();
    FAIL() << "a write to /dev/full was not reported";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("write failed on /dev/full"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fsdp::io
