"""The pure-torch path (S7.2) steps a group piece by piece: its working copies and
temporaries exist for at most ``PIECE_CPU`` elements at a time on CPU (``PIECE_DEVICE``
elsewhere), small tensors sharing a piece and larger ones cut on the whole parameter's
block grid; a per-tensor scale is measured over all of a cut tensor first. Set to 512
elements here, the pieces step bitwise as the C++ core (an independent implementation)
for every state layout; on DTensor shards whose pieces do not start at the shard see
distributed/test_dist_block8.py."""

import types

import pytest
import torch

from _optimizer_testing import (
    assert_same_optimizer_state, attach_grads, backend_context, fused_adam, have_core,
    make_grads)
from shardadam import _codecs, _formats, _torch_path

PIECE = 512
BF16 = torch.bfloat16
# Beside tensors that share a piece: tensors cut in 2 to 6 parts, one of them not a
# multiple of the block sizes, and one of 512 exactly.
SHAPES = [(5,), (33, 7), (12, 256), (3, 1000), (512,), (2, 3, 130), (1, 2048)]
CONFIGS = {
    "p=fp32": (torch.float32, {}),
    "p=bf16-master=fp32": (BF16, dict(master_weights=True)),
    "p=bf16-master=rem-m=bf16": (BF16, dict(master_weights=True, store_param_remainders=True,
                                            exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)),
    # per-tensor scales (S2.3): measured over every piece of a tensor first
    "p=bf16-master=fp32-m=fp8": (BF16, dict(master_weights=True, exp_avg_dtype=torch.uint8,
                                            exp_avg_sq_dtype=torch.uint8)),
    # a scaled master beside fp32 moments, which the measuring pass must read, not update
    "p=fp16-master=fp16": (torch.float16, dict(master_weights=True,
                                               master_weight_dtype=torch.float16)),
    "p=fp16-master=fp16-m=fp16": (torch.float16, dict(
        master_weights=True, master_weight_dtype=torch.float16,
        exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)),
    "p=bf16-master=rem-m=block8": (BF16, dict(master_weights=True, store_param_remainders=True,
                                              moment_format="block8", moment_block_size=128)),
    "p=bf16-master=rem-m=block4": (BF16, dict(master_weights=True, store_param_remainders=True,
                                              moment_format="block4", moment_block_size=256)),
    "p=bf16-sr-m=block8": (BF16, dict(param_rounding="stochastic", moment_format="block8")),
    "p=bf16-sr-m=block4-l2": (BF16, dict(param_rounding="stochastic", moment_format="block4",
                                         adam_w_mode=False)),
}


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(_torch_path, "PIECE_CPU", PIECE)


def _params(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    # Not contiguous: no flat view, so stepped whole (one part of 1,280 elements).
    params.append(torch.nn.Parameter(torch.randn(20, 64, generator=gen).to(dtype).t()))
    return params


def _run(config, backend, steps=3, nan_at=None):
    dtype, kwargs = CONFIGS[config]
    params = _params(dtype, seed=1)
    with backend_context(backend):
        opt = fused_adam()(params, lr=1e-2, weight_decay=0.01, **kwargs)
        for step in range(1, steps + 1):
            grads = make_grads(params, [dtype] * len(params), step, seed=2)
            if nan_at is not None and step == steps:
                grads[nan_at[0]].view(-1)[nan_at[1]] = float("nan")
            attach_grads(params, grads, decoupled=False)
            opt.step()
    return opt, params


@pytest.mark.skipif(not have_core(), reason="needs the C++ core")
@pytest.mark.parametrize("config", CONFIGS)
def test_pieces_step_bitwise_as_the_core(config, small_pieces):
    core, core_params = _run(config, "auto")
    pieces, piece_params = _run(config, "torch")
    assert_same_optimizer_state(core, pieces, core_params, piece_params,
                                f"{config}: C++ core vs torch path in pieces of {PIECE}")


@pytest.mark.skipif(not have_core(), reason="needs the C++ core")
@pytest.mark.parametrize("config", ["p=bf16-master=fp32-m=fp8", "p=fp16-master=fp16-m=fp16"])
def test_nan_in_a_later_piece_reaches_the_per_tensor_scale(config, small_pieces):
    """A NaN new moment in the last part of a cut tensor: its per-tensor scale is the
    NaN maximum's (1, S2.3) in every piece, as in one measurement over the tensor."""
    nan_at = (3, 2900)  # the (3, 1000) tensor: its 6th part
    core, core_params = _run(config, "auto", nan_at=nan_at)
    pieces, piece_params = _run(config, "torch", nan_at=nan_at)
    assert torch.isnan(core_params[nan_at[0]].view(-1)[nan_at[1]])
    assert_same_optimizer_state(core, pieces, core_params, piece_params,
                                f"{config}: a NaN in a later piece")


def test_a_piece_holds_at_most_its_size_and_every_element_once(small_pieces, monkeypatch):
    """S7.2: every piece holds at most PIECE elements, but a parameter with a buffer that
    is not contiguous, stepped whole in a piece of its own; together they hold every
    element once."""
    parts, sizes = [], []
    adam = _torch_path._adam

    def counting(g, w, m, v, k, hyper):
        parts.append([x.numel() for x in g])
        sizes.append(sum(parts[-1]))
        return adam(g, w, m, v, k, hyper)

    monkeypatch.setattr(_torch_path, "_adam", counting)
    _, params = _run("p=fp32", "torch", steps=1)
    contiguous = [p.numel() for p in params if p.is_contiguous()]
    whole = {p.numel() for p in params if not p.is_contiguous()}
    assert whole and max(whole) > PIECE  # so the rule below is tested both ways
    over = [piece for piece in parts if sum(piece) > PIECE]
    assert all(len(piece) == 1 and piece[0] in whole for piece in over), parts
    assert sum(sizes) == sum(p.numel() for p in params), sizes
    assert len(sizes) >= sum(contiguous) // PIECE + 1, sizes  # cut, not one group


def test_parts_are_cut_on_the_whole_parameters_block_grid():
    """A shard whose first element has flat index 300 (not a block boundary), blocks of
    128, pieces of 600 elements: parts of 512 (the largest multiple of 128 up to 600),
    cut at the multiples of 512 of the flat index; each part's scales are the blocks
    its range touches, its codes a view of the shard's."""
    first, numel, block = 300, 2000, 128
    fmt = _formats.FP8_BLOCK.with_block(block)
    count = _codecs.block_count(first, numel, block)
    entry = types.SimpleNamespace(
        numel=numel, first_index=first, scale_block=block, local=torch.zeros(numel),
        master=None, master_scale=None, master_format=None,
        exp_avg=torch.zeros(numel, dtype=torch.uint8), exp_avg_format=fmt,
        exp_avg_scale=torch.arange(count, dtype=torch.float32),
        exp_avg_sq=torch.zeros(numel, dtype=torch.uint8),
        exp_avg_sq_format=_formats.UFP8_BLOCK.with_block(block),
        exp_avg_sq_scale=torch.arange(count, dtype=torch.float32))
    parts = _torch_path._parts(entry, torch.zeros(numel), 600)
    starts = [part.first - first for part in parts]
    assert starts == [0, 212, 724, 1236, 1748], starts
    assert sum(part.numel for part in parts) == numel
    for part in parts:
        lead = part.first // block - first // block
        assert part.exp_avg_scale.tolist() == list(
            range(lead, lead + _codecs.block_count(part.first, part.numel, block)))
        assert part.exp_avg.data_ptr() == entry.exp_avg.data_ptr() + part.first - first
