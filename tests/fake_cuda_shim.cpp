// Fake CUDA for a CPU-only torch (tests/fake_cuda.py builds and loads this before torch
// is imported). The autograd engine asks the CUDA device guard about every CUDA tensor
// (its device, stream and events) and whether CUDA is built; a CPU-only torch has neither
// and aborts. Here both answer as one device with one stream, doing nothing: enough for
// FakeTensorMode's CUDA tensors, which have no data, to go through backward.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
using c10::Device;
using c10::Stream;
constexpr c10::DeviceType kCuda = c10::DeviceType::CUDA;

struct FakeCudaGuard final : c10::impl::NoOpDeviceGuardImpl<kCuda> {
  Device exchangeDevice(Device) const override { return Device(kCuda, 0); }
  Device getDevice() const override { return Device(kCuda, 0); }
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, Device(kCuda, 0)); }
  Stream getNewStream(Device, int) const override { return Stream(Stream::DEFAULT, Device(kCuda, 0)); }
  Stream exchangeStream(Stream) const noexcept override { return Stream(Stream::DEFAULT, Device(kCuda, 0)); }
  void record(void**, const Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
};
C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);
}  // namespace

namespace at {
struct FakeCUDAHooks final : CUDAHooksInterface {
  explicit FakeCUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return false; }
};
// Under the name torch's own CUDA build registers, which getCUDAHooks() asks for once.
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks);
}  // namespace at
