import atexit
import os
import secrets
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Every Ray the tests start runs with token authentication, as a Ray pdserve starts does. A
# driver fixes its auth mode at the first ray.init of the process and keeps it after
# ray.shutdown, so the whole test process uses one mode. The token is made for this session and
# travels in RAY_AUTH_TOKEN, which `ray start` subprocesses (the multi-node tests) inherit, so
# their nodes share it and nothing is written to ~/.ray/auth_token. No test turns auth off.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

# Every `pdserve serve` a test starts runs the layout the tests were written for (1P+1D, or the
# flags it gives) on any machine: `--layout auto` could pick another for a machine with more
# cores. The choice itself is tested on fixed profiles (tests/planner/test_auto_layout.py).
os.environ.setdefault("PDSERVE_LAYOUT", "disaggregated")
# And a `--layout auto` a test reaches (the planner's own tests call its chooser) simulates on
# the stored profile: measuring this machine takes some 15 s (pdserve/planner/calibration.py);
# tests/planner/test_calibration.py turns it back on with a fake measurement.
os.environ.setdefault("PDSERVE_LAYOUT_MEASURE", "0")
# And no decode worker moves its weights onto huge pages (pdserve/engine/huge_pages.py): seconds of
# every cluster's start on these VMs, for speed no served test measures; the bits never change.
# tests/engine/test_huge_pages.py turns it back on for the loader's own test.
os.environ.setdefault("PDSERVE_HUGE_PAGES", "0")

# Without CUDA, Triton's kernels (pdserve/engine/attention/triton.py) run in its interpreter, on
# host tensors. Triton reads this once, as it is first imported (its own helpers are decorated
# then), so it is set before any test imports it. With CUDA the same tests run the kernels there.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# The test process ends without its interpreter's native teardown, once pytest has reported and
# cleaned up. Its last part (module teardown, then C++ static destructors) runs while native
# threads that no close() or shutdown() stops are still running: after the suite, grpcio's
# asyncio poller and core threads, and, in any process that ever called ray.init, Ray's driver
# keeps its GCS client I/O thread and its own gRPC threads past ray.shutdown() (both seen in
# /proc/self/task at the end of the serving and worker suites). In a whole `make test` on
# 2026-11-27 such a thread called through a freed function pointer there (the kernel logged a
# jump to a heap address from a thread other than main), and the run went red after every test
# had passed. Only this process's teardown is skipped: the exits of pdserve's own processes
# (serve, workers, router) are tested where those processes run. Registered now, before those
# libraries are imported, so it runs after their exit handlers (last registered, first run).
_exit_status: list[int] = []


def pytest_collection_finish(session):
    from tests.deploy import early_image

    early_image.start([item.nodeid for item in session.items])


def pytest_sessionfinish(session, exitstatus):
    from tests.deploy import early_image

    early_image.stop()
    _exit_status[:] = [int(exitstatus)]


@atexit.register
def _exit_without_native_teardown() -> None:
    if _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])


@pytest.fixture(scope="session", autouse=True)
def _shared_ray_ends():
    """The Ray every test cluster joins (``tests.clusters.shared_ray``) ends with the session
    (read from ``sys.modules``: a session that never imported Ray, or has none, imports nothing)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random-weight Llama with grouped-query attention, saved as a HF directory."""
    from tests.factories import make_hf_model, save_hf_model

    model = make_hf_model("llama")
    return save_hf_model(model, tmp_path_factory.mktemp("tiny-llama")), model


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    """A 1-layer random-weight Llama of ``tiny_llama_dir``'s vocabulary (other weights: another
    seed), saved as a HF directory: a draft model that hardly agrees with that target."""
    from tests.factories import make_hf_model, save_hf_model

    return save_hf_model(make_hf_model("llama", seed=1, num_hidden_layers=1), tmp_path_factory.mktemp("tiny-draft"))


@pytest.fixture(scope="session")
def tool_llama(tmp_path_factory):
    """A tiny random Llama with the default model's 49,152-token tokenizer and a chat template
    with tools (``tests.factories.save_tool_llama``): (directory, ``Tokenizer``)."""
    from pdserve.engine.tokenizer import Tokenizer
    from tests.factories import save_tool_llama

    directory = save_tool_llama(tmp_path_factory.mktemp("tool-llama"))
    return directory, Tokenizer(directory)


@pytest.fixture(scope="module")
def reference():
    """transformers on the served clusters' weights in their dtype (float32: tests/serving/conftest.py),
    and its tokenizer (``tests.factories.default_reference``, loaded once per process). Served greedy
    output is checked against it with ``tests.helpers.chat.assert_chat_greedy``; a module that
    defines a ``reference`` of its own (tests/faults) uses that instead."""
    from tests.factories import default_reference

    return default_reference()


def _kernel_paths():
    from pdserve.engine.kernels import cpu_kernels

    return list(cpu_kernels.ISAS) if cpu_kernels.cpu_supported() else []


@pytest.fixture(params=_kernel_paths())
def kernel_path(request):
    """Each CPU kernel path (pdserve/engine/kernels/csrc/isa.h) this processor runs, in turn; the paths it
    lacks are skipped, and named in the skip. Weights packed inside the test are packed for
    that path; the process's own path comes back afterwards."""
    from pdserve.engine.kernels import cpu_kernels

    name = request.param
    if name not in cpu_kernels.runnable_isas():
        pytest.skip(f"kernel path {name}: not on this processor ({cpu_kernels.cpu_model()}; "
                    f"it runs {', '.join(cpu_kernels.runnable_isas())})")
    cpu_kernels.set_isa(name)
    yield name
    cpu_kernels.set_isa(cpu_kernels.default_isa())
