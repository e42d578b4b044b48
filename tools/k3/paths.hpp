// Path checks shared by the sub-commands that read inputs and write outputs (see
// k3/harness/atomic_file.hpp for the write rules).
#pragma once

#include <string>
#include <vector>

#include "k3/status.hpp"

namespace k3::tool {

// The files a checkpoint argument makes k3 read: the file itself or, for a directory, every shard
// (from the index or the folder), the index and config.json. Paths that do not exist are listed
// too (they are harmless in the checks below).
std::vector<std::string> checkpoint_read_files(const std::string& checkpoint);

// A checkpoint argument must be a directory or a regular file (checked with stat: a FIFO is
// refused, never opened).
Status check_checkpoint_arg(const std::string& label, const std::string& checkpoint);

// Refuses an output (`out_label` `out`) that is the same file as any of the checkpoint's files.
Status check_output_not_checkpoint(const std::string& out_label, const std::string& out, const std::string& checkpoint);

}  // namespace k3::tool
