// The prefill's host calls as one named XLA FFI target ("pdserve_host_call", host_call.py): the compiled program
// names the target and an `op` string attribute, never a Python object, so JAX's persistent cache keeps it.
//
// The handler hands the call's buffers, in place (no copy), to the function host_call.py sets at process start:
// fn(op, op_len, n_args, count, buffers, meta, error, error_len) -> 0, or nonzero with a message written to `error`.
// buffers: the arguments' then the results' data pointers; meta, per buffer: XLA's dtype number, rank, dims.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" {
typedef int32_t (*pdserve_host_fn)(const char* op, int64_t op_len, int64_t n_args, int64_t count, void** buffers,
                                   const int64_t* meta, char* error, int64_t error_len);
static pdserve_host_fn host_fn = nullptr;

void pdserve_set_host_fn(pdserve_host_fn fn) { host_fn = fn; }
}

static void Describe(const ffi::AnyBuffer& buffer, std::vector<int64_t>& meta) {
  meta.push_back(static_cast<int64_t>(buffer.element_type()));
  auto dims = buffer.dimensions();
  meta.push_back(static_cast<int64_t>(dims.size()));
  for (int64_t d : dims) meta.push_back(d);
}

static ffi::Error HostCall(ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view op) {
  if (host_fn == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "pdserve_host_call: no host function is set in this process (import "
                      "pdserve.server.prefill.host_call and call its load() before running the program)");
  }
  std::vector<void*> buffers;
  std::vector<int64_t> meta;
  buffers.reserve(args.size() + rets.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto arg = args.get<ffi::AnyBuffer>(i);
    if (arg.has_error()) return arg.error();
    buffers.push_back(arg->untyped_data());
    Describe(*arg, meta);
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto ret = rets.get<ffi::AnyBuffer>(i);
    if (ret.has_error()) return ret.error();
    buffers.push_back((*ret)->untyped_data());
    Describe(**ret, meta);
  }
  char error[1024] = {0};
  int32_t rc = host_fn(op.data(), static_cast<int64_t>(op.size()), static_cast<int64_t>(args.size()),
                       static_cast<int64_t>(buffers.size()),
                       buffers.data(), meta.data(), error, sizeof(error) - 1);
  if (rc != 0) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("pdserve_host_call ") + std::string(op) + ": " + error);
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(pdserve_host_call, HostCall,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<std::string_view>("op"));
