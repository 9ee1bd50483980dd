// hvd_syncbn's allreduce on the host: sum a 1-D float64 buffer over an MPI communicator,
// with a deadline. One loop (SumOverMpi), two ways in:
// - inside XLA, a typed XLA FFI handler (xla/ffi/api/ffi.h, header only), emitted as a
//   StableHLO custom_call (api_version = 4, typed FFI) with the attributes
//     comm: i64      the MPI_Comm handle (mpi4py's MPI._handleof), owned by Python;
//     timeout: f64   seconds to wait for the other ranks;
//     name: string   the collective's name, for the error message;
//     header: i64[]  identity values summed in front of the buffer (may be empty);
//   registered by hvd_syncbn_xla_register(), which Python (hvd_syncbn/tensorflow/xla.py)
//   hands the FFI API table of the TensorFlow in the process;
// - outside XLA, the TensorFlow op HvdSyncbnAllreduce (CPU kernel, same attributes), loaded
//   by tf.load_op_library: a plain kernel, where the XLA call compiled on its own cost about
//   45 us more per collective (a training step at 2 ranks).
// Operands: the buffer, then any number of ordering operands (ignored: they only make the
// calls of one graph run in the order they were traced). Results: the sum, and whether the
// header's sum differs from the communicator's size times the header (the ranks summed
// different collectives), in which case the sum is all NaN. What the header identifies is
// the caller's (hvd_syncbn.comm.static_header).
// Each (communicator, name) counts its calls: the step. Where a collective fails, the
// diagnosis Python registered (hvd_syncbn_xla_set_diagnose) writes the error's message:
// the ranks that can still talk tell each other where they wait, as the host path does.
// Where one waits long, the hook Python registered (hvd_syncbn_xla_set_slow) warns.

// The C API only: no C++ bindings (Open MPI and MPICH would pull in libmpi_cxx).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Collectives that timed out: their requests are still pending (MPI cannot cancel a
// collective), so the Python side aborts MPI at exit rather than hang in MPI_Finalize.
std::atomic<int64_t> stuck{0};

// A pointer in Open MPI, an int in MPICH: a C cast converts to either.
MPI_Comm CommFromHandle(int64_t handle) { return (MPI_Comm)(intptr_t)handle; }
int64_t HandleOfComm(MPI_Comm comm) { return (int64_t)(intptr_t)comm; }

// Python's diagnosis of a failed collective: (name, communicator handle, step, seconds
// since it began, the failure, out, out's size) -> 0 where it wrote the message into out
// (NUL-terminated).
using Diagnose = int (*)(const char*, int64_t, int64_t, double, const char*, char*, size_t);
std::atomic<Diagnose> diagnose{nullptr};

// Python's check of a collective that waits long: (name, communicator handle, step, seconds
// waited) -> seconds until the next check (0 or less: none). Called first once the wait
// passes slow_after seconds; once more with -1 seconds waited when it ends.
using Slow = double (*)(const char*, int64_t, int64_t, double);
std::atomic<Slow> slow{nullptr};
std::atomic<double> slow_after{0.0};

std::mutex steps_mutex;
std::map<std::pair<int64_t, std::string>, int64_t> steps;

// This process's earlier calls of collective `name` over `comm`.
int64_t NextStep(MPI_Comm comm, std::string_view name) {
  std::lock_guard<std::mutex> lock(steps_mutex);
  return steps[{HandleOfComm(comm), std::string(name)}]++;
}

std::string MpiError(std::string_view name, std::string_view what, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(name) + ": " + std::string(what) + " failed: " + std::string(text, length);
}

enum class Failure { kNone, kInvalid, kMpi, kDeadline };

// Calls the slow hook (if any) as a wait of the collective `name` (its `step`) over `comm`
// goes on, and once more when it ends, where it called it.
class SlowWait {
 public:
  using clock = std::chrono::steady_clock;
  SlowWait(std::string_view name, MPI_Comm comm, int64_t step)
      : hook_(slow.load()), name_(name), comm_(HandleOfComm(comm)), step_(step), start_(clock::now()),
        next_(hook_ == nullptr ? clock::time_point::max() : start_ + Seconds(slow_after.load())) {}
  ~SlowWait() {
    if (called_) hook_(name_.c_str(), comm_, step_, -1.0);
  }
  void Check(clock::time_point now) {
    if (now < next_) return;
    called_ = true;
    const double more = hook_(name_.c_str(), comm_, step_, std::chrono::duration<double>(now - start_).count());
    next_ = more > 0 ? now + Seconds(more) : clock::time_point::max();
  }

 private:
  static clock::duration Seconds(double s) {
    return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
  }
  const Slow hook_;
  const std::string name_;
  const int64_t comm_, step_;
  const clock::time_point start_;
  clock::time_point next_;
  bool called_ = false;
};

// Sums `count` values of `in` into `out` over `comm`, waiting at most `timeout` seconds
// (the wait of its `step`, checked by the slow hook); on failure, the message in `error`.
Failure SumOverMpi(const double* in, double* out, size_t count, MPI_Comm comm, double timeout,
                   std::string_view name, int64_t step, std::string* error) {
  if (count > static_cast<size_t>(INT32_MAX)) {
    *error = std::string(name) + ": expected at most 2^31-1 values, got " + std::to_string(count);
    return Failure::kInvalid;
  }
  if (count == 0) return Failure::kNone;

  MPI_Request request;
  int rc = MPI_Iallreduce(in, out, static_cast<int>(count), MPI_DOUBLE, MPI_SUM, comm, &request);
  if (rc != MPI_SUCCESS) {
    *error = MpiError(name, "MPI_Iallreduce", rc);
    return Failure::kMpi;
  }

  // MPI progresses only inside its calls: spin on MPI_Test for a while, then poll every
  // 50 us (as the host path, hvd_syncbn.comm) until the deadline.
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(timeout));
  SlowWait wait(name, comm, step);
  for (int polls = 0;; ++polls) {
    int done = 0;
    rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      *error = MpiError(name, "MPI_Test", rc);
      return Failure::kMpi;
    }
    if (done) return Failure::kNone;
    const auto now = clock::now();
    if (now >= deadline) break;
    if (polls >= 2000) {
      wait.Check(now);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  stuck.fetch_add(1);
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%g", timeout);
  *error = std::string(name) + ": the other ranks did not join within " + seconds +
           " s (hvd_syncbn allreduce of " + std::to_string(count) +
           " float64 values; HVD_SYNCBN_TIMEOUT sets the wait)";
  return Failure::kDeadline;
}

// SumOverMpi of `header` followed by `in` (`count` values); the sum of `in` into `out`, or
// NaN with `*mismatch` set where the header's sum is not the communicator's size times it.
Failure SumChecked(const double* in, double* out, size_t count, const int64_t* header, size_t heads,
                   bool* mismatch, MPI_Comm comm, double timeout, std::string_view name, int64_t step,
                   std::string* error) {
  *mismatch = false;
  if (heads == 0) return SumOverMpi(in, out, count, comm, timeout, name, step, error);
  // Headers are integers below 2^53: exact as doubles, and so is size times one.
  auto buf = std::make_unique<std::vector<double>>(header, header + heads);
  buf->insert(buf->end(), in, in + count);
  auto sum = std::make_unique<std::vector<double>>(buf->size());
  const Failure failure = SumOverMpi(buf->data(), sum->data(), buf->size(), comm, timeout, name, step, error);
  if (failure == Failure::kDeadline) {  // the request is still pending: MPI may use both later
    buf.release();
    sum.release();
  }
  if (failure != Failure::kNone) return failure;
  int size = 0;
  MPI_Comm_size(comm, &size);
  for (size_t i = 0; i < heads; ++i) *mismatch |= (*sum)[i] != static_cast<double>(size) * header[i];
  if (*mismatch) {
    std::fill(out, out + count, std::numeric_limits<double>::quiet_NaN());
  } else {
    std::copy(sum->begin() + heads, sum->end(), out);
  }
  return failure;
}

// SumChecked, counting the step; a failed collective's message is the diagnosis's.
Failure SumCounted(const double* in, double* out, size_t count, const int64_t* header, size_t heads,
                   bool* mismatch, MPI_Comm comm, double timeout, std::string_view name,
                   std::string* error) {
  const int64_t step = NextStep(comm, name);
  const auto start = std::chrono::steady_clock::now();
  const Failure failure = SumChecked(in, out, count, header, heads, mismatch, comm, timeout, name, step, error);
  const Diagnose hook = diagnose.load();
  if ((failure == Failure::kMpi || failure == Failure::kDeadline) && hook != nullptr) {
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
    std::vector<char> text(16384);
    if (hook(std::string(name).c_str(), HandleOfComm(comm), step, waited.count(), error->c_str(), text.data(),
             text.size()) == 0) {
      *error = text.data();
    }
  }
  return failure;
}

ffi::Error Allreduce(ffi::Buffer<ffi::F64> in, ffi::RemainingArgs /*order*/,
                     ffi::ResultBuffer<ffi::F64> out, ffi::ResultBufferR0<ffi::PRED> mismatch,
                     int64_t comm_handle, double timeout, std::string_view name,
                     ffi::Span<const int64_t> header) {
  const size_t count = in.element_count();
  if (out->element_count() != count) {
    return ffi::Error::InvalidArgument(std::string(name) + ": the result has " +
                                       std::to_string(out->element_count()) +
                                       " values, expected " + std::to_string(count));
  }
  std::string error;
  switch (SumCounted(in.typed_data(), out->typed_data(), count, header.begin(), header.size(),
                     mismatch->typed_data(), CommFromHandle(comm_handle), timeout, name, &error)) {
    case Failure::kNone: return ffi::Error::Success();
    case Failure::kInvalid: return ffi::Error::InvalidArgument(error);
    case Failure::kMpi: return ffi::Error::Internal(error);
    case Failure::kDeadline: return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, error);
  }
  return ffi::Error::Internal(error);
}

// The same sum as a TensorFlow kernel, for graphs and eager code outside XLA.
class AllreduceKernel : public tensorflow::OpKernel {
 public:
  explicit AllreduceKernel(tensorflow::OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("comm", &comm_));
    OP_REQUIRES_OK(context, context->GetAttr("timeout", &timeout_));
    OP_REQUIRES_OK(context, context->GetAttr("label", &label_));
    OP_REQUIRES_OK(context, context->GetAttr("header", &header_));
  }

  // Run inline by the executor thread that readied it, not handed to another: a thread hop
  // costs more than the sum of a small buffer.
  bool IsExpensive() override { return false; }

  void Compute(tensorflow::OpKernelContext* context) override {
    const tensorflow::Tensor& in = context->input(0);
    tensorflow::Tensor* out = nullptr;
    tensorflow::Tensor* mismatch = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, in.shape(), &out));
    OP_REQUIRES_OK(context, context->allocate_output(1, tensorflow::TensorShape({}), &mismatch));
    std::string error;
    switch (SumCounted(in.flat<double>().data(), out->flat<double>().data(), in.NumElements(),
                       header_.data(), header_.size(), mismatch->scalar<bool>().data(),
                       CommFromHandle(comm_), timeout_, label_, &error)) {
      case Failure::kNone: return;
      case Failure::kInvalid: return context->SetStatus(absl::InvalidArgumentError(error));
      case Failure::kMpi: return context->SetStatus(absl::InternalError(error));
      case Failure::kDeadline: return context->SetStatus(absl::DeadlineExceededError(error));
    }
  }

 private:
  int64_t comm_ = 0;
  float timeout_ = 0;
  std::string label_;
  std::vector<int64_t> header_;
};

}  // namespace

// Stateful: two sums of equal buffers are two collectives, never one (no CSE or folding).
REGISTER_OP("HvdSyncbnAllreduce")
    .Input("buf: double")
    .Input("order: N * double")
    .Output("sum: double")
    .Output("mismatch: bool")
    .Attr("N: int >= 0")
    .Attr("comm: int")
    .Attr("timeout: float")
    .Attr("label: string")
    .Attr("header: list(int) = []")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    });
REGISTER_KERNEL_BUILDER(Name("HvdSyncbnAllreduce").Device(tensorflow::DEVICE_CPU), AllreduceKernel);

XLA_FFI_DEFINE_HANDLER_SYMBOL(hvd_syncbn_xla_allreduce, Allreduce,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F64>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F64>>()
                                  .Ret<ffi::BufferR0<ffi::PRED>>()
                                  .Attr<int64_t>("comm")
                                  .Attr<double>("timeout")
                                  .Attr<std::string_view>("name")
                                  .Attr<ffi::Span<const int64_t>>("header"));

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

// This process's calls so far of collective `name` over `comm`: the next one's step.
int64_t hvd_syncbn_xla_calls(int64_t comm, const char* name) {
  std::lock_guard<std::mutex> lock(steps_mutex);
  const auto found = steps.find({comm, std::string(name)});
  return found == steps.end() ? 0 : found->second;
}

// Sets the diagnosis of failed collectives (nullptr: none, the message is the library's).
void hvd_syncbn_xla_set_diagnose(Diagnose hook) { diagnose.store(hook); }

// Sets the check of collectives that wait long (nullptr: none), first called once a wait
// passes `after` seconds.
void hvd_syncbn_xla_set_slow(Slow hook, double after) {
  slow_after.store(after);
  slow.store(hook);
}

}  // extern "C"
