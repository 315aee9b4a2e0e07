"""A step is whole or not taken (S3.1) when Ctrl-C, SIGTERM or an error lands in the
middle of it, and state made under ``torch.inference_mode`` steps outside it (S1.6)."""

import copy
import re
import select
import signal
import threading

import pytest
import torch

from _optimizer_testing import assert_bitwise_equal, attach_grads, fused_adam, make_params

SETTINGS = dict(lr=1e-2, weight_decay=0.05, master_weights=True)
SHAPES = [(64, 33), (33, 64), (17,)]


def _grads(params):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _two_groups(params):
    return [dict(params=params[:1]), dict(params=params[1:])]


def _strided(params):
    """params[1] as every other column of a wider matrix (not dense): the C++ path steps
    a copy and writes it back."""
    value = params[1].detach()
    wide = torch.stack((value, torch.zeros_like(value)), dim=-1)
    params[1] = torch.nn.Parameter(wide[..., 0])
    assert not params[1].is_contiguous() and torch.equal(params[1].detach(), value)
    return params


def _stepped_reference(params, groups=_two_groups, change=None):
    """An optimizer of ``params`` and one of their copies (``ref``) whose step has
    run: what the interrupted step must end as. ``change(optimizer)``: a setting both
    change before their first step."""
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref_opt = (fused_adam()(groups(ps), **SETTINGS) for ps in (params, ref))
    for optimizer in (opt, ref_opt) if change else ():
        change(optimizer)
    attach_grads(params, _grads(params), False)
    attach_grads(ref, _grads(ref), False)
    ref_opt.step()
    return ref, opt, ref_opt


def _calls_to_run(monkeypatch, before):
    """``_backend.run`` with ``before(number of the call)`` called first; the calls."""
    from shardadam import _backend

    run, calls = _backend.run, []

    def patched(item, hyper):
        calls.append(item)
        before(len(calls))
        return run(item, hyper)

    monkeypatch.setattr(_backend, "run", patched)
    return calls


def _assert_same(params, ref, opt, ref_opt, where):
    for p, q in zip(params, ref):
        assert_bitwise_equal(p.detach(), q.detach(), f"param {where}")
        for name, value in ref_opt.state[q].items():
            got = opt.state[p][name]
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(got, value, f"{name} {where}")
    assert [g["step"] for g in opt.param_groups] == [g["step"] for g in ref_opt.param_groups]


@pytest.mark.parametrize("at_call", [1, 2])
def test_ctrl_c_during_a_step_waits_until_the_step_is_whole(backend, monkeypatch, at_call):
    """A SIGINT that arrives while the groups' batches run (the core releases the GIL,
    so Python's handler runs right after a batch) raises its KeyboardInterrupt once
    every group is stepped, counted and written back: the state is the uninterrupted
    step's, and the handler is back in place."""
    params = _strided(make_params([torch.bfloat16] * 3, SHAPES, seed=3))
    ref, opt, ref_opt = _stepped_reference(params)

    def ctrl_c(call):
        if call == at_call:
            signal.raise_signal(signal.SIGINT)  # as Ctrl-C during this batch

    calls = _calls_to_run(monkeypatch, ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert len(calls) == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _assert_same(params, ref, opt, ref_opt, "after the interrupted step")


@pytest.mark.parametrize("caller", ["a signal handler", "another thread"])
def test_a_step_inside_a_step_is_refused(backend, monkeypatch, caller):
    """step() of the optimizer while its step runs (a SIGALRM handler's, called between
    the core's batches, or another thread's) is refused with nothing changed; the step
    it interrupted ends as the uninterrupted one, and the next steps run."""
    params = make_params([torch.bfloat16] * 3, SHAPES, seed=3)
    ref, opt, ref_opt = _stepped_reference(params)
    refusals = []

    def step_again():
        try:
            opt.step()
        except RuntimeError as error:
            refusals.append(str(error))

    def nested(call):
        if call != 1:
            return
        if caller == "another thread":
            thread = threading.Thread(target=step_again)
            thread.start()
            thread.join()
        else:
            step_again()

    calls = _calls_to_run(monkeypatch, nested)
    opt.step()
    assert len(calls) == 2, "the nested step ran a batch"
    assert len(refusals) == 1 and re.search(
        r"FusedAdam: step\(\) was called while another step\(\) of this optimizer runs.*"
        r"nothing changed \(rule S3\.1", refusals[0]), refusals
    _assert_same(params, ref, opt, ref_opt, "after the step")
    opt.step()
    ref_opt.step()
    _assert_same(params, ref, opt, ref_opt, "after the next step")


@pytest.fixture
def sigterm_handler():
    """A recording SIGTERM handler, the process's own put back afterwards."""
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    yield seen
    signal.signal(signal.SIGTERM, previous)


def test_held_signals_run_the_handlers_in_place_after_the_step(monkeypatch,
                                                               sigterm_handler):
    """The held signals' handlers run once the step is whole, as CPython runs them:
    repeats merge, and where one handler raises (SIGINT's KeyboardInterrupt) the other
    stays pending and runs at the next chance; the step's result is the uninterrupted
    one's."""
    params = make_params([torch.bfloat16] * 3, SHAPES, seed=4)
    ref, opt, ref_opt = _stepped_reference(params)

    def signals(call):
        signal.raise_signal(signal.SIGTERM)
        if call == 2:
            signal.raise_signal(signal.SIGINT)
        assert not sigterm_handler  # held while the step runs

    _calls_to_run(monkeypatch, signals)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    for _ in range(3):  # chances for the pending handler to run
        pass
    assert sigterm_handler == [signal.SIGTERM]
    _assert_same(params, ref, opt, ref_opt, "after the signalled step")


def test_a_conversion_interrupted_by_ctrl_c_completes(backend, monkeypatch):
    """A step that converts state first (a setting changed, S1.5) holds Ctrl-C from
    the conversion on: the state is converted and stepped whole, as without it."""
    from shardadam import _state

    params = make_params([torch.bfloat16] * 3, SHAPES, seed=9)
    ref, opt, ref_opt = _stepped_reference(
        params, change=lambda o: setattr(o, "exp_avg_dtype", torch.uint8))
    apply_entry, applied = _state.apply_entry, []

    def interrupted(*args, **kwargs):
        applied.append(args)
        if len(applied) == 1:
            signal.raise_signal(signal.SIGINT)
        return apply_entry(*args, **kwargs)

    monkeypatch.setattr(_state, "apply_entry", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert len(applied) == 3
    _assert_same(params, ref, opt, ref_opt, "after an interrupted conversion")


class _FailingSignal:
    """``_signal`` whose ``signal`` raises at the given calls, as CPython's does when a
    pending handler raises before the handler is replaced, and whose ``pthread_kill``
    raises where ``kill_fails`` (after sending, as a pending handler would)."""

    def __init__(self, real, fail_at, kill_fails=False):
        self.real, self.fail_at, self.calls, self.kill_fails = real, fail_at, 0, kill_fails

    def __getattr__(self, name):
        return getattr(self.real, name)

    def signal(self, signum, handler):
        self.calls += 1
        if self.calls in self.fail_at:
            raise RuntimeError(f"a pending handler raised (call {self.calls})")
        return self.real.signal(signum, handler)

    def pthread_kill(self, thread, signum):
        self.real.pthread_kill(thread, signum)
        if self.kill_fails:
            raise RuntimeError("a pending handler raised in pthread_kill")


@pytest.mark.parametrize("fail_at", [{2}, {3}, {3, 4}], ids=["entering", "leaving",
                                                             "leaving-twice"])
def test_handlers_are_put_back_when_a_pending_handler_raises(monkeypatch, fail_at,
                                                             sigterm_handler):
    """Holding SIGINT and SIGTERM replaces two handlers (calls 1, 2) and puts them back
    (calls 3, 4 and on): an exception from a pending handler in any of those calls is
    raised, with every handler back in place, and a signal caught while they were held
    still reaches its handler."""
    from shardadam import _held_signals

    fake = _FailingSignal(_held_signals._signal, fail_at)
    monkeypatch.setattr(_held_signals, "_signal", fake)
    entered = 2 not in fail_at  # entering refused: the body never runs
    with pytest.raises(RuntimeError, match="pending handler raised"):
        with _held_signals.held():
            signal.raise_signal(signal.SIGTERM)
            assert sigterm_handler == [], "delivered while held"
    assert sigterm_handler == [signal.SIGTERM] * entered, "the held SIGTERM was dropped"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_handler == [signal.SIGTERM] * (entered + 1)


def test_raising_a_held_signal_again_leaves_the_mask_as_it_was(monkeypatch,
                                                                sigterm_handler):
    """Held signals left pending by a handler that raised (SIGINT's, before SIGTERM's)
    are raised again blocked, then unblocked: a pending handler that raises meanwhile
    leaves the main thread's signal mask as it was, and the signal still reaches its
    handler."""
    from shardadam import _held_signals

    fake = _FailingSignal(_held_signals._signal, (), kill_fails=True)
    monkeypatch.setattr(_held_signals, "_signal", fake)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with pytest.raises(RuntimeError, match="pthread_kill"):
        with _held_signals.held():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
    assert sigterm_handler == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_held_by_a_step_reaches_the_wakeup_fd_once(monkeypatch, sigterm_handler):
    """A held signal's handler is called, not raised as a signal again: CPython writes
    to ``signal.set_wakeup_fd``'s file at each delivery, and asyncio's
    ``add_signal_handler`` runs its callback once per byte (it ran three times)."""
    import os

    params = make_params([torch.bfloat16] * 3, SHAPES, seed=5)
    opt = fused_adam()(_two_groups(params), **SETTINGS)
    attach_grads(params, _grads(params), False)
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write)
    try:
        _calls_to_run(monkeypatch, lambda call: os.kill(os.getpid(), signal.SIGTERM)
                      if call == 1 else None)
        opt.step()
        written = os.read(read, 64)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
    assert sigterm_handler == [signal.SIGTERM]
    assert list(written) == [signal.SIGTERM]


def _cut_short(monkeypatch, module, name):
    """``module.<name>`` raising ``_Cut`` on its next call, as a handler of another
    signal (a SIGALRM timeout) raising at that bytecode would."""
    real = getattr(module, name)

    def cut(*args, **kwargs):
        monkeypatch.setattr(module, name, real)
        raise _Cut(name)

    monkeypatch.setattr(module, name, cut)


class _Cut(Exception):
    pass


@pytest.mark.parametrize("where", ["collector-switched-off", "collector-exit",
                                   "hold-exit"])
def test_a_step_cut_short_by_another_signals_handler_is_undone(monkeypatch, where,
                                                               sigterm_handler):
    """A handler of another signal that raises can cut a step short at any bytecode,
    also where it switches the collector off or undoes its hold: the collector is on
    again by the next step, and a hold left open hands SIGTERM on at its next signal
    (the collector stayed off for good, SIGINT and SIGTERM were swallowed)."""
    import gc

    from shardadam import _collector, _held_signals

    params = make_params([torch.bfloat16] * 3, SHAPES, seed=6)
    opt = fused_adam()(_two_groups(params), **SETTINGS)
    attach_grads(params, _grads(params), False)
    if where == "collector-switched-off":
        real = _collector._disable

        def disable_then_cut():
            real()
            monkeypatch.setattr(_collector, "_disable", real)
            raise _Cut("after the switch")
        monkeypatch.setattr(_collector, "_disable", disable_then_cut)
    elif where == "collector-exit":
        _cut_short(monkeypatch, _collector.paused, "_undo")
    else:
        _cut_short(monkeypatch, _held_signals.held, "_close")
    assert gc.isenabled()
    with pytest.raises(_Cut):
        opt.step()
    if where == "hold-exit":
        signal.raise_signal(signal.SIGTERM)  # its recorder, left open, hands it on
        assert sigterm_handler == [signal.SIGTERM]
        assert getattr(signal.getsignal(signal.SIGTERM), "__self__", None) is None
    opt.step()
    assert gc.isenabled()
    assert not _collector._LIVE and not _held_signals._LIVE
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_handler[-1] == signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_a_child_forked_by_another_thread_during_a_step_is_not_held(monkeypatch,
                                                                    sigterm_handler):
    """A child forked by another thread while the main thread is inside a step has
    only the forking thread, whose step never ends there: its collector is on and its
    handlers are in place (it had an open hold and the collector off for good)."""
    import gc
    import os
    import threading

    params = make_params([torch.bfloat16] * 3, SHAPES, seed=8)
    opt = fused_adam()(_two_groups(params), **SETTINGS)
    attach_grads(params, _grads(params), False)
    inside, forked, seen = threading.Event(), threading.Event(), {}
    _calls_to_run(monkeypatch, lambda call: (inside.set(), forked.wait(30))
                  if call == 1 else None)

    def fork():
        inside.wait(30)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                handler = signal.getsignal(signal.SIGTERM)
                held = type(getattr(handler, "__self__", None)).__name__ == "held"
                os.write(write, bytes([gc.isenabled(), held]))
            finally:
                os._exit(0)
        os.close(write)
        forked.set()
        seen["child"] = os.read(read, 2)
        os.close(read)
        os.waitpid(pid, 0)

    thread = threading.Thread(target=fork)
    thread.start()
    opt.step()
    thread.join(60)
    assert seen["child"] == bytes([True, False])


def test_a_child_forked_while_another_thread_steps_refuses_the_cut_state(monkeypatch):
    """The child's copy of the optimizer was cut inside its step (here: between its two
    groups): step(), state_dict() and a copy refuse it by name, not as "another step runs"
    (the lock's holder does not exist there), until load_state_dict makes it whole; the
    parent's step goes on and ends as usual."""
    import os
    import threading

    params = make_params([torch.bfloat16] * 3, SHAPES, seed=8)
    opt = fused_adam()(_two_groups(params), **SETTINGS)
    attach_grads(params, _grads(params), False)
    saved = copy.deepcopy(opt.state_dict())  # its fp32 states are the live tensors
    inside, forked, seen = threading.Event(), threading.Event(), {}
    _calls_to_run(monkeypatch, lambda call: (inside.set(), forked.wait(30))
                  if call == 2 else None)

    def step():
        opt.step()
        seen["parent"] = [g["step"] for g in opt.param_groups]

    thread = threading.Thread(target=step)
    thread.start()
    assert inside.wait(30)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            torch.set_num_threads(1)  # the parent's OpenMP threads are not here
            outcomes = []
            for call in (opt.step, opt.state_dict, lambda: copy.deepcopy(opt),
                         lambda: opt.load_state_dict(saved), opt.step):
                try:
                    call()
                    outcomes.append(0)
                except RuntimeError as error:
                    outcomes.append(1 if "forked while another thread was inside step()"
                                    in str(error) and "S3.1" in str(error) else 2)
                except BaseException:
                    outcomes.append(3)
            outcomes += [g["step"] for g in opt.param_groups]
            os.write(write, bytes(outcomes))
        finally:
            os._exit(0)
    os.close(write)
    forked.set()
    ready, _, _ = select.select([read], [], [], 120)
    child = os.read(read, 16) if ready else b"no answer"
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.close(read)
    os.waitpid(pid, 0)
    thread.join(60)
    assert child == bytes([1, 1, 1, 0, 0, 1, 1]), list(child)
    assert seen["parent"] == [1, 1]


@pytest.mark.parametrize("where", ["acquired", "working", "done"])
def test_a_fork_frees_a_lock_another_thread_holds_and_marks_only_cut_work(where):
    """Wherever the other thread was between taking the lock and giving it back (a fork
    may come between any two bytecodes): the child's lock is free, and torn only where
    that thread's step had begun its work and not ended it."""
    from shardadam import _step_lock

    lock = _step_lock.StepLock()
    taken, done = threading.Event(), threading.Event()

    def hold():
        with lock._lock:  # as held() does, stopped at the chosen point
            if where != "acquired":
                lock._owner, lock._working = threading.get_ident(), where == "working"
            taken.set()
            done.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(30)
    try:
        _step_lock._free_in_child()  # as the fork's child runs it, in this thread
        assert not lock.busy()
        assert lock.torn == (where == "working")
        with lock.held():  # the child's own steps take it as usual
            assert lock.busy()
    finally:
        done.set()
        thread.join(30)


def test_a_recorder_left_in_place_hands_its_signal_on(sigterm_handler):
    """A handler that raises can cut ``__exit__`` short between two put-backs (Python
    code stops at any bytecode): a recorder left so puts its handler back at the next
    signal and that handler gets it; the next hold takes the left recorder's handler
    as the one in place, and a hold inside a hold leaves the outer one's recorders."""
    from shardadam import _held_signals

    left = _held_signals.held()
    left.__enter__()
    left._open = False  # as if __exit__ stopped before its put-backs
    with _held_signals.held():
        with _held_signals.held():
            signal.raise_signal(signal.SIGTERM)
        assert sigterm_handler == []  # the outer hold still holds it
    assert sigterm_handler == [signal.SIGTERM]
    left.__enter__()
    left._open = False
    signal.raise_signal(signal.SIGTERM)
    assert sigterm_handler == [signal.SIGTERM] * 2
    assert signal.getsignal(signal.SIGTERM) is not None
    assert getattr(signal.getsignal(signal.SIGTERM), "__self__", None) is not left
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)  # SIGINT's recorder hands on to Python's
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_failed_reseed_keeps_the_masters_following(backend, monkeypatch):
    """S1.6 with S3.1: an error while the first step re-seeds the masters of weights
    loaded after construction leaves every master following (the re-seeded ones hold
    the loaded values; the failed one keeps its mark), so the next step trains from
    the loaded weights, as a step that never failed."""
    from shardadam import FusedAdam

    params = make_params([torch.bfloat16] * 3, SHAPES, seed=5)
    opt = fused_adam()(params, **SETTINGS)
    gen = torch.Generator().manual_seed(6)
    for p in params:  # a model-only load after the optimizer was built
        p.data.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref_opt = fused_adam()(ref, **SETTINGS)
    attach_grads(params, _grads(params), False)
    attach_grads(ref, _grads(ref), False)
    ref_opt.step()
    reseed, calls = FusedAdam._reseed_master, []

    def failing(self, param):
        calls.append(param)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return reseed(self, param)

    monkeypatch.setattr(FusedAdam, "_reseed_master", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        opt.step()
    monkeypatch.setattr(FusedAdam, "_reseed_master", reseed)
    opt.step()
    _assert_same(params, ref, opt, ref_opt, "after a failed first step and a retry")


def test_a_failed_call_after_the_reseed_keeps_the_masters_following(backend, monkeypatch):
    """S1.6 with S3.1: a first step whose call fails after the masters were re-seeded
    (out of memory in the call, a signal handler raising there) leaves them following,
    so weights loaded into the model after it are what the next step starts from, as
    a fresh optimizer's first step from those weights."""
    from shardadam import _backend

    params = make_params([torch.bfloat16] * 3, SHAPES, seed=7)
    opt = fused_adam()(params, **SETTINGS)
    attach_grads(params, _grads(params), False)
    run = _backend.run

    def failing(item, hyper):
        raise MemoryError("out of memory in the call (simulated)")

    monkeypatch.setattr(_backend, "run", failing)
    with pytest.raises(MemoryError, match="simulated"):
        opt.step()
    monkeypatch.setattr(_backend, "run", run)
    gen = torch.Generator().manual_seed(8)
    for p in params:  # a model-only load after the failed step
        p.data.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref_opt = fused_adam()(ref, **SETTINGS)
    attach_grads(ref, _grads(ref), False)
    ref_opt.step()
    opt.step()
    _assert_same(params, ref, opt, ref_opt, "after a failed call and loaded weights")


def test_inference_tensors_step_under_inference_mode(backend):
    """A model and optimizer made and stepped under ``torch.inference_mode`` (inference
    tensors as parameters) step there, on every path; the state is normal tensors."""
    with torch.inference_mode():
        params = [torch.nn.Parameter(p) for p in make_params([torch.bfloat16] * 3, SHAPES,
                                                              seed=10)]
        opt = fused_adam()(params, **SETTINGS)
        attach_grads(params, _grads(params), False)
        opt.step()
        assert opt.param_groups[0]["step"] == 1
    assert not any(t.is_inference() for t in opt.state[params[0]].values()
                   if isinstance(t, torch.Tensor))


def test_inference_tensors_are_refused_outside_inference_mode(backend):
    """An inference tensor parameter stepped outside ``torch.inference_mode`` (which
    torch forbids for in-place updates) is refused before anything changes (S3.1), on
    every path, naming the parameter; stepped back under the mode it steps."""
    with torch.inference_mode():
        params = [torch.nn.Parameter(p) for p in make_params([torch.float32] * 2,
                                                              SHAPES[:2], seed=11)]
    opt = fused_adam()(params, lr=1e-2)
    attach_grads(params, _grads(params), False)
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match=r"group 0, param 0.*inference tensor.*S1\.4"):
        opt.step()
    for p, old in zip(params, before):
        assert_bitwise_equal(p.detach(), old, "param after the refusal")
    assert not opt.state[params[0]]["exp_avg"].any()
    assert opt.param_groups[0]["step"] == 0
    with torch.inference_mode():
        opt.step()
    assert opt.param_groups[0]["step"] == 1


@pytest.mark.parametrize("settings", [
    dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16,
         exp_avg_sq_dtype=torch.bfloat16),
    dict(master_weight_dtype=torch.float16, exp_avg_dtype=torch.uint8,
         exp_avg_sq_dtype=torch.uint8),
    dict(store_param_remainders=True, moment_format="block8"),
], ids=["remainders", "fp16-master-fp8", "block8"])
def test_state_made_under_inference_mode_steps_outside_it(backend, settings):
    """State exists from construction (S1.6): an optimizer built, extended or loaded
    under ``torch.inference_mode`` makes normal tensors, which later steps update."""
    params = make_params([torch.bfloat16] * 3, SHAPES, seed=8)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kwargs = {**SETTINGS, **settings}
    with torch.inference_mode():
        opt = fused_adam()(params[:2], **kwargs)
        opt.add_param_group(dict(params=params[2:]))
    ref_opt = fused_adam()(ref[:2], **kwargs)
    ref_opt.add_param_group(dict(params=ref[2:]))
    for _ in range(2):
        attach_grads(params, _grads(params), False)
        attach_grads(ref, _grads(ref), False)
        opt.step()
        ref_opt.step()
    _assert_same(params, ref, opt, ref_opt, "built under inference_mode")
    with torch.inference_mode():
        opt.load_state_dict(ref_opt.state_dict())
        opt.initialize_state(params[0])
        opt.state[params[1]].clear()  # set_scaled_state makes the entry again
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            opt.set_scaled_state(params[1], name, ref_opt.get_unscaled_state(ref[1], name))
    ref_opt.initialize_state(ref[0])
    attach_grads(params, _grads(params), False)
    attach_grads(ref, _grads(ref), False)
    opt.step()
    ref_opt.step()
    _assert_same(params, ref, opt, ref_opt, "loaded under inference_mode")
