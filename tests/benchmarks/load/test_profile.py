"""benchmarks/load/profile.py's classifier on stacks shaped like py-spy's collapsed output."""

from pdserve.benchmarks.load.profile import breakdown, classify

PY = "_step (pdserve/server/decode/engine.py:220)"
FWD = "forward (pdserve/server/decode/model.py:80)"


def test_torch_ops_by_the_outermost_aten_op():
    linear = [PY, FWD, "at::_ops::linear::call", "at::_ops::addmm::call", "mkl_blas_sgemm (libtorch_cpu.so)"]
    assert classify(linear) == "matmul"
    sdpa = [PY, FWD, "at::_ops::scaled_dot_product_attention::call", "at::_ops::_softmax::call"]
    assert classify(sdpa) == "attention"
    gather = [PY, FWD, "at::_ops::index_select::call", "__memmove_avx_unaligned_erms (libc.so.6)"]
    assert classify(gather) == "kv gather/copy"
    assert classify([PY, FWD, "at::_ops::mul::call"]) == "elementwise"


def test_sampling_by_the_python_file_that_called_the_op():
    argmax = [PY, "sample (pdserve/server/decode/sampler.py:40)", "at::_ops::argmax::call"]
    assert classify(argmax) == "sampling"
    mul = [PY, "sample (pdserve/server/decode/sampler.py:41)", "at::_ops::div::call"]
    assert classify(mul) == "sampling"


def test_xla_thunks_and_python_modules():
    dot = ["_run (pdserve/server/prefill/engine.py:230)", "xla::cpu::DotThunk::Execute (libjax.so)",
           "Eigen::TensorContractionEvaluatorBase (libjax.so)"]
    assert classify(dot) == "matmul"
    fused = ["_run (pdserve/server/prefill/engine.py:230)", "xla::cpu::KernelThunk::Execute (libjax.so)", "0x7f00"]
    assert classify(fused) == "elementwise"
    grpc = [PY, "_send (grpc/aio/_call.py:300)", "SerializeToString (google/protobuf/message.py:10)"]
    assert classify(grpc) == "gRPC/protobuf"
    assert classify(["run_forever (asyncio/base_events.py:608)", "_run_once (asyncio/base_events.py:1936)"]) == "asyncio"
    assert classify([PY, "_postprocess (pdserve/server/decode/engine.py:270)"]) == "python"
    assert classify(["0x7f00 (libc.so.6)"]) == "other native"


def test_breakdown_weights_each_stack_by_its_count():
    raw = (f"{PY};{FWD};at::_ops::linear::call 3\n"
           f"{PY};{FWD};at::_ops::index_select::call 1\n")
    assert breakdown(raw) == {"matmul": 0.75, "kv gather/copy": 0.25, "samples": 4, "idle_samples": 0}
    assert breakdown("") == {"samples": 0, "idle_samples": 0}


def test_waits_are_idle_xla_or_gil():
    loop = ["run_forever (asyncio/base_events.py:608)", "Loop__Loop__run (loop.c:19903)", "epoll_pwait (libc.so.6)"]
    assert classify(loop) == "idle"
    xla = ["_run (pdserve/server/prefill/engine.py:230)", "__call__ (jax/_src/pjit.py:300)",
           "absl::synchronization_internal::FutexWaiter::Wait (jaxlib/libjax_common.so)", "syscall (libc.so.6)"]
    assert classify(xla) == "XLA compute"
    gil = [PY, "torch::autograd::THPVariable_linear (libtorch_python.so)",
           "pybind11::gil_scoped_release::~gil_scoped_release (libtorch_python.so)", "pthread_cond_timedwait (libc.so.6)"]
    assert classify(gil) == "GIL wait"
    binding = [PY, FWD, "torch::autograd::THPVariable_linear (libtorch_python.so)", "0x7fb7b9dfd095 (?)"]
    assert classify(binding) == "matmul"
    jit = [PY, "Linear.forward (pdserve/server/decode/quant.py:56)", "0x7fb7b9dfd095 (?)"]
    assert classify(jit) == "matmul"
    raw = "\n".join(f"{';'.join(s)} 1" for s in (loop, xla, binding, binding))
    assert breakdown(raw) == {"matmul": 2 / 3, "XLA compute": 1 / 3, "samples": 3, "idle_samples": 1}
