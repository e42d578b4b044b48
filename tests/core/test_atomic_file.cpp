// k3/harness/atomic_file.hpp: unique temporary files in the destination directory, checked writes
// (short writes continued, ENOSPC reported with the path), fsync + rename, cleanup on errors and
// on signals; path checks for inputs and outputs; safetensors inputs that are FIFOs.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <string>
#include <vector>

#include "core/st_test_util.hpp"
#include "k3/harness/atomic_file.hpp"
#include "k3/checkpoint.hpp"
#include "k3/harness/checkpoint_synth.hpp"
#include "k3/safetensors.hpp"

namespace k3 {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::string> dir_entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Restores write(2) at the end of a test that injects failures.
struct WriteHookGuard {
  explicit WriteHookGuard(detail::WriteFn fn) { detail::set_atomic_file_write_for_testing(fn); }
  ~WriteHookGuard() { detail::set_atomic_file_write_for_testing(nullptr); }
};

TEST(AtomicFile, WritesTheWholeFileWithMode0644AndNoLeftovers) {
  TempDir dir("af_basic");
  const std::string path = dir.file("out.json");
  ASSERT_TRUE(write_file_atomic(path, std::string_view("{\"a\": 1}\n")).is_ok());
  EXPECT_EQ(slurp(path), "{\"a\": 1}\n");
  const mode_t mask = ::umask(0);
  ::umask(mask);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u & ~mask);
  // Replacing an existing file: the new content, still one entry in the folder.
  ASSERT_TRUE(write_file_atomic(path, std::string_view("second")).is_ok());
  EXPECT_EQ(slurp(path), "second");
  EXPECT_EQ(dir_entries(dir.str()), std::vector<std::string>{"out.json"});
}

TEST(AtomicFile, TemporaryFileIsUniqueAndInTheDestinationDirectory) {
  TempDir dir("af_unique");
  const std::string path = dir.file("x.safetensors");
  auto a = AtomicFile::create(path);
  auto b = AtomicFile::create(path);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_NE(a->temp_path(), b->temp_path());
  EXPECT_EQ(fs::path(a->temp_path()).parent_path(), fs::path(path).parent_path());
  EXPECT_NE(a->temp_path(), path + ".tmp");
  EXPECT_HAS(a->temp_path(), ".x.safetensors.k3tmp-");
  ASSERT_TRUE(a->write(std::string_view("from a")).is_ok());
  ASSERT_TRUE(b->write(std::string_view("from b, longer")).is_ok());
  ASSERT_TRUE(b->commit().is_ok());
  ASSERT_TRUE(a->commit().is_ok());
  EXPECT_EQ(slurp(path), "from a");  // the last rename wins, whole
  EXPECT_EQ(dir_entries(dir.str()), std::vector<std::string>{"x.safetensors"});
}

TEST(AtomicFile, PlantedTmpSymlinkIsNeverFollowed) {
  TempDir dir("af_symlink");
  const std::string path = dir.file("out.safetensors"), victim = dir.file("victim");
  test::write_text(victim, "do not touch");
  fs::create_symlink(victim, path + ".tmp");
  st::Writer w;
  ASSERT_TRUE(w.add("t", st::DType::kU8, {3}, std::vector<uint8_t>{1, 2, 3}).is_ok());
  ASSERT_TRUE(w.write(path).is_ok());
  EXPECT_EQ(slurp(victim), "do not touch");
  EXPECT_TRUE(fs::is_symlink(path + ".tmp"));
  EXPECT_FALSE(fs::is_symlink(path));
  EXPECT_TRUE(st::File::open(path).is_ok());
}

TEST(AtomicFile, DiscardedWhenDestroyedUncommitted) {
  TempDir dir("af_discard");
  std::string temp;
  {
    auto f = AtomicFile::create(dir.file("x"));
    ASSERT_TRUE(f.is_ok());
    temp = f->temp_path();
    ASSERT_TRUE(f->write(std::string_view("partial")).is_ok());
    EXPECT_TRUE(fs::exists(temp));
  }
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_TRUE(dir_entries(dir.str()).empty());
}

TEST(AtomicFile, OutputPathChecksNameTheArgumentAndWhatThePathIs) {
  TempDir dir("af_paths");
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0644), 0);
  fs::create_directories(dir.file("d"));
  auto msg = [](const std::string& p) { return check_output_path("--output", p).message(); };
  EXPECT_HAS(msg("/dev/null"), "--output /dev/null exists and is a character device, not a regular file");
  EXPECT_HAS(msg(dir.file("fifo")), "exists and is a FIFO (named pipe), not a regular file");
  EXPECT_HAS(msg(dir.file("d")), "exists and is a directory, not a regular file");
  EXPECT_HAS(msg(""), "--output: the path is empty");
  EXPECT_HAS(msg(dir.file("d") + "/"), "ends in '/', which names a directory");
  EXPECT_HAS(msg(dir.file("d/..")), "names a directory");
  EXPECT_HAS(msg(dir.file("no/such/x")), "cannot create a file there: directory " + dir.file("no/such") + ": No such file or directory");
  test::write_text(dir.file("plain"), "x");
  EXPECT_HAS(msg(dir.file("plain/x")), "Not a directory");
  EXPECT_TRUE(check_output_path("--output", dir.file("new.json")).is_ok());
  EXPECT_TRUE(check_output_path("--output", dir.file("plain")).is_ok());
  // The same checks guard the writers.
  EXPECT_HAS(write_file_atomic("/dev/null", std::string_view("x"), "--output").message(), "character device");
  st::Writer w;
  EXPECT_HAS(w.write(dir.file("fifo"), "--output").message(), "--output " + dir.file("fifo") + " exists and is a FIFO");
  EXPECT_HAS(w.write("").message(), "the path is empty");
  EXPECT_EQ(w.write(dir.file("d") + "/").message().find("Success"), std::string::npos);
  EXPECT_EQ(dir_entries(dir.str()), (std::vector<std::string>{"d", "fifo", "plain"}));
}

TEST(AtomicFile, OutputThatIsAnInputIsRefused) {
  TempDir dir("af_same");
  const std::string in = dir.file("in");
  test::write_text(in, "input");
  fs::create_symlink(in, dir.file("sym"));
  fs::create_hard_link(in, dir.file("hard"));
  for (const std::string& out : {in, dir.file("sym"), dir.file("hard"), dir.str() + "/./in"}) {
    const Status s = check_output_not_input("--output", out, "--input", in);
    EXPECT_FALSE(s.is_ok()) << out;
    EXPECT_HAS(s.message(), "--output " + out + " is the same file as --input " + in);
  }
  EXPECT_TRUE(check_output_not_input("--output", dir.file("other"), "--input", in).is_ok());
  test::write_text(dir.file("other"), "x");
  EXPECT_TRUE(check_output_not_input("--output", dir.file("other"), "--input", in).is_ok());
}

// ---- injected write failures -------------------------------------------------------------------

long enospc_after_10(int fd, const void* buf, size_t n) {
  const off_t at = ::lseek(fd, 0, SEEK_CUR);
  if (at >= 10) {
    errno = ENOSPC;
    return -1;
  }
  return static_cast<long>(::write(fd, buf, std::min<size_t>(n, static_cast<size_t>(10 - at))));
}

long three_bytes_at_a_time(int fd, const void* buf, size_t n) {
  static int calls = 0;
  if (++calls % 4 == 0) {  // an interrupted call now and then
    errno = EINTR;
    return -1;
  }
  return static_cast<long>(::write(fd, buf, std::min<size_t>(n, 3)));
}

TEST(AtomicFile, EnospcIsAnErrorNamingThePathAndRemovesTheTemporaryFile) {
  TempDir dir("af_enospc");
  const std::string path = dir.file("r.json");
  test::write_text(path, "old content");
  WriteHookGuard hook(enospc_after_10);
  const Status s = write_file_atomic(path, std::string_view("0123456789abcdefghij"), "--output");
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_HAS(s.message(), "--output " + path + ": write failed after 10 bytes");
  EXPECT_HAS(s.message(), "No space left on device");
  EXPECT_EQ(slurp(path), "old content");
  EXPECT_EQ(dir_entries(dir.str()), std::vector<std::string>{"r.json"});
  // The safetensors writer reports the same way and leaves nothing behind.
  st::Writer w;
  ASSERT_TRUE(w.add("t", st::DType::kU8, {64}, std::vector<uint8_t>(64, 7)).is_ok());
  const Status ws = w.write(dir.file("x.safetensors"), "--output");
  EXPECT_HAS(ws.message(), "--output " + dir.file("x.safetensors") + ": write failed");
  EXPECT_HAS(ws.message(), "No space left on device");
  EXPECT_EQ(dir_entries(dir.str()), std::vector<std::string>{"r.json"});
  // A failed AtomicFile keeps failing with the same error.
  auto f = AtomicFile::create(dir.file("y"));
  ASSERT_TRUE(f.is_ok());
  const Status first = f->write(std::string_view("0123456789ABCDEF"));
  EXPECT_FALSE(first.is_ok());
  EXPECT_EQ(f->commit().message(), first.message());
  EXPECT_FALSE(fs::exists(dir.file("y")));
}

TEST(AtomicFile, ShortAndInterruptedWritesAreContinued) {
  TempDir dir("af_short");
  const std::string path = dir.file("x");
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>('a' + i % 26);
  {
    WriteHookGuard hook(three_bytes_at_a_time);
    ASSERT_TRUE(write_file_atomic(path, std::string_view(text)).is_ok());
  }
  EXPECT_EQ(slurp(path), text);
}

// ---- signals -----------------------------------------------------------------------------------

TEST(AtomicFileDeathTest, SigtermRemovesInFlightTemporaryFiles) {
  // "fast" style (fork): the child writes into this test's folder, which the parent then checks.
  TempDir dir("af_signal");
  const std::string path = dir.file("big.safetensors");
  EXPECT_EXIT(
      {
        install_temp_file_cleanup_handlers();
        auto a = AtomicFile::create(path);
        auto b = AtomicFile::create(dir.file("other.json"));
        if (!a.is_ok() || !b.is_ok() || !a->write(std::string_view("partial data")).is_ok()) std::_Exit(3);
        ::raise(SIGTERM);
        std::_Exit(4);  // not reached: the handler re-raises with the default action
      },
      ::testing::KilledBySignal(SIGTERM), "");
  EXPECT_TRUE(dir_entries(dir.str()).empty());
}

// ---- inputs that are not regular files ----------------------------------------------------------

TEST(AtomicFile, InputChecksNameTheArgumentAndWhatThePathIs) {
  TempDir dir("af_inputs");
  ASSERT_EQ(::mkfifo(dir.file("p").c_str(), 0644), 0);
  EXPECT_HAS(check_input_file("--input", dir.file("p")).message(),
             "--input " + dir.file("p") + " is a FIFO (named pipe), not a regular file");
  EXPECT_HAS(check_input_file("--input", dir.str()).message(), "is a directory, not a regular file");
  EXPECT_HAS(check_input_file("--input", "/dev/null").message(), "is a character device, not a regular file");
  EXPECT_HAS(check_input_file("--input", dir.file("missing")).message(), "cannot open: No such file or directory");
  EXPECT_HAS(check_input_file("--input", "").message(), "--input: the path is empty");
}

// Runs `fn` with a time limit; if it blocks on the FIFO, a non-blocking writer opened on the
// FIFO releases it so that the test fails instead of hanging.
template <typename Fn>
bool returns_promptly(const std::string& fifo, Fn fn) {
  auto fut = std::async(std::launch::async, fn);
  if (fut.wait_for(std::chrono::seconds(10)) == std::future_status::ready) return true;
  const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
  if (fd >= 0) ::close(fd);
  fut.wait();
  return false;
}

TEST(AtomicFile, FifoSafetensorsAndCheckpointFilesAreRefusedWithoutBlocking) {
  TempDir dir("af_fifo_st");
  const std::string fifo = dir.file("in.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  std::string msg;
  EXPECT_TRUE(returns_promptly(fifo, [&] { msg = st::File::open(fifo).status().message(); }));
  EXPECT_HAS(msg, fifo + ": is a FIFO (named pipe), not a regular file");
  EXPECT_TRUE(returns_promptly(fifo, [&] { msg = st::Checkpoint::open(fifo).status().message(); }));
  EXPECT_HAS(msg, fifo + ": is a FIFO (named pipe), neither a safetensors file nor a checkpoint directory");
  // In a folder without an index: the FIFO shard is named, not skipped or waited on.
  EXPECT_TRUE(returns_promptly(fifo, [&] { msg = st::Checkpoint::open(dir.str()).status().message(); }));
  EXPECT_HAS(msg, fifo + " is a FIFO (named pipe), not a regular safetensors file");

  // A checkpoint whose config.json, index or shard is a FIFO.
  TempDir ck("af_fifo_ckpt");
  SynthOptions o;
  o.output_dir = ck.str();
  o.hidden_size = 96;
  o.expert_hidden = 64;
  o.intermediate = 32;
  o.num_experts = 8;
  o.top_k = 3;
  o.shard_size = 10000;
  ASSERT_TRUE(write_synthetic_checkpoint(o).is_ok());
  const std::string config = ck.file("config.json");
  fs::remove(config);
  ASSERT_EQ(::mkfifo(config.c_str(), 0644), 0);
  EXPECT_TRUE(returns_promptly(config, [&] { msg = load_model_config(ck.str()).status().message(); }));
  EXPECT_HAS(msg, config + ": is a FIFO (named pipe), not a regular file");
  std::string shard;
  for (const auto& name : dir_entries(ck.str())) {
    if (name.rfind("model-00001-of-", 0) == 0) shard = ck.file(name);
  }
  ASSERT_FALSE(shard.empty()) << "synth wrote no shards";
  fs::remove(shard);
  ASSERT_EQ(::mkfifo(shard.c_str(), 0644), 0);
  EXPECT_TRUE(returns_promptly(shard, [&] { msg = st::Checkpoint::open(ck.str()).status().message(); }));
  EXPECT_HAS(msg, "shard " + shard);
  EXPECT_HAS(msg, "is a FIFO (named pipe), not a regular file");
  const std::string index = ck.file("model.safetensors.index.json");
  fs::remove(index);
  ASSERT_EQ(::mkfifo(index.c_str(), 0644), 0);
  EXPECT_TRUE(returns_promptly(index, [&] { msg = st::Checkpoint::open(ck.str()).status().message(); }));
  EXPECT_HAS(msg, index + " is a FIFO (named pipe), not a regular file");
}

// ---- checkpoint synth overwrite ----------------------------------------------------------------

TEST(AtomicFile, SynthOverwriteKeepsFilesItDoesNotWrite) {
  TempDir dir("af_synth");
  SynthOptions o;
  o.output_dir = dir.str();
  o.hidden_size = 96;
  o.expert_hidden = 64;
  o.intermediate = 32;
  o.num_experts = 8;
  o.top_k = 3;
  ASSERT_TRUE(write_synthetic_checkpoint(o).is_ok());
  test::write_text(dir.file("notes.safetensors"), "not even safetensors, but mine");
  o.seed = 9;
  auto r = write_synthetic_checkpoint(o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_HAS(r.status().message(), "already holds a checkpoint");
  o.overwrite = true;
  r = write_synthetic_checkpoint(o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->kept, std::vector<std::string>{"notes.safetensors"});
  EXPECT_EQ(slurp(dir.file("notes.safetensors")), "not even safetensors, but mine");
  EXPECT_HAS(slurp(dir.file("config.json")), "\"seed\": 9");
  EXPECT_EQ(dir_entries(dir.str()), (std::vector<std::string>{"config.json", "model.safetensors", "notes.safetensors"}));
}

}  // namespace
}  // namespace k3
