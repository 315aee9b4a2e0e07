"""block8 (and block4) moments under FSDP2 (S2.11, S2.12), as run on every rank
(dispatched from ``_dist_jobs.KINDS``).

``block8_dcp_save``: weights whose row length is a multiple of the block size, sharded
by ``fully_shard`` over 2 ranks, take two steps on gradients built from full tensors
(the same at every world size), and are saved with DCP. ``block8_dcp_resume``: loaded
into a fresh model at 3, 4 (rank 3's shard of the 6-row weight empty) or 1 rank, two more
steps; the gathered parameters, codes and
scales are bitwise those of one process stepping the full tensors four times without
stopping (the mesh rule: blocks keyed to the global flat index never cross a shard
boundary of whole rows, so the shards store what the whole tensor stores).
``block4_uneven_rows``: block4 on a cut that is not torch's chunks (f = 0), whose
random bits are keyed to the local index (S2.11, S2.13). ``block_meta_init``: the
optimizer built before ``to_empty`` (README).
"""

import operator
import os
from copy import deepcopy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import distribute_tensor

import _dist_cases
from _dist_helpers import (assert_bitwise, full_grad, fused_adam, gather, raw_state, seed_of,
                           symmetric)
from _optimizer_testing import block8_decode, fp8_block_oracle, ufp8_block_oracle
from shardadam import _codecs, _formats

BLOCK = 128
SHAPES = {"0.weight": (6, 2 * BLOCK), "1.weight": (12, BLOCK)}  # whole blocks per row
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
             moment_format="block8", moment_block_size=BLOCK)
# case preset -> (parameter dtype, constructor keywords)
PRESETS = {"p=fp32-m=block8": (torch.float32, {}),
           "p=bf16-master=remainder-m=block8": (
               torch.bfloat16, dict(master_weights=True, store_param_remainders=True)),
           # block4 (S2.12): codes packed along the rows, DTensors of the packed shape.
           "p=bf16-master=remainder-m=block4": (
               torch.bfloat16, dict(master_weights=True, store_param_remainders=True,
                                    moment_format="block4")),
           # No master: the parameters rounded stochastically (S2.14), their bits keyed
           # to the global flat index like the blocks.
           "p=bf16-sr-m=block4": (
               torch.bfloat16, dict(param_rounding="stochastic", moment_format="block4"))}


def _model(ctx, dtype, seed, shard=True):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2 * BLOCK, 6, bias=False),
                          nn.Linear(BLOCK, 12, bias=False)).to(dtype)
    if shard:
        fully_shard(model, mesh=ctx.mesh())
    return model


def _optimizer(model, preset):
    dtype, extra = PRESETS[preset]
    return fused_adam()(list(model.parameters()), **{**HYPER, **extra})


def _set_grads(model, preset, step, sharded):
    dtype = PRESETS[preset][0]
    for name, p in model.named_parameters():
        full = full_grad(SHAPES[name], seed_of("block8", name, step), dtype)
        # Each rank takes its own chunk: no communication.
        p.grad = (distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                  if sharded else full)


def _init_seed(preset):
    return seed_of("block8-init", preset)


def block8_dcp_save(ctx, case):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model(ctx, PRESETS[case.preset][0], _init_seed(case.preset))
    opt = _optimizer(model, case.preset)
    for step in (1, 2):
        _set_grads(model, case.preset, step, sharded=True)
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    path = _dist_cases.checkpoint_dir(ctx.params["shared_dir"], "block8", case.preset, 2)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dist.barrier()


def _gathered(model, opt):
    """Full parameters, codes and (concatenated in rank order) scales by name."""
    out = {}
    for name, p in model.named_parameters():
        entry = {"param": gather(p.detach())}
        for state in ("exp_avg", "exp_avg_sq"):
            entry[state] = gather(opt.state[p][state])
            scales = [None] * dist.get_world_size()
            dist.all_gather_object(scales, opt._scales[p][state])
            entry[state + "_scale"] = torch.cat(scales)
        out[name] = entry
    return out


def block8_dcp_resume(ctx, case):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = _dist_cases.checkpoint_dir(ctx.params["shared_dir"], "block8", case.preset, 2)
    assert os.path.isdir(path), f"no checkpoint at {path}: its save case failed or did not run"
    dtype = PRESETS[case.preset][0]
    model = _model(ctx, dtype, seed_of(case.id))  # other weights: the load must win
    opt = _optimizer(model, case.preset)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for step in (3, 4):
        _set_grads(model, case.preset, step, sharded=True)
        opt.step()
    got = _gathered(model, opt)

    # The run that never stopped: one process, full tensors, four steps.
    ref = _model(ctx, dtype, _init_seed(case.preset), shard=False)
    ref_opt = _optimizer(ref, case.preset)
    for step in (1, 2, 3, 4):
        _set_grads(ref, case.preset, step, sharded=False)
        ref_opt.step()

    def same():
        assert [g["step"] for g in opt.param_groups] == [4]
        for name, p in ref.named_parameters():
            want = {"param": p.detach()}
            for state in ("exp_avg", "exp_avg_sq"):
                want[state] = ref_opt.state[p][state]
                want[state + "_scale"] = ref_opt._scales[p][state]
            for key, value in want.items():
                assert_bitwise(got[name][key], value, f"{name} {key} after 2 + 2 steps")

    symmetric(same)


def block8_mesh_rule(ctx, case):
    """S2.11's mesh rule on rows that are not whole blocks (96 elements, B = 128), one
    step from zero moments: under Shard(0), also beside HSDP's Replicate on a 2 x 2 mesh,
    the blocks are keyed to the global flat index (f = row offset x row length; a
    Replicate alone holds the whole tensor, f = 0), under Shard(1) and _StridedShard(0)
    to the local one (f = 0); rows cut 5/3/1 (not torch's 3/3/3 chunks) marked with Megatron
    FSDP's ``megatron_fsdp_slice`` of the whole parameter (``orig_param``) at their true
    offset, and the same rows marked with a slice that is not their run, or with one of a
    tensor-parallel part (an ``orig_param`` of half the rows), both keyed as if unmarked
    (rank 1's (3, 96) rows have the shape of torch's chunk there, so torch's offset; the
    others 0);
    the stored codes and scales of both moments are exactly S2.9's and S2.10's at that
    f, worked out in the test, and get_unscaled_state decodes them at the same f. A
    detail ending in "+block4" asks block4 of a layout that cannot pack its rows
    (Shard on the last dimension): it holds block8's formats (S2.11, S2.12)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    shape, rows = (9, 96), 9 // ctx.world_size
    # The rows-5-3-1 layouts (world size 3): this rank's rows, and the f of rows keyed as
    # if unmarked (rank 1's (3, 96) rows have the shape of torch's chunk there).
    cut, unmarked = None, None
    if ctx.world_size == 3:
        cut, unmarked = slice(*((0, 5), (5, 8), (8, 9))[ctx.rank]), (0, 3 * 96, 0)[ctx.rank]
    layouts = {"Shard(0)": ([Shard(0)], ctx.rank * rows * 96),
               "Shard(1)": ([Shard(1)], 0), "Replicate": ([Replicate()], 0),
               # FSDP2 beside tensor parallelism on a 2 x 2 mesh, 10 rows: the dp
               # placement equals Shard(0), but a rank's rows are not torch's chunk's
               # run (rank 1 holds rows 6, 7 where the chunk offset says 5)
               "_StridedShard(0)": ([_StridedShard(0, split_factor=2), Shard(0)], 0),
               # HSDP on a 2 x 2 mesh, 6 rows: replicas of torch's 3-row chunks, keyed
               # at the chunk's offset (the replicate dimension adds none), 288: not a
               # multiple of the block
               "HSDP-(Replicate,Shard(0))": ([Replicate(), Shard(0)], None),
               "rows-5-3-1+megatron_fsdp_slice": ([Shard(0)], cut and cut.start * 96),
               "rows-5-3-1+slice-off-the-rows": ([Shard(0)], unmarked),
               "rows-5-3-1+slice-of-a-tp-part": ([Shard(0)], unmarked)}
    detail, family = case.detail, "block8"
    if detail.endswith("+block4"):
        detail, family = detail[:-len("+block4")], "block4"
    placements, first = layouts[detail]
    mesh = ctx.mesh()
    if detail == "_StridedShard(0)":
        from torch.distributed.device_mesh import init_device_mesh

        shape, mesh = (10, 96), init_device_mesh("cpu", (2, 2))
    if detail.startswith("HSDP"):
        from torch.distributed.device_mesh import init_device_mesh

        shape, mesh = (6, 96), init_device_mesh("cpu", (2, 2))
        first = mesh.get_coordinate()[1] * 3 * 96
    full = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    g = full_grad(shape, seed_of("block8-mesh"), torch.float32)
    if detail.startswith("rows-5-3-1"):
        def sharded(t):
            return DTensor.from_local(t[cut].clone(), mesh, placements, shape=t.shape,
                                      stride=t.stride(), run_check=False)

        p = nn.Parameter(sharded(full))
        # The flat range of orig_param Megatron FSDP marks a parameter with, one half a
        # row off, or one whose orig_param is a tensor-parallel part of the parameter.
        off = 48 if detail.endswith("slice-off-the-rows") else 0
        p.megatron_fsdp_slice = slice(cut.start * 96 + off, cut.stop * 96 + off)
        p.orig_param = full[:5] if detail.endswith("tp-part") else full
        p_grad = sharded(g)
    else:
        p = nn.Parameter(distribute_tensor(full, mesh, placements, src_data_rank=None))
        p_grad = distribute_tensor(g, mesh, placements, src_data_rank=None)
    opt = fused_adam()([p], lr=1e-3, betas=(0.9, 0.95), moment_format=family,
                       moment_block_size=BLOCK)
    p.grad = p_grad
    opt.step()
    local_g = p.grad.to_local()

    def check():
        # S2.9 / S2.10 worked out in the test: blocks keyed from f, float64 scales; the
        # moments from zero are the core's fp32 constants times g (S3.6). exp_avg_sq is
        # rounded stochastically (S2.13) with the bits of flat indices from f (the
        # parameter's rounding_key 0, step 1): the codec's codes, the rule's scales or,
        # for a canonical block, half of them.
        for name, want, oracle, fmt in (
                ("exp_avg", torch.tensor(1 - 0.9) * local_g, fp8_block_oracle, "fp8-block"),
                ("exp_avg_sq", (torch.tensor(1 - 0.95) * local_g) * local_g,
                 ufp8_block_oracle, "ufp8-block")):
            assert opt._formats[p][name].name == fmt, (case.detail, name)
            codes, scales = oracle(want.reshape(-1), first, BLOCK)
            if name == "exp_avg_sq":
                f = _formats.UFP8_BLOCK
                rule = scales
                codes, scales = _codecs.encode_blocks(f.name, want.reshape(-1), first, BLOCK,
                                                      f.scale_target, f.zero_bound,
                                                      _codecs.square_step_key(0, 1))
                assert bool(((scales == rule) | (scales == rule / 2)).all()), case.detail
            got = opt.state[p][name].to_local()
            assert_bitwise(got.reshape(-1), codes, f"{case.detail}: {name} codes at f={first}")
            assert_bitwise(opt._scales[p][name], scales, f"{case.detail}: {name} scales")
            decoded = block8_decode(codes, scales, first, BLOCK, unsigned=name == "exp_avg_sq")
            assert_bitwise(opt.get_unscaled_state(p, name).reshape(-1), decoded,
                           f"{case.detail}: {name} get_unscaled_state")

    symmetric(check)


def block4_uneven_rows(ctx, case):
    """S2.11 / S2.13 on an f = 0 layout: a (10, 128) weight cut 6/4 over 2 ranks as
    Megatron FSDP cuts rows (not torch's 5/5 chunks, so both ranks key at f = 0), block4.
    Each rank's codes, scales and parameters are every step bitwise those of a plain
    FusedAdam over its local rows (keyed locally); rank 0, whose rows start at 0, stores
    what the whole tensor stored in one process stores, rank 1 does not (its random bits
    are keyed to local indices); a state_dict saved after two steps and loaded into a
    fresh optimizer over the same cut continues bitwise like the run that never stopped."""
    from torch.distributed.tensor import DTensor, Shard

    shape, cut = (10, BLOCK), (6, 4)
    start = sum(cut[:ctx.rank])
    rows = slice(start, start + cut[ctx.rank])
    kwargs = dict(HYPER, moment_format="block4")
    full = torch.randn(shape, generator=torch.Generator().manual_seed(3))

    def sharded():
        local = full[rows].clone()
        return nn.Parameter(DTensor.from_local(local, ctx.mesh(), [Shard(0)], shape=full.shape,
                                               stride=full.stride(), run_check=False))

    def step(opts, params, k):
        """Step k's gradient (full, the same on every rank), to each parameter's rows."""
        g = full_grad(shape, seed_of("block4-uneven", k), torch.float32)
        for opt, p in zip(opts, params):
            if isinstance(p, DTensor):
                p.grad = DTensor.from_local(g[rows].clone(), ctx.mesh(), [Shard(0)],
                                            shape=g.shape, stride=g.stride(), run_check=False)
            else:
                p.grad = g.clone() if p.shape == g.shape else g[rows].clone()
            opt.step()

    def stored(opt, p):
        def local(t):
            return (t.to_local() if isinstance(t, DTensor) else t).detach().reshape(-1)

        out = {"param": local(p)}
        for name in ("exp_avg", "exp_avg_sq"):
            out[name] = local(opt.state[p][name])
            out[name + "_scale"] = opt._scales[p][name]
        return out

    p = sharded()
    opt = fused_adam()([p], **kwargs)
    local = nn.Parameter(full[rows].clone())
    local_opt = fused_adam()([local], **kwargs)
    whole = nn.Parameter(full.clone())
    whole_opt = fused_adam()([whole], **kwargs)
    row_bytes = BLOCK // 2  # two 4-bit codes a byte
    saved = None
    for k in (1, 2, 3, 4):
        step((opt, local_opt, whole_opt), (p, local, whole), k)
        mine, ref, all_rows = stored(opt, p), stored(local_opt, local), stored(whole_opt, whole)

        def check():
            for key in mine:
                assert_bitwise(mine[key], ref[key], f"step {k}: {key} against the local rows")
            codes = all_rows["exp_avg"][start * row_bytes:(start + cut[ctx.rank]) * row_bytes]
            same = torch.equal(mine["exp_avg"], codes)
            assert same == (ctx.rank == 0), \
                f"step {k}: rank {ctx.rank}'s exp_avg codes equal to the whole tensor's: {same}"

        symmetric(check)
        if k == 2:
            saved = deepcopy(opt.state_dict())
            resumed_p = sharded()
            with torch.no_grad():
                resumed_p.to_local().copy_(p.to_local())
            resumed = fused_adam()([resumed_p], **kwargs)
            resumed.load_state_dict(saved)
        if k > 2:
            step((resumed,), (resumed_p,), k)
            again = stored(resumed, resumed_p)
            symmetric(lambda: [assert_bitwise(again[key], mine[key],
                                              f"step {k} after the resume: {key}")
                               for key in mine])


def torch_path_pieces(ctx, case):
    """The pure-torch path (S7.2) in pieces of 384 elements (3 blocks) steps FSDP2's
    shards bitwise as the C++ core: parameters, master, codes and scales, three steps.
    Each rank's rows start at f = 512 · rank, so its pieces, cut at multiples of 384 of
    the global flat index, do not start where its shard does (rank 1's first piece is
    256 elements, rank 2's 128)."""
    from shardadam import _backend, _torch_path

    dtype = PRESETS[case.preset][0]
    models = [_model(ctx, dtype, _init_seed(case.preset)) for _ in range(2)]
    core, torch_path = (_optimizer(model, case.preset) for model in models)
    piece = _torch_path.PIECE_CPU
    for step in (1, 2, 3):
        for model in models:
            _set_grads(model, case.preset, step, sharded=True)
        core.step()
        _torch_path.PIECE_CPU = 3 * BLOCK
        try:
            with _backend.use_backend("torch"):
                torch_path.step()
        finally:
            _torch_path.PIECE_CPU = piece

        def check():
            for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
                what = f"step {step}, {name}"
                assert_bitwise(q.to_local().detach(), p.to_local().detach(), f"{what}: param")
                for state, value in core.state[p].items():
                    assert_bitwise(torch_path.state[q][state].to_local(), value.to_local(),
                                   f"{what}: {state}")
                for state, scale in core._scales[p].items():
                    assert_bitwise(torch_path._scales[q][state], scale,
                                   f"{what}: {state} scales")

        symmetric(check)


def block_meta_init(ctx, case):
    """The README's meta-device path: an optimizer built over an FSDP2 model on the meta
    device, before ``to_empty``. ``to_empty`` swaps each DTensor parameter in place
    (``torch.utils.swap_tensors``, which refuses a tensor anything holds a weak reference
    to: the optimizer holds none); the first step refuses, naming ``initialize_state``,
    and changes no parameter; after ``initialize_state`` every step is bitwise that of an
    optimizer built over the materialised model (parameters, codes and scales)."""
    dtype = PRESETS[case.preset][0]
    twin = _model(ctx, dtype, _init_seed(case.preset))
    with torch.device("meta"):
        model = _model(ctx, dtype, _init_seed(case.preset))
    opt = _optimizer(model, case.preset)
    params = list(model.parameters())
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p, q in zip(params, twin.parameters()):
            p.to_local().copy_(q.to_local())

    def materialised_in_place():
        held = opt.param_groups[0]["params"]
        assert all(map(operator.is_, params, model.parameters())), \
            "to_empty replaced the parameter objects instead of swapping them in place"
        assert all(map(operator.is_, params, held)) and len(held) == len(params)
        assert not any(p.to_local().is_meta for p in params)
    symmetric(materialised_in_place)

    _set_grads(model, case.preset, 1, sharded=True)
    before = [p.to_local().clone() for p in params]
    try:
        opt.step()
        refused = None
    except RuntimeError as error:
        refused = str(error)

    def first_step_refused():
        assert refused is not None, "a step over meta state was taken"
        for fact in ("group 0, param 0", "meta", "initialize_state"):
            assert fact in refused, f"the refusal does not say {fact!r}: {refused}"
        for p, b in zip(params, before):
            assert_bitwise(p.to_local(), b, "a parameter after the refused step")
        assert opt.param_groups[0]["step"] == 0, "the refused step was counted"
    symmetric(first_step_refused)

    for p in params:
        opt.initialize_state(p)
    twin_opt = _optimizer(twin, case.preset)
    for step in (1, 2):
        _set_grads(model, case.preset, step, sharded=True)
        _set_grads(twin, case.preset, step, sharded=True)
        opt.step()
        twin_opt.step()

        def same_as_twin():
            for (name, p), q in zip(model.named_parameters(), twin.parameters()):
                what = f"step {step}: {name}"
                assert_bitwise(p.to_local(), q.to_local(), what)
                raw, twin_raw = raw_state(opt, p), raw_state(twin_opt, q)
                assert sorted(raw) == sorted(twin_raw), f"{what}: state names"
                for k, v in raw.items():
                    assert_bitwise(v, twin_raw[k], f"{what}: raw {k}")
        symmetric(same_as_twin)


KINDS = {"block8_dcp_save": block8_dcp_save, "block8_dcp_resume": block8_dcp_resume,
         "block8_mesh_rule": block8_mesh_rule, "block4_uneven_rows": block4_uneven_rows,
         "torch_path_pieces": torch_path_pieces, "block_meta_init": block_meta_init}
