"""Parameters that are dense but not contiguous (channels_last convolution weights, a
transposed matrix) keep their states in their own memory order (S2.6): the core then
steps every buffer where it lies, with no copy of the parameter or its gradient. These
tests pin that such a parameter steps bitwise as a contiguous twin with the same values
does, on both paths, for every state layout whose elements are independent of their
order; that the layouts keyed to the elements' flat index (per-block moments, stochastic
rounding) keep contiguous states and the copies; and that a step, a checkpoint, a change
of the parameter's strides and a gradient in the parameter's memory are what they are
for contiguous parameters."""

import pytest
import torch

from shardadam import FusedAdam

from _optimizer_testing import backend_context

# Layouts whose update is element by element, with per-tensor scales at most.
IN_PLACE = {
    "fp32": dict(),
    "bf16+fp32-master": dict(master_weights=True),
    "bf16+remainder+bf16-moments": dict(master_weights=True, store_param_remainders=True,
                                        exp_avg_dtype=torch.bfloat16,
                                        exp_avg_sq_dtype=torch.bfloat16),
    "bf16+fp16-master+fp8-moments": dict(master_weights=True,
                                         master_weight_dtype=torch.float16,
                                         exp_avg_dtype=torch.uint8,
                                         exp_avg_sq_dtype=torch.uint8),
}
# Layouts keyed to each element's flat index in the whole parameter.
KEYED = {
    "block8": dict(moment_format="block8", moment_block_size=128),
    "bf16-stochastic": dict(param_rounding="stochastic"),
}
DTYPE = {"fp32": torch.float32}

# (logical shape, how the parameter's memory is laid out)
LAYOUTS = {
    "channels_last": ((8, 4, 3, 3), lambda t: t.contiguous(memory_format=torch.channels_last)),
    "transposed": ((12, 32), lambda t: t.t().contiguous().t()),
    # dense, with a size-1 dimension's stride that torch's is_contiguous ignores and
    # torch.empty_strided (or a DLPack import) may give; not contiguous all the same
    "size-1-dim-strided": ((4, 1, 8), lambda t: torch.empty_strided(
        t.shape, (1, 2, 4), dtype=t.dtype, device=t.device).copy_(t)),
}


def _bits(t):
    return t.detach().contiguous().view(torch.uint8)


def _run(preset: dict, shape, lay_out, grads_laid_out: bool, backend: str, steps=4,
         dtype=torch.float32, device="cpu"):
    """Parameters (laid out by ``lay_out``, or contiguous where it is None) and their
    optimizer after ``steps`` steps of fixed gradients."""
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2)]
    params = [torch.nn.Parameter(lay_out(v) if lay_out else v.clone()) for v in values]
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, **preset)
    with backend_context(backend):
        for _ in range(steps):
            for p in params:
                g = torch.randn(shape, generator=gen).to(dtype).to(device)
                p.grad = lay_out(g) if lay_out and grads_laid_out else g
            opt.step()
    return params, opt


def _assert_same_run(a, b):
    (params_a, opt_a), (params_b, opt_b) = a, b
    for p, q in zip(params_a, params_b):
        assert torch.equal(_bits(p).cpu(), _bits(q).cpu())
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for name in opt_a.state[p]:
            assert torch.equal(_bits(opt_a.state[p][name]).cpu(),
                               _bits(opt_b.state[q][name]).cpu()), name
    for x, y in zip(opt_a.state_dict()["state"].values(),
                    opt_b.state_dict()["state"].values()):
        for name in y:
            assert torch.equal(_bits(x[name]).cpu(), _bits(y[name]).cpu()), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("preset", list(IN_PLACE))
def test_on_cuda_a_dense_parameter_steps_in_place_as_the_cpu_cores_twin(preset):
    """The CUDA kernels store the CPU core's bits (S3.6) for a channels_last parameter
    stepped where it lies too."""
    shape, lay_out = LAYOUTS["channels_last"]
    dtype = torch.float32 if preset == "fp32" else torch.bfloat16
    run = _run(IN_PLACE[preset], shape, lay_out, True, "auto", dtype=dtype, device="cuda")
    twin = _run(IN_PLACE[preset], shape, None, False, "auto", dtype=dtype)
    _assert_same_run(run, twin)
    params, opt = run
    assert all(s.stride() == p.stride() for p in params for s in opt.state[p].values())


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("grads_laid_out", [True, False], ids=["grads-alike", "grads-contig"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("preset", list(IN_PLACE))
def test_a_dense_parameter_steps_in_place_as_its_contiguous_twin(preset, layout,
                                                                grads_laid_out, backend):
    shape, lay_out = LAYOUTS[layout]
    dtype = torch.float32 if preset == "fp32" else torch.bfloat16
    run = _run(IN_PLACE[preset], shape, lay_out, grads_laid_out, backend, dtype=dtype)
    twin = _run(IN_PLACE[preset], shape, None, False, backend, dtype=dtype)
    _assert_same_run(run, twin)
    params, opt = run
    for p in params:
        assert not p.is_contiguous()
        for name, state in opt.state[p].items():
            assert state.stride() == p.stride(), name  # in the parameter's memory order


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("preset", list(KEYED))
def test_layouts_keyed_to_the_flat_index_keep_contiguous_states(preset, backend):
    shape, lay_out = LAYOUTS["channels_last"]
    run = _run(KEYED[preset], shape, lay_out, True, backend, dtype=torch.bfloat16)
    twin = _run(KEYED[preset], shape, None, False, backend, dtype=torch.bfloat16)
    _assert_same_run(run, twin)
    params, opt = run
    for p in params:
        assert all(state.is_contiguous() for state in opt.state[p].values())


def test_stochastic_rounding_leaves_fp32_parameters_in_place():
    """param_rounding="stochastic" rounds bf16 parameters without a master only (S2.14):
    an fp32 parameter's states still follow its memory order."""
    shape, lay_out = LAYOUTS["channels_last"]
    run = _run(KEYED["bf16-stochastic"], shape, lay_out, True, "auto")
    _assert_same_run(run, _run(KEYED["bf16-stochastic"], shape, None, False, "auto"))
    params, opt = run
    assert all(s.stride() == p.stride() for p in params for s in opt.state[p].values())


def _step_alike(a, b, shape, seed, steps=2):
    """Two more steps of both runs with the same bf16 gradients; then they are alike."""
    (params_a, opt_a), (params_b, opt_b) = a, b
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, q in zip(params_a, params_b):
            g = torch.randn(shape, generator=gen).bfloat16()
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    _assert_same_run(a, b)


def test_a_parameter_made_contiguous_between_steps_converts_its_states():
    """Its states move to the new memory order with their values (S1.5's conversion,
    exact), and the run goes on as the twin's."""
    shape, lay_out = LAYOUTS["channels_last"]
    preset = IN_PLACE["bf16+remainder+bf16-moments"]
    params, opt = _run(preset, shape, lay_out, True, "auto", dtype=torch.bfloat16)
    twin_params, twin = _run(preset, shape, None, False, "auto", dtype=torch.bfloat16)
    for p in params:
        p.data = p.data.contiguous()
    _step_alike((params, opt), (twin_params, twin), shape, seed=9)
    assert all(s.is_contiguous() for p in params for s in opt.state[p].values())


@pytest.mark.parametrize("direction", ["into-channels-last", "out-of-channels-last"])
def test_checkpoints_move_between_memory_orders_bitwise(direction):
    """A state dict saved by an optimizer of contiguous parameters loads into one of
    channels_last parameters (and back), and both go on bitwise alike."""
    shape, lay_out = LAYOUTS["channels_last"]
    preset = IN_PLACE["bf16+remainder+bf16-moments"]
    source_layout, target_layout = ((None, lay_out) if direction == "into-channels-last"
                                    else (lay_out, None))
    params, opt = _run(preset, shape, source_layout, True, "auto", dtype=torch.bfloat16)
    loaded = [torch.nn.Parameter(target_layout(p.detach()) if target_layout
                                 else p.detach().contiguous()) for p in params]
    other = FusedAdam(loaded, lr=1e-2, weight_decay=0.1, **preset)
    other.load_state_dict(opt.state_dict())
    _step_alike((params, opt), (loaded, other), shape, seed=11)
    for p in loaded:
        expected = p.stride()
        assert all(s.stride() == expected for s in other.state[p].values())


def test_a_gradient_in_an_in_place_parameters_memory_is_refused():
    shape, lay_out = LAYOUTS["channels_last"]
    params, opt = _run(IN_PLACE["fp32"], shape, lay_out, True, "auto")
    params[1].grad = torch.as_strided(params[0].detach(), shape, params[0].stride())
    params[0].grad = torch.ones_like(params[0])
    before = [_bits(t).clone() for p in params for t in [p, *opt.state[p].values()]]
    with pytest.raises(ValueError, match=r"param 1: grad .* overlaps group 0, param 0's param"):
        opt.step()
    after = [_bits(t) for p in params for t in [p, *opt.state[p].values()]]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def _pair(generator_seed=5):
    gen = torch.Generator().manual_seed(generator_seed)
    shape, lay_out = LAYOUTS["channels_last"]
    a = torch.nn.Parameter(lay_out(torch.randn(shape, generator=gen)))
    b = torch.nn.Parameter(torch.randn(shape, generator=gen))
    return a, b


# Where a's gradient lies, for a channels_last parameter a (b: a contiguous one): read
# where it lies (laid out as a is stepped: a's strides) it is checked against the memory
# the step writes; read through a copy (any other layout) it is not.
GRADIENTS = {
    "a's strides, in b's memory": (True, lambda opt, a, b: torch.as_strided(
        b.detach(), a.shape, a.stride())),
    "a itself": (True, lambda opt, a, b: a.detach()),
    "a's exp_avg": (True, lambda opt, a, b: opt.state[a]["exp_avg"]),
    "contiguous, in a's memory": (False, lambda opt, a, b: torch.as_strided(
        a.detach(), a.shape, b.stride())),
    "contiguous, in b's memory": (False, lambda opt, a, b: b.detach().view(a.shape)),
}


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("where", list(GRADIENTS))
def test_both_paths_read_the_same_gradients_where_they_lie(where, backend):
    """Each path reads a gradient where it lies exactly when it is laid out as its
    parameter is stepped (a channels_last parameter: its own strides), so both refuse
    the same gradients in written memory (nothing changed) and step the others as
    copies of them, bitwise."""
    refused, grad_of = GRADIENTS[where]
    runs = []
    for aliased in (True, False):
        a, b = _pair()
        opt = FusedAdam([a, b], lr=1e-2)
        with backend_context(backend):
            opt.step()  # no gradient yet: binds, steps nothing but the counters
            grad = grad_of(opt, a, b)
            a.grad = grad if aliased else grad.clone()
            b.grad = torch.ones_like(b)
            before = [_bits(t).clone() for p in (a, b) for t in [p, *opt.state[p].values()]]
            if aliased and refused:
                with pytest.raises(ValueError, match="(shares memory|overlaps)"):
                    opt.step()
                after = [_bits(t) for p in (a, b) for t in [p, *opt.state[p].values()]]
                assert all(torch.equal(x, y) for x, y in zip(before, after))
                return
            opt.step()
        runs.append([_bits(t).clone() for p in (a, b) for t in [p, *opt.state[p].values()]])
    assert all(torch.equal(x, y) for x, y in zip(*runs))


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("setting", ["moment_format", "param_rounding"])
def test_a_step_that_would_convert_is_refused_before_converting(setting, backend):
    """A setting changed so that a channels_last parameter's states become contiguous
    (S1.5): the step's check of gradients before it converts state knows the layout it
    converts to, so a contiguous gradient in another parameter's memory (read as it is
    once converted) is refused before anything is converted."""
    a, b = _pair(6)
    a.data, b.data = a.data.bfloat16(), b.data.bfloat16()
    opt = FusedAdam([a, b], lr=1e-2)
    if setting == "moment_format":
        opt.moment_format, opt.moment_block_size = "block8", 128
    else:
        opt.param_rounding = "stochastic"
    a.grad = b.detach().view(a.shape)
    b.grad = torch.ones_like(b)
    before = {name: (t.dtype, t.stride(), _bits(t).clone()) for name, t in opt.state[a].items()}
    with backend_context(backend), pytest.raises(ValueError, match="(shares memory|overlaps)"):
        opt.step()
    assert {name: (t.dtype, t.stride()) for name, t in opt.state[a].items()} == \
        {name: value[:2] for name, value in before.items()}
    assert all(torch.equal(_bits(opt.state[a][name]), value[2])
               for name, value in before.items())
