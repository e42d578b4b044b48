// libk3.so is assembled from the object files of k3_core, k3_cpu, k3_cuda and k3_backends; a
// shared library target needs at least one source of its own, and this is it.
namespace k3::detail {
int shared_library_marker() { return 1; }
}  // namespace k3::detail
