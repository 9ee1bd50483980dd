// hvd_syncbn's XLA custom call on the host: sum a 1-D float64 buffer over an MPI
// communicator, with a deadline. A typed XLA FFI handler (xla/ffi/api/ffi.h, header only).
//
// Python (hvd_syncbn/tensorflow/xla.py) loads this library with ctypes, hands
// hvd_syncbn_xla_register() the FFI API table of the TensorFlow in the process, and emits
// the call as a StableHLO custom_call (api_version = 4, typed FFI) with the attributes
//   comm: i64      the MPI_Comm handle (mpi4py's MPI._handleof), owned by Python;
//   timeout: f64   seconds to wait for the other ranks;
//   name: string   the collective's name, for the error message.
// Operands: the buffer, then any number of ordering operands (ignored: they only make the
// calls of one computation run in the order they were traced). Result: the sum.
// It only sums: identity headers and checks are the caller's.

// The C API only: no C++ bindings (Open MPI and MPICH would pull in libmpi_cxx).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <thread>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Collectives that timed out: their requests are still pending (MPI cannot cancel a
// collective), so the Python side aborts MPI at exit rather than hang in MPI_Finalize.
std::atomic<int64_t> stuck{0};

// A pointer in Open MPI, an int in MPICH: a C cast converts to either.
MPI_Comm CommFromHandle(int64_t handle) { return (MPI_Comm)(intptr_t)handle; }

std::string MpiError(std::string_view name, std::string_view what, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(name) + ": " + std::string(what) + " failed: " + std::string(text, length);
}

ffi::Error Allreduce(ffi::Buffer<ffi::F64> in, ffi::RemainingArgs /*order*/,
                     ffi::ResultBuffer<ffi::F64> out, int64_t comm_handle, double timeout,
                     std::string_view name) {
  const MPI_Comm comm = CommFromHandle(comm_handle);
  const size_t count = in.element_count();
  if (out->element_count() != count) {
    return ffi::Error::InvalidArgument(std::string(name) + ": the result has " +
                                       std::to_string(out->element_count()) +
                                       " values, expected " + std::to_string(count));
  }
  if (count > static_cast<size_t>(INT32_MAX)) {
    return ffi::Error::InvalidArgument(std::string(name) + ": expected at most 2^31-1 values, got " +
                                       std::to_string(count));
  }
  if (count == 0) return ffi::Error::Success();

  MPI_Request request;
  int rc = MPI_Iallreduce(in.typed_data(), out->typed_data(), static_cast<int>(count), MPI_DOUBLE,
                          MPI_SUM, comm, &request);
  if (rc != MPI_SUCCESS) return ffi::Error::Internal(MpiError(name, "MPI_Iallreduce", rc));

  // MPI progresses only inside its calls: spin on MPI_Test for a while, then poll every
  // 50 us (as the host path, hvd_syncbn.comm) until the deadline.
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(timeout));
  for (int polls = 0;; ++polls) {
    int done = 0;
    rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return ffi::Error::Internal(MpiError(name, "MPI_Test", rc));
    if (done) return ffi::Error::Success();
    if (clock::now() >= deadline) break;
    if (polls >= 2000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  stuck.fetch_add(1);
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%g", timeout);
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                    std::string(name) + ": the other ranks did not join within " + seconds +
                        " s (hvd_syncbn XLA allreduce of " + std::to_string(count) +
                        " float64 values; HVD_SYNCBN_TIMEOUT sets the wait)");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hvd_syncbn_xla_allreduce, Allreduce,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F64>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F64>>()
                                  .Attr<int64_t>("comm")
                                  .Attr<double>("timeout")
                                  .Attr<std::string_view>("name"));

extern "C" {

// Registers the handler as `target` for the "Host" platform with the FFI API table
// `api` (the TensorFlow's in this process). Returns 0, or -1 with the message in `error`.
int hvd_syncbn_xla_register(const XLA_FFI_Api* api, const char* target, char* error,
                            size_t error_size) {
  XLA_FFI_Error* status = ffi::Ffi::RegisterStaticHandler(api, target, "Host",
                                                          hvd_syncbn_xla_allreduce);
  if (status == nullptr) return 0;
  XLA_FFI_Error_GetMessage_Args message;
  message.struct_size = XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE;
  message.extension_start = nullptr;
  message.error = status;
  api->XLA_FFI_Error_GetMessage(&message);
  std::snprintf(error, error_size, "%s", message.message);
  XLA_FFI_Error_Destroy_Args destroy;
  destroy.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  destroy.extension_start = nullptr;
  destroy.error = status;
  api->XLA_FFI_Error_Destroy(&destroy);
  return -1;
}

// How many collectives timed out in this process (their MPI requests never completed).
int64_t hvd_syncbn_xla_stuck() { return stuck.load(); }

}  // extern "C"
