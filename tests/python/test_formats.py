"""The package's declarations of its state formats (shardadam._formats): they agree with
the facts the tests state on their own, the constructor's dtype arguments keep
Transformer Engine's meanings, scales are shaped by each format's granularity, and an
extension whose own table of the formats differs is refused."""

import copy
import pickle
import types

import pytest
import numpy
import torch

from _optimizer_testing import GRID, SCALE_TARGET, TORCH_DTYPE, id_name
from _slot_buffers import CODE, STORAGE
from shardadam import _formats
from shardadam._formats import FORMATS, Format


def test_declarations_agree_with_the_tests_facts():
    """Every declared format has the tag, storage, scale target and constructor dtype
    the tests state for it (S2.2, S2.3): a format added to the package needs its facts
    in the tests too."""
    by_dtype = [f for f in FORMATS if f.scale != "block"]
    assert sorted(id_name(f) for f in by_dtype) == sorted(STORAGE)
    for fmt in by_dtype:
        name = id_name(fmt)
        assert fmt.tag == CODE[name], name
        assert fmt.storage == STORAGE[name] and fmt.item_bits == 8 * STORAGE[name].itemsize
        assert fmt.scaled == (name in SCALE_TARGET), name
        assert fmt.scale_target == SCALE_TARGET.get(name, 0.0), name
        assert fmt.scale_shape(7) == (() if fmt.scaled else None), name
        if fmt.argument is not None:
            assert TORCH_DTYPE[name] is fmt.argument, name
        if fmt.pairs_with is None:
            assert name in GRID, f"{name}: no grid for the reference's bounds"


# S2.9 / S2.10 / S2.12: (tag, largest magnitude encoded to a finite code, largest
# encoded to code 0, the states it may hold, bits per code).
BLOCK_FACTS = {"fp8-block": (6, 464.0, 2.0 ** -10, ("moment",), 8),
               "ufp8-block": (7, 488.0, 0.0, ("exp_avg_sq",), 8),
               "fp4-block": (8, float(numpy.nextafter(numpy.float32(7), numpy.float32(0))),
                             0.25, ("moment",), 4),
               "ufp4-block": (9, 20.0, 0.0, ("exp_avg_sq",), 4)}


def test_block_declarations_agree_with_the_tests_facts():
    """Per-block formats: uint8 codes (4-bit ones two per byte), no dtype names them,
    their block size is chosen at construction (0 in the registry), and their bounds are
    S2.9's / S2.10's / S2.12's."""
    block = [f for f in FORMATS if f.scale == "block"]
    assert sorted(f.name for f in block) == sorted(BLOCK_FACTS)
    for fmt in block:
        tag, target, zero, roles, bits = BLOCK_FACTS[fmt.name]
        assert (fmt.tag, fmt.scale_target, fmt.zero_bound, fmt.roles, fmt.item_bits) == (
            tag, target, zero, roles, bits), fmt.name
        assert fmt.storage == torch.uint8 and fmt.argument is None and fmt.scale_block == 0
        assert fmt.holds("exp_avg_sq") and fmt.holds("exp_avg") == ("moment" in roles)
        assert fmt.packed == (bits == 4)
        assert fmt.storage_shape((3, 8)) == ((3, 4) if bits == 4 else (3, 8))
        assert not fmt.holds("master_param")
        sized = fmt.with_block(256)
        assert sized is fmt.with_block(256) and sized is not fmt.with_block(512)
        assert sized.label == f"{fmt.name}:256" and _formats.by_label(sized.label) is sized
        assert pickle.loads(pickle.dumps(sized)) is sized and copy.deepcopy(sized) is sized


def test_names_and_tags_are_the_recorded_ones():
    """Checkpoints record layouts by these names and the core reads these tags."""
    rows = {(f.name, f.tag) for f in FORMATS}
    assert rows == {("fp32", 1), ("fp16", 2), ("bf16", 3), ("fp8", 4), ("remainder", 5),
                    ("fp8-block", 6), ("ufp8-block", 7), ("fp4-block", 8),
                    ("ufp4-block", 9)}
    for fmt in FORMATS:
        assert _formats.by_name(fmt.name) is fmt and _formats.by_tag(fmt.tag) is fmt
    with pytest.raises(KeyError):
        _formats.by_name("int16")
    with pytest.raises(KeyError):
        _formats.by_tag(_formats.TAG_NONE)


MOMENT_ARGUMENTS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                    torch.uint8: "fp8"}
MASTER_ARGUMENTS = {torch.float32: "fp32", torch.float16: "fp16"}
NAMED_NOTHING = [torch.float64, torch.int16, torch.int8, torch.float8_e4m3fn, None,
                 "float32", torch.zeros(())]


@pytest.mark.parametrize("role,named", [("moment", MOMENT_ARGUMENTS),
                                        ("master", MASTER_ARGUMENTS)])
def test_constructor_dtypes_keep_transformer_engines_meanings(role, named):
    """exp_avg_dtype / exp_avg_sq_dtype: fp32, fp16, bf16, uint8 = fp8 E4M3 codes;
    master_weight_dtype: fp32, fp16 (remainders are chosen by store_param_remainders).
    Anything else names no format, whatever it is."""
    for dtype, name in named.items():
        assert _formats.configured(dtype, role) is _formats.by_name(name), (role, dtype)
    others = [d for d in MOMENT_ARGUMENTS if d not in named] + NAMED_NOTHING
    for dtype in others:
        assert _formats.configured(dtype, role) is None, (role, dtype)
    assert [f.name for f in _formats.choices(role)] == list(named.values())


def test_scale_shape_follows_the_granularity():
    """A per-tensor scale is 0-dim; a per-block one has one element per block of the
    flattened local tensor; an unscaled format has none."""
    block = Format("fp8-block32", 99, torch.uint8, torch.float8_e4m3fn, ("moment",),
                   scale="block", scale_block=32, scale_target=448.0)
    assert [block.scale_shape(n) for n in (0, 1, 32, 33, 64)] == [(0,), (1,), (1,),
                                                                     (2,), (2,)]
    # Blocks keyed to the whole parameter's flat index: a range starting at `first`
    # touches the blocks from first // 32 to (first + n - 1) // 32 (S2.9).
    assert [block.scale_shape(n, first) for first, n in
            ((31, 1), (31, 2), (5, 59), (5, 60), (64, 0))] == [(1,), (2,), (2,), (3,), (0,)]
    with pytest.raises(ValueError, match="with_block"):
        _formats.FP8_BLOCK.scale_shape(5)
    assert _formats.FP8.scale_shape(0) == () and _formats.BF16.scale_shape(5) is None


@pytest.mark.parametrize("fields", [
    dict(scale="row"), dict(scale="block"), dict(scale_block=32),
    dict(scale="tensor"), dict(scale_target=448.0), dict(roles=("param",)),
    dict(codes=torch.float16)], ids=str)
def test_inconsistent_declarations_are_refused(fields):
    declared = dict(name="x", tag=99, storage=torch.uint8, codes=torch.float8_e4m3fn,
                    roles=("moment",))
    with pytest.raises(ValueError, match="not a consistent declaration"):
        Format(**{**declared, **fields})


def test_pickles_and_copies_are_the_declared_objects():
    """Formats are compared by identity: a pickled or copied one is the registry's."""
    for fmt in FORMATS:
        assert pickle.loads(pickle.dumps(fmt)) is fmt
        assert copy.deepcopy(fmt) is fmt and copy.copy(fmt) is fmt


def table():
    """The C++ core's table as _C.FORMATS lists it, built from the registry."""
    return tuple((f.tag, f.name, f.item_bits, f.scale, f.scale_block, f.scale_target,
                  f.roles, f.zero_bound, f.overflow_bound) for f in FORMATS)


def altered(index, field, value):
    rows = [list(row) for row in table()]
    rows[index][field] = value
    return tuple(map(tuple, rows))


def test_extension_with_the_same_table_is_accepted():
    """Rows and the roles within a row may come in any order; a list is a sequence
    too."""
    _formats.check_extension(types.SimpleNamespace(FORMATS=table()))
    rows = [(*row[:6], tuple(reversed(row[6])), *row[7:]) for row in reversed(table())]
    _formats.check_extension(types.SimpleNamespace(FORMATS=rows))
    _formats.check_extension(types.SimpleNamespace(FORMATS=[list(r) for r in table()]))
    # A format of the core's that the package does not select: not its business.
    more = table() + ((60, "int4-block", 4, "block", 0, 7.5, ("moment",), 0.5, 0.0),)
    assert _formats.check_extension(types.SimpleNamespace(FORMATS=more)) == frozenset()


def test_extension_without_a_block_format_has_it_unavailable():
    """An older core without a per-block format still loads; the format is reported
    missing (moment_format then refuses it, test_block_moments_api.py)."""
    rows = tuple(row for row in table() if row[1] != "ufp8-block")
    found = _formats.check_extension(types.SimpleNamespace(FORMATS=rows))
    assert found == frozenset({"ufp8-block"})


OTHER_TABLES = {
    "a-format-missing": tuple(row for row in table() if row[1] != "fp8"),
    "block-format-altered": tuple(row if row[1] != "fp8-block" else row[:5] + (448.0,)
                                  + row[6:] for row in table()),
    "another-with-an-fp16-tag": table() + ((2, "int8", 1, "none", 0, 0.0, ("moment",), 0.0,
                                            0.0),),
    "another-with-an-fp16-name": table() + ((60, "fp16", 1, "none", 0, 0.0, ("moment",),
                                             0.0, 0.0),),
    "one-twice": table() + (table()[0],),
    "fp16-tag": altered(1, 0, 3),
    "fp16-name": altered(1, 1, "half"),
    "fp8-item-size": altered(3, 2, 2),
    "fp8-per-block": altered(3, 3, "block"),
    "fp8-block-size": altered(3, 4, 32),
    "fp16-scale-target": altered(1, 5, 65504.0),
    "bf16-as-master": altered(2, 6, ("moment", "master")),
    "rows-without-roles": tuple(row[:6] for row in table()),
    "rows-without-zero-bound": tuple(row[:7] for row in table()),
    "rows-without-overflow-bound": tuple(row[:8] for row in table()),
    "block-overflow-bound-altered": tuple(row if row[1] != "fp4-block" else row[:8]
                                          + (2.0 ** 127,) for row in table()),
    "rows-with-a-field-more": tuple(row + (0,) for row in table()),
    "tag-and-name-swapped": (("fp32", 1, 4, "none", 0, 0.0, ("moment", "master"), 0.0, 0.0),)
                            + table()[1:],
    "empty": (), "none": None, "a-number": 5, "a-string": "fp32"}


@pytest.mark.parametrize("formats", list(OTHER_TABLES.values()), ids=list(OTHER_TABLES))
def test_extension_with_another_table_is_refused(formats):
    with pytest.raises(ImportError, match="rebuild the extension"):
        _formats.check_extension(types.SimpleNamespace(FORMATS=formats))


def test_extension_without_a_table_is_refused():
    with pytest.raises(ImportError, match="rebuild the extension"):
        _formats.check_extension(types.SimpleNamespace())


def test_built_extension_table_matches():
    """Importing the package checks the built extension's table."""
    core = pytest.importorskip("shardadam._C", reason="C++ extension is not built")
    _formats.check_extension(core)


BLOCK_FORMATS = [f for f in FORMATS if f.scale == "block"]


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("first,rows", [(0, 24), (2 * 51, 23), (384, 12), (256, 16)])
def test_block_codecs_work_in_chunks(fmt, first, rows, monkeypatch):
    """A per-block format's torch encode and decode step through a tensor in chunks cut
    on the whole parameter's block boundaries (their temporaries stay bounded): the
    same codes and scales as the whole tensor at once, zero chunks included (stored as
    code 0, scale 1, without encoding; -0.0 still encoded, which only fp8-block's codes
    can tell apart: E4M3 keeps its sign, E2M1 stores it as code 0), stochastic codes
    too."""
    from shardadam import _codecs

    f = fmt.with_block(128)
    gen = torch.Generator().manual_seed(rows)
    value = torch.randn(rows, 64, generator=gen)
    if fmt.name.startswith("u"):
        value = value * value
    value[3:9] = 0.0  # whole zero blocks and chunks
    value[10, 5] = -0.0
    if not fmt.name.startswith("u"):
        value[8:12] = -0.0  # whole chunks of -0.0 (E4M3 keeps its sign; E2M1 has code 0)
    stochastic = fmt.name in ("fp4-block", "ufp4-block", "ufp8-block")  # S2.13
    rounding = _codecs.exp_avg_step_key(3, 7) if stochastic else None
    want_codes, want_scales = _codecs.encode_blocks(
        f.name, value, first, 128, f.scale_target, f.zero_bound, rounding)
    if f.packed:
        want_codes = _codecs.pack_nibbles(want_codes)
    monkeypatch.setattr(_formats, "_CHUNK", 256)
    stored = torch.full(f.storage_shape(value.shape), 0x55, dtype=f.storage)
    scale = torch.full(want_scales.shape, 3.0)
    f.encode(value, stored, scale, first, rounding)
    assert torch.equal(stored.view(torch.uint8).reshape(-1),
                       want_codes.view(torch.uint8).reshape(-1))
    assert torch.equal(scale, want_scales)
    decoded = f.decode(stored, scale, first)
    whole = _codecs.decode_blocks(f.name, _codecs.unpack_nibbles(stored) if f.packed
                                  else stored, scale, first, 128)
    assert decoded.shape == value.shape
    assert torch.equal(decoded.view(torch.int32), whole.view(torch.int32))


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8"])
def test_large_tensors_encode_as_one_piece(name, contiguous):
    """Format.encode stores a tensor larger than its chunk (2^20 elements) piece by
    piece, to keep the codecs' temporaries small: the same bits as torch's own
    conversion of the whole tensor divided by S2.3's scale, measured over all of it
    (the largest value sits in the last chunk), also into strided storage."""
    fmt = {f.name: f for f in FORMATS}[name]
    n = (1 << 21) + 77
    gen = torch.Generator().manual_seed(5)
    value = torch.randn(n, generator=gen) * torch.pow(2.0, torch.randint(-30, 10, (n,),
                                                                         generator=gen))
    value[:5] = torch.tensor([0.0, -0.0, 1e-40, -1e-45, 3.0])
    value[-1] = 1e4  # the absmax, in the last chunk only
    if fmt.scaled:
        scale = torch.clamp_min(value.abs().max() / SCALE_TARGET[name],
                                torch.finfo(torch.float32).tiny)
        want = (value / scale).to(fmt.codes).view(fmt.storage)
    else:
        scale, want = None, value.to(fmt.storage)
    stored = torch.empty(n, 2, dtype=fmt.storage)[:, 0] if not contiguous \
        else torch.empty(n, dtype=fmt.storage)
    got_scale = torch.zeros(()) if fmt.scaled else None
    fmt.encode(value, stored, got_scale)
    assert torch.equal(stored.view(torch.uint8 if fmt.storage.itemsize == 1 else torch.int16),
                       want.view(torch.uint8 if fmt.storage.itemsize == 1 else torch.int16))
    if fmt.scaled:
        assert got_scale.item() == scale.item()
