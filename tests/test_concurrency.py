"""Ops and layers called from 8 Python threads at once give exactly the serial
results (the kernels keep no shared mutable state; a GPTQLinear's lazily built
fast path is published atomically), one GGUF file loads in several
processes at once (read-only, copy-on-write memory maps), and the CPU
kernels' thread pool gives the same results on any thread count, works in a
forked child, and kernel_threads hands torch's threads to it in a model's forward calls."""
import ast
import itertools
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import gguf_blocks as gb
import lowbit
from gguf_files import write_toy_gguf
from lowbit import ops

THREADS = 8


def run_concurrently(calls):
    """Runs every call THREADS times at once; returns {index: [results]}."""
    with ThreadPoolExecutor(THREADS) as pool:
        futures = [(i, pool.submit(call)) for _ in range(THREADS) for i, call in enumerate(calls)]
        results = {}
        for i, f in futures:
            results.setdefault(i, []).append(f.result())
    return results


def test_ops_and_layers_from_eight_threads():
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    raw = torch.from_numpy(gb.random_blocks(np.random.default_rng(0), "Q4_K", 96, 256))

    def make_calls():
        """The calls, on layers of their own that no call has planned yet."""
        torch.manual_seed(0)
        gptq = [lowbit.GPTQLinear.from_linear(torch.nn.Linear(256, 96), bits, 64, False, "gptq_v2",
                                              perm=torch.randperm(256)) for bits in (2, 3, 4, 8)]
        gguf = lowbit.GGUFLinear.from_raw(raw, gb.type_id("Q4_K"), 256)
        calls = [lambda layer=layer: layer(x) for layer in gptq]
        return calls + [lambda: gguf(x), lambda: gguf(x.repeat(4, 1)),
                        lambda: torch.ops.lowbit.ggml_dequantize(raw, gb.type_id("Q4_K"), 96, 256, torch.float32),
                        lambda: torch.ops.lowbit.gptq_dequantize(gptq[1].qweight, gptq[1].qzeros, gptq[1].scales,
                                                                 gptq[1].g_idx, True, 3)]

    serial = [call() for call in make_calls()]
    # The GPTQ layers' first calls race to build the shuffled plan.
    for i, outputs in run_concurrently(make_calls()).items():
        assert all(torch.equal(out, serial[i]) for out in outputs), f"call {i} differs under threads"


def test_one_gguf_file_loads_in_several_processes(tmp_path):
    path = tmp_path / "toy.gguf"
    write_toy_gguf(path)
    with lowbit.load_gguf(path) as f:
        expect = {name: t.data.sum().item() for name, t in f.tensors.items()}
    script = ("import sys, lowbit\n"
              "with lowbit.load_gguf(sys.argv[1]) as f:\n"
              "    print(repr({n: t.data.sum().item() for n, t in f.tensors.items()}))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    before = path.read_bytes()
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and ast.literal_eval(out) == expect
    assert path.read_bytes() == before  # no loader writes to its input


def pool_calls():
    """Calls of every CPU op that splits its work over the pool, at sizes of
    many chunks (matvec, batch, dequantization, GPTQ's fused and tiled paths,
    packing, float weights on the GEMM library)."""
    torch.manual_seed(1)
    raw = torch.from_numpy(gb.random_blocks(np.random.default_rng(1), "Q4_K", 1024, 2048))
    q4k = gb.type_id("Q4_K")
    x1, x9 = torch.randn(1, 2048), torch.randn(9, 2048)
    layer = lowbit.GPTQLinear.from_linear(torch.nn.Linear(2048, 768), 4, 128, False, "gptq_v2",
                                          perm=torch.randperm(2048))
    big = torch.randn(96, 2048)
    f16 = torch.randn(1100, 2048).half().view(torch.uint8)
    return [lambda: torch.ops.lowbit.ggml_mul_mat_vec_a8(raw, x1, q4k, 1024),
            lambda: torch.ops.lowbit.ggml_mul_mat_a8(raw, x9, q4k, 1024),
            lambda: torch.ops.lowbit.ggml_dequantize(raw, q4k, 1024, 2048, torch.float32),
            lambda: torch.ops.lowbit.ggml_repack(raw, q4k, 1024, 2048, False),
            lambda: layer(x1), lambda: layer(big),
            lambda: torch.ops.lowbit.gptq_unpack(layer.qweight, 4, 0),
            lambda: torch.ops.lowbit.ggml_mul_mat_a8(f16, big, gb.type_id("F16"), 1100)]


@pytest.mark.parametrize("torch_threads", [1, 2, 3])
def test_pool_results_do_not_depend_on_the_thread_count(torch_threads):
    """The same bits on any count of lowbit's threads, and on torch's team
    (cpu_team("torch"), on torch's count) as on lowbit's pool."""
    calls = pool_calls()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = [call() for call in calls]
        torch.set_num_threads(torch_threads)
        for threads in (0, 1, 2, 3, 7):  # 0: torch's count; more than this machine's cores
            assert ops.cpu_threads(threads) == threads
            for i, call in enumerate(calls):
                assert torch.equal(call(), serial[i]), f"call {i} differs on {threads} lowbit threads"
        ops.cpu_threads(0)
        assert ops.cpu_team("torch") == "torch"
        for i, call in enumerate(calls):
            assert torch.equal(call(), serial[i]), f"call {i} differs on torch's team"
    finally:
        ops.cpu_team("pool")
        ops.cpu_threads(0)
        torch.set_num_threads(saved)


def test_cpu_team_switches_and_refuses_unknown_teams():
    assert ops.cpu_team() == "pool"  # the default
    try:
        assert ops.cpu_team("torch") == "torch" and ops.cpu_team() == "torch"
        with pytest.raises(ValueError, match="^cpu_team: unknown team 'omp'; expected pool or torch"):
            ops.cpu_team("omp")
        assert ops.cpu_team() == "torch"  # a refused value changes nothing
    finally:
        ops.cpu_team("pool")


def test_pool_works_in_a_forked_child():
    """A child forked after the pool started has none of its threads: it
    starts its own (no hang), with the same results. (GNU OpenMP's threads,
    torch's own, do not survive a fork: the child runs torch's ops on one.)"""
    script = textwrap.dedent("""
        import os, sys, torch
        sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]
        import lowbit
        from test_concurrency import pool_calls
        torch.set_num_threads(2)
        lowbit.ops.cpu_threads(3)
        calls = pool_calls()
        expect = [call() for call in calls]
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            same = all(torch.equal(call(), e) for call, e in zip(calls, expect))
            os._exit(0 if same else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_large_m_gemms_run_as_pool_tasks():
    """Under kernel_threads' split (torch on one thread, lowbit's pool on
    two), gptq_gemm's large-M path and the float weights' run their GEMM
    strips as tasks of lowbit's pool, each GEMM on its task's thread: no
    OpenMP worker is started for them (a fresh process, whose torch never ran
    a parallel region), torch's count stays at one, the pool's helper does
    part of the work (its CPU time grows), and the results are right. With
    a pool of one nothing runs beside the caller."""
    script = textwrap.dedent("""
        import os, sys, torch
        torch.set_num_threads(1)
        import lowbit
        from lowbit.gptq.rtn import quantize_rtn
        pool = int(sys.argv[1])
        lowbit.ops.cpu_threads(pool)
        K, N = 1024, 2048
        q = quantize_rtn(torch.randn(N, K), 4, 128, sym=False)
        g_idx = torch.arange(K, dtype=torch.int32) // 128
        w = torch.ops.lowbit.gptq_dequantize(q.qweight, q.qzeros, q.scales.float(), g_idx, True, 4)
        f16 = torch.randn(N, K).half()
        def call(M):
            a = torch.randn(M, K)
            out = torch.ops.lowbit.gptq_gemm(a, q.qweight, q.qzeros, q.scales, g_idx, False, True, 4)
            torch.testing.assert_close(out, a @ w, rtol=1e-4, atol=1e-3)
            out = torch.ops.lowbit.ggml_mul_mat_a8(f16.view(torch.uint8), a, 1, N)
            torch.testing.assert_close(out, a @ f16.float().t(), rtol=1e-4, atol=1e-3)
        def helper_ticks():  # user + system clock ticks of every thread but this one
            me = str(os.getpid())
            return sum(sum(map(int, open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[11:13]))
                       for t in os.listdir("/proc/self/task") if t != me)
        call(1)  # the pool's threads start
        threads, ticks = len(os.listdir("/proc/self/task")), helper_ticks()
        for _ in range(8):
            call(512)
        print(len(os.listdir("/proc/self/task")) - threads, helper_ticks() - ticks, torch.get_num_threads())
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "python"), os.environ.get("PYTHONPATH", "")]))
    for pool in (1, 2):
        done = subprocess.run([sys.executable, "-c", script, str(pool)], cwd=root, capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        new_threads, helper_ticks, torch_threads = map(int, done.stdout.split())
        assert new_threads == 0 and torch_threads == 1
        assert (helper_ticks > 0) == (pool == 2), (pool, helper_ticks)


@pytest.fixture
def two_torch_threads():
    """torch on two threads for the test; torch's count, lowbit's and its team restored after."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        ops.cpu_team("pool")
        ops.cpu_threads(0)
        torch.set_num_threads(saved)


def test_kernel_threads_gives_torch_threads_to_the_kernels(two_torch_threads):
    from tiny_models import tiny_model

    model = tiny_model("llama", 0).eval()
    seen = []
    model.model.layers[0].mlp.register_forward_pre_hook(
        lambda module, args: seen.append((torch.get_num_threads(), ops.cpu_threads())))
    assert lowbit.kernel_threads(model) is model
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]))  # torch's ops on one thread, lowbit's on two
        assert seen == [(1, 2)] and (torch.get_num_threads(), ops.cpu_threads()) == (2, 0)
        ops.cpu_threads(3)  # a count the user set is kept, and restored
        model(torch.tensor([[1]]))
        assert seen[-1] == (1, 3) and (torch.get_num_threads(), ops.cpu_threads()) == (2, 3)
        ops.cpu_threads(0)
        # Restored when the forward raises.
        with pytest.raises(IndexError):
            model(torch.tensor([[10 ** 6]]))
        assert (torch.get_num_threads(), ops.cpu_threads()) == (2, 0)
        # One thread: nothing to hand over.
        torch.set_num_threads(1)
        model(torch.tensor([[1]]))
        assert seen[-1] == (1, 0)
        # More threads than the pool takes (1024): the pool runs on its most, torch's count is restored.
        torch.set_num_threads(2000)
        model(torch.tensor([[1]]))
        assert seen[-1] == (1, 1024) and (torch.get_num_threads(), ops.cpu_threads()) == (2000, 0)
        # More than cpu_torch_threads sets (8192), which a split could not restore: the call runs as it is.
        torch.set_num_threads(9000)
        model(torch.tensor([[1]]))
        assert seen[-1] == (9000, 0) and (torch.get_num_threads(), ops.cpu_threads()) == (9000, 0)
        model.generate(torch.tensor([[1]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert seen[-1] == (9000, 0) and (torch.get_num_threads(), ops.cpu_threads()) == (9000, 0)
        torch.set_num_threads(2)
        lowbit.kernel_threads(model, False)
        model(torch.tensor([[1]]))
        assert seen[-1] == (2, 0)


def test_kernel_threads_calls_on_two_threads_restore_their_own(two_torch_threads):
    """A's call enters, B's enters, A's returns, B's returns: each thread leaves its own settings and autograd
    state (with one stack for all threads A would pop B's entry, leaving B's thread below autograd for good
    and lowbit's thread count pinned)."""
    import threading

    from tiny_models import tiny_model

    model = lowbit.kernel_threads(tiny_model("llama", 0).eval())
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()

    def pause(module, args):
        if threading.current_thread().name == "A":
            a_in.set()
            assert b_in.wait(30)
        else:
            b_in.set()
            assert a_done.wait(30)

    model.model.layers[0].mlp.register_forward_pre_hook(pause)
    after = {}

    def call(name):
        torch.set_num_threads(2)
        if name == "B":
            assert a_in.wait(30)
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        if name == "A":
            a_done.set()
        x = torch.ones(2, requires_grad=True)
        after[name] = (x * 2).requires_grad

    threads = [threading.Thread(target=call, args=(name,), name=name) for name in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert after == {"A": True, "B": True}  # (torch's own count is process-wide at first use in a thread)
    assert (ops.cpu_threads(), ops.cpu_team()) == (0, "pool")


def test_a_thread_starting_during_another_s_call_keeps_torch_s_count(two_torch_threads):
    """A thread whose first torch call comes while another thread's
    kernel_threads call runs takes torch's count, not the one thread that call
    gives its own torch ops, and keeps it after; the calling thread's count is
    restored as before."""
    import threading

    from tiny_models import tiny_model

    model = lowbit.kernel_threads(tiny_model("llama", 0).eval())
    inside, release, first_seen = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def pause(module, args):
        seen["caller"] = torch.get_num_threads()
        inside.set()
        assert release.wait(30)

    model.model.layers[0].mlp.register_forward_pre_hook(pause)

    def call():
        torch.set_num_threads(2)
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        seen["caller after"] = torch.get_num_threads()

    def newcomer():
        assert inside.wait(30)
        seen["newcomer during"] = torch.get_num_threads()
        first_seen.set()
        assert caller_done.wait(30)
        seen["newcomer after"] = torch.get_num_threads()

    caller_done = threading.Event()
    caller, other = threading.Thread(target=call), threading.Thread(target=newcomer)
    caller.start()
    other.start()
    assert first_seen.wait(30)
    release.set()
    caller.join(60)
    caller_done.set()
    other.join(60)
    assert seen == {"caller": 1, "newcomer during": 2, "caller after": 2, "newcomer after": 2}


def test_a_forked_child_keeps_only_its_own_threads_calls():
    """A child forked while another thread's kernel_threads call runs (and a
    third thread holds the settings' lock) has neither thread: its own calls
    do not wait for that lock, and lowbit's pool follows torch's count again
    (the parent's call pinned it at two), before and after them. A child
    forked inside a call of its own thread ends that call and restores the
    settings as it does."""
    script = textwrap.dedent("""
        import os, sys, threading, time, torch
        sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]
        import lowbit
        from lowbit import ops
        from tiny_models import tiny_model
        torch.set_num_threads(2)
        model = lowbit.kernel_threads(tiny_model("llama", 0).eval())
        inside, held, release = threading.Event(), threading.Event(), threading.Event()
        forks = []  # the main thread's call forks where this holds True, and keeps the child's pid
        def call():
            with torch.no_grad():
                model(torch.tensor([[1, 2, 3]]))
        def restored():
            return (ops.cpu_threads(), ops.cpu_team(), lowbit.threads._SPLIT_CALLS[0]) == (0, "pool", 0)
        def wait(pid, what):
            deadline = time.monotonic() + 30
            while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    sys.exit(f"the child forked {what} hangs")
                time.sleep(0.05)
            if os.waitstatus_to_exitcode(status[1]) != 0:
                sys.exit(f"the child forked {what} has its settings unrestored")
        def pause(module, args):
            if threading.current_thread().name == "A":
                inside.set()
                release.wait(60)
            elif forks == [True]:
                forks[0] = os.fork()
        def hold():
            with lowbit.threads._SETTINGS_LOCK:
                held.set()
                release.wait(60)
        model.model.layers[0].mlp.register_forward_pre_hook(pause)
        threads = [threading.Thread(target=call, name="A", daemon=True), threading.Thread(target=hold, daemon=True)]
        threads[0].start()
        inside.wait(60)
        threads[1].start()
        held.wait(60)
        pid = os.fork()
        if pid == 0:
            before = restored()
            call()
            os._exit(0 if before and restored() else 3)
        wait(pid, "beside other threads' calls")
        release.set()
        for t in threads:
            t.join(60)
        forks.append(True)
        call()
        if forks[0] == 0:
            os._exit(0 if restored() else 3)
        wait(forks[0], "inside its own thread's call")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]


def test_kernel_threads_runs_long_calls_on_torchs_team(two_torch_threads):
    """A call over TORCH_TEAM_TOKENS tokens (batch x sequence) or more keeps
    torch's threads and runs lowbit's kernels on them; shorter ones split;
    the settings are restored after each call, also when it raises."""
    from tiny_models import tiny_model

    from lowbit.threads import TORCH_TEAM_TOKENS

    model = tiny_model("llama", 0).eval()
    seen = []
    model.model.layers[0].mlp.register_forward_pre_hook(
        lambda module, args: seen.append((torch.get_num_threads(), ops.cpu_threads(), ops.cpu_team())))
    ids = torch.zeros(2, TORCH_TEAM_TOKENS // 2, dtype=torch.long)
    lowbit.kernel_threads(model)
    with torch.no_grad():
        model(ids)
        assert seen[-1] == (2, 0, "torch")
        assert (torch.get_num_threads(), ops.cpu_threads(), ops.cpu_team()) == (2, 0, "pool")
        model(ids[:, 1:])  # one token short
        assert seen[-1] == (1, 2, "pool")
        with pytest.raises(IndexError):
            model(ids + 10 ** 6)
        assert (torch.get_num_threads(), ops.cpu_threads(), ops.cpu_team()) == (2, 0, "pool")
        ops.cpu_team("torch")  # a user's setting is restored, and a split call runs on the pool
        model(ids[:1, :4])
        assert seen[-1] == (1, 2, "pool") and ops.cpu_team() == "torch"
        ops.cpu_team("pool")
        lowbit.kernel_threads(model, torch_team_tokens=None)  # every call split
        model(ids)
        assert seen[-1] == (1, 2, "pool")
        lowbit.kernel_threads(model, torch_team_tokens=4)
        model(ids[:1, :4])
        assert seen[-1] == (2, 0, "torch")
        for bad in (0, -1, 2.0, True, "4"):
            with pytest.raises(ValueError, match="^kernel_threads: torch_team_tokens must be a positive int"):
                lowbit.kernel_threads(model, torch_team_tokens=bad)
        for bad in ("off", None, 0, 1.0):
            with pytest.raises(ValueError, match="^kernel_threads: enable must be True or False, got "):
                lowbit.kernel_threads(model, bad)
        model(ids[:1, :4])  # a refused setting leaves the hooks as they were
        assert seen[-1] == (2, 0, "torch")
        for bad in (None, "model", model.state_dict()):
            with pytest.raises(TypeError, match="^kernel_threads: model must be an nn.Module, got "):
                lowbit.kernel_threads(bad)


def test_kernel_threads_holds_the_split_through_generate(two_torch_threads):
    """generate's own ops between forward calls (its logits processors) run
    on torch's one thread too, its forward calls split as any other (a long
    prompt on torch's team and threads), and everything is restored after
    the call, also when it raises."""
    from tiny_models import tiny_model
    from transformers import LogitsProcessor, LogitsProcessorList

    model = tiny_model("llama", 0).eval()
    layer_seen, between = [], []

    class Record(LogitsProcessor):
        def __call__(self, input_ids, scores):
            between.append((torch.get_num_threads(), ops.cpu_threads(), ops.cpu_team()))
            return scores

    model.model.layers[0].mlp.register_forward_pre_hook(
        lambda module, args: layer_seen.append((torch.get_num_threads(), ops.cpu_threads(), ops.cpu_team())))
    lowbit.kernel_threads(model, torch_team_tokens=8)
    generate = lambda ids, **kw: model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                                pad_token_id=0, logits_processor=LogitsProcessorList([Record()]), **kw)
    with torch.no_grad():
        generate(torch.tensor([[1, 2, 3, 4]]))
        assert set(between) == {(1, 2, "pool")} and set(layer_seen) == {(1, 2, "pool")}
        assert (torch.get_num_threads(), ops.cpu_threads(), ops.cpu_team()) == (2, 0, "pool")
        layer_seen.clear()
        generate(torch.arange(1, 11)[None])  # a 10-token prompt, over torch_team_tokens
        assert layer_seen[0] == (2, 2, "torch") and set(layer_seen[1:]) == {(1, 2, "pool")}
        with pytest.raises(IndexError):
            generate(torch.tensor([[10 ** 6]]))
        assert (torch.get_num_threads(), ops.cpu_threads(), ops.cpu_team()) == (2, 0, "pool")
    lowbit.kernel_threads(model, False)
    assert "generate" not in model.__dict__


def test_kernel_threads_runs_no_grad_calls_below_autograd():
    """Under no_grad a model's forward call dispatches every op below
    autograd (the same logits), and with grad mode on through it; the
    dispatch state is restored after the call, also when it raises."""
    from tiny_models import tiny_model

    model = lowbit.kernel_threads(tiny_model("llama", 0).eval())
    below = lambda: torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality)
    seen = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: seen.append(below()))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        logits = model(ids).logits
        assert seen == [True] and not below()
        with pytest.raises(IndexError):
            model(torch.tensor([[10 ** 6]]))
        assert not below()
    with_grad = model(ids).logits
    assert seen[-1] is False and with_grad.grad_fn is not None and torch.equal(with_grad.detach(), logits)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_call_restores_threads_and_autograd(two_torch_threads, interrupt):
    """An interrupt inside a forward or generate call (Ctrl-C; torch's
    always-called forward hooks run for Exceptions only) leaves torch's
    thread count, lowbit's pool and autograd as they were: a later training
    step gets its gradients, and a later change of torch's count is lowbit's too."""
    import lowbit.threads
    from tiny_models import tiny_model

    model = lowbit.kernel_threads(tiny_model("llama", 0).eval())
    below = lambda: torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality)

    def stop(module, args):
        raise interrupt()
    handle = model.model.layers[1].register_forward_pre_hook(stop)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        with pytest.raises(interrupt):
            model(ids)
        with pytest.raises(interrupt):
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    handle.remove()
    assert not below() and lowbit.threads._SPLIT_CALLS[0] == 0
    assert (torch.get_num_threads(), ops.cpu_threads()) == (2, 0)
    model.train()
    assert model(ids, labels=ids).loss.requires_grad


def test_an_interrupt_as_a_setting_changes_restores_everything(two_torch_threads, monkeypatch):
    """Ctrl-C's KeyboardInterrupt is raised as a call returns, one of
    kernel_threads' own among them: raised as each of its calls setting or
    reading torch's count, lowbit's pool or a generate call's saved count
    returns in turn, inside a split or a restore, it leaves torch's count,
    lowbit's pool and the count of split calls as they were."""
    import lowbit.threads
    from tiny_models import tiny_model

    model = lowbit.kernel_threads(tiny_model("llama", 0).eval(), torch_team_tokens=3)
    settings = [(torch.ops.lowbit, "cpu_torch_threads"), (torch.ops.lowbit, "cpu_threads"),
                (torch.ops.lowbit, "cpu_team")]
    calls = {"forward": lambda: model(torch.tensor([[1, 2]])),
             "long forward": lambda: model(torch.tensor([[1, 2, 3]])),
             "generate": lambda: model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False,
                                                pad_token_id=0)}
    for name, call in calls.items():
        for k in itertools.count(1):  # the k-th call is interrupted, until the model's call makes fewer
            made = []

            def interrupt_kth(setting):
                def interrupting(*args):
                    result = setting(*args)
                    made.append(args)
                    if len(made) == k:
                        raise KeyboardInterrupt
                    return result
                return interrupting

            for owner, attribute in settings:
                monkeypatch.setattr(owner, attribute, interrupt_kth(getattr(owner, attribute)))
            generating = lowbit.threads._KernelThreads.generating  # a generate call's thread counts
            monkeypatch.setattr(lowbit.threads._KernelThreads, "generating", property(interrupt_kth(generating.fget)))
            try:
                with torch.no_grad():
                    call()
            except KeyboardInterrupt:
                finished = False
            else:
                finished = True
            monkeypatch.undo()
            after = (torch.get_num_threads(), ops.cpu_threads(), ops.cpu_team(), lowbit.threads._SPLIT_CALLS[0])
            assert after == (2, 0, "pool", 0), (name, k)
            if finished:
                break
        assert k > 1, name


def test_a_temporary_model_s_forward_and_generate_run(tmp_path):
    """The forward and generate lowbit puts on a model keep it alive: called
    on a model nothing else holds (load_gguf_model(path).generate(...), a
    bound generate handed to a thread), they run."""
    from tiny_models import tiny_model, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model("llama", 0), "llama")
    ids = torch.tensor([[1, 2]])
    greedy = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    held = lowbit.load_gguf_model(path)
    with torch.no_grad():
        tokens, logits = held.generate(ids, **greedy), held(ids).logits
        assert tokens.shape == (1, 4)
        assert torch.equal(lowbit.load_gguf_model(path).generate(ids, **greedy), tokens)
        assert torch.equal(lowbit.load_gguf_model(path).forward(ids).logits, logits)
    generate = lowbit.load_gguf_model(path).generate
    with ThreadPoolExecutor(1) as pool:
        assert torch.equal(pool.submit(generate, ids, **greedy).result(), tokens)

def test_loaded_models_give_torch_threads_to_the_kernels(tmp_path, two_torch_threads):
    from tiny_models import tiny_model, write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_model("llama", 0), "llama")
    for model in (lowbit.load_gguf_model(path), tiny_model("llama", 0)):
        if not isinstance(model.model.layers[0].mlp.down_proj, lowbit.GGUFLinear):
            lowbit.replace_linear(model, path)
        seen = []
        model.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
        with torch.no_grad():
            model(torch.tensor([[1, 2]]))
        assert seen == [1] and torch.get_num_threads() == 2


def test_a_model_with_kernel_threads_pickles(two_torch_threads):
    import io

    from tiny_models import tiny_model

    model = lowbit.kernel_threads(tiny_model("llama", 0), torch_team_tokens=3)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    ids = torch.tensor([[1, 2, 3]])
    seen = []
    again.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: seen.append(ops.cpu_team()))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    assert seen == ["torch"]  # the copy keeps its threshold
