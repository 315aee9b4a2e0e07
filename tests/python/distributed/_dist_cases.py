"""Every distributed test case, by id: one list read by pytest (to name the tests) and by
the ranks (to run them). Pure Python: importing it initialises nothing.

An id spells the configuration: world size, parameter/master/moment dtypes, layout and
what is checked, e.g. ``W=3-p=bf16-master=fp32-m=bf16-Shard(0)``.
"""

from dataclasses import dataclass

WORLD_SIZES = (2, 3, 4)

# Preset id -> (param dtype, master, exp_avg/exp_avg_sq storage). "remainder" is the int16
# remainder beside a bf16 parameter (S2.5); fp8 is E4M3 stored as uint8 (S2.2).
PRESETS = {
    "p=fp32-m=fp32": ("fp32", None, "fp32"),
    "p=bf16-master=fp32-m=bf16": ("bf16", "fp32", "bf16"),
    "p=bf16-master=remainder-m=bf16": ("bf16", "remainder", "bf16"),
    "p=bf16-master=fp32-m=fp8": ("bf16", "fp32", "fp8"),
    "p=bf16-master=fp16-m=fp16": ("bf16", "fp16", "fp16"),  # every state scaled fp16
}
FP32 = "p=fp32-m=fp32"
FP8 = "p=bf16-master=fp32-m=fp8"
REMAINDER = "p=bf16-master=remainder-m=bf16"
# Driven by the real megatron_fsdp package: exact with and without master, and scaled.
MEGATRON_FSDP_PRESETS = (FP32, REMAINDER, FP8)
# The configurations the issue asks for under FSDP2 (no fp16 master there).
FSDP2_PRESETS = ("p=fp32-m=fp32", "p=bf16-master=fp32-m=bf16",
                 "p=bf16-master=remainder-m=bf16", "p=bf16-master=fp32-m=fp8")

# block8 moments (S2.11) under FSDP2, _block8_jobs.PRESETS.
BLOCK8_PRESETS = ("p=fp32-m=block8", "p=bf16-master=remainder-m=block8",
                  "p=bf16-master=remainder-m=block4", "p=bf16-sr-m=block4")

LAYOUT_ERRORS = ("grad-placements", "grad-mesh", "grad-global-shape", "partial-param",
                 "local-shape-param",
                 "plain-grad-for-dtensor-param", "dtensor-grad-for-plain-param",
                 "state-plain-for-dtensor-param", "state-placements",
                 "state-dtensor-for-plain-param")

DCP_APIS = ("dcp+get_optimizer_state_dict", "dcp+get_optimizer_state_dict-flatten",
            "dcp+optimizer.state_dict")
# (saved at, loaded at): same size, growing with uneven/empty shards, shrinking.
DCP_RESHARDS = ((2, 2), (2, 3), (4, 2))


# Megatron FSDP mesh kinds by world size (_megatron_layout.MESH_KINDS); the 2-D ones need 4.
MEGATRON_KINDS = {2: ("dp", "no_shard"), 3: ("dp",), 4: ("dp", "hsdp", "hfsdp")}


def layouts(world_size):
    """Layout ids of the manual-DTensor cases at this world size."""
    names = ["Shard(0)", "Shard(1)", "Replicate"]
    if world_size == 4:
        names.append("mesh=2x2-(Replicate,Shard(0))")
    return names


@dataclass(frozen=True)
class Case:
    id: str
    world_size: int
    kind: str            # selects the function that runs it (see _dist_jobs.py)
    preset: str
    detail: str = ""     # layout, error kind, API, ...
    needs: tuple = ()    # ids of cases (any world size) whose output this one reads
    # A named job runs apart from its world size's main one: jobs that read each other's
    # checkpoints must not form a cycle (2 -> 3, 4 reads what this job saves at 2, while
    # the main job at 2 reads what 4 saves).
    job: str = ""

    def __str__(self):
        return self.id


def _build():
    cases = []
    for w in WORLD_SIZES:
        for preset in PRESETS:
            for layout in layouts(w):
                cases.append(Case(f"W={w}-{preset}-{layout}", w, "numerics", preset, layout))
        for preset in (FP32, FP8):
            cases.append(Case(f"W={w}-{preset}-Shard(0)-grad=None-on-empty-shards", w,
                              "empty_shard_none_grads", preset))
        for preset in PRESETS:
            cases.append(Case(f"W={w}-{preset}-zero-collectives-in-step", w,
                              "zero_collectives", preset))
        for preset in (FP32, FP8):
            for what in LAYOUT_ERRORS:
                cases.append(Case(f"W={w}-{preset}-error-{what}", w, "layout_error",
                                  preset, what))
        for preset in FSDP2_PRESETS:
            cases.append(Case(f"W={w}-fsdp2-{preset}", w, "fsdp2", preset))
        for kind in MEGATRON_KINDS[w]:
            for preset in PRESETS:
                cases.append(Case(f"W={w}-megatron-{kind}-{preset}", w, "megatron_layout",
                                  preset, kind))
    for w in (2, 3):
        for preset in PRESETS:
            cases.append(Case(f"W={w}-{preset}-get_optimizer_state_dict-on-fresh-optimizer",
                              w, "fresh_get_state_dict", preset))
    for preset in PRESETS:
        cases.append(Case(f"W=3-{preset}-te-state-methods", 3, "state_access", preset))
    for preset in (FP32, "p=bf16-master=remainder-m=bf16"):
        cases.append(Case(f"W=2-fsdp2-frozen-param-dcp-{preset}", 2, "fsdp2_frozen_dcp",
                          preset))
    cases.append(Case(f"W=2-fsdp2-torch-adamw-dcp-{FP32}", 2, "fsdp2_torch_adamw_dcp", FP32))
    for preset in (FP32, REMAINDER):
        cases.append(Case(f"W=2-tensor-parallel-sequence-parallel-{preset}", 2,
                          "tensor_parallel", preset))
    for preset in (FP32, "p=bf16-master=fp32-m=fp8"):
        cases.append(Case(f"W=2-fsdp2-built-before-sharding-{preset}", 2,
                          "fsdp2_built_before_sharding", preset))
    for preset in (REMAINDER, FP8):
        cases.append(Case(f"W=2-zero-redundancy-{preset}", 2, "zero_redundancy", preset))
    for preset in FSDP2_PRESETS:
        save = f"W=2-fsdp2-dcp-save-{preset}"
        cases.append(Case(save, 2, "fsdp2_dcp_save", preset))
        cases.append(Case(f"W=3-fsdp2-dcp-2to3-{preset}", 3, "fsdp2_dcp_resume", preset, "2",
                          needs=(save,)))
    for preset in ("p=bf16-master=fp32-m=bf16", "p=bf16-master=fp16-m=fp16"):
        save = f"W=2-fsdp2-dcp-save-before-the-first-step-{preset}"
        cases.append(Case(save, 2, "fsdp2_step0_save", preset))
        cases.append(Case(f"W=3-fsdp2-dcp-2to3-at-step-0-then-pretrained-weights-{preset}",
                          3, "fsdp2_step0_resume", preset, "2", needs=(save,)))
    for preset in MEGATRON_FSDP_PRESETS:
        save = f"W=2-megatron-fsdp-dcp-save-{preset}"
        cases.append(Case(save, 2, "megatron_fsdp_save", preset, job="megatron-save"))
        for w in (3, 4):
            cases.append(Case(f"W={w}-megatron-fsdp-dcp-2to{w}-{preset}", w,
                              "megatron_fsdp_resume", preset, needs=(save,)))
    for moments in ("m=fp32", "m=bf16"):  # megatron_fsdp.fully_shard itself, fp32 main weights
        save = f"W=2-megatron-fully_shard-p=fp32-{moments}-train-and-save"
        cases.append(Case(save, 2, "megatron_real_save", FP32, moments, job="megatron-save"))
        for w in (3, 4):
            cases.append(Case(f"W={w}-megatron-fully_shard-p=fp32-{moments}-dcp-2to{w}", w,
                              "megatron_real_resume", FP32, moments, needs=(save,)))
    for preset in (FP32, REMAINDER):
        cases.append(Case(f"W=3-megatron-dp-handling-{preset}", 3, "megatron_handling",
                          preset, "dp"))
    for what in ("grad-local-shape", "grad-local-dtype", "grad-placements", "shard-order"):
        cases.append(Case(f"W=3-megatron-dp-{FP32}-error-{what}", 3, "megatron_error", FP32,
                          "dp|" + what))
    for what in ("remainder-to-fp32", "fp32-to-remainder"):
        cases.append(Case(f"W=2-dcp-state-layout-{what}", 2, "state_layout_mismatch",
                          REMAINDER, what))
    for preset in BLOCK8_PRESETS:  # _block8_jobs: its own presets (moment_format)
        save = f"W=2-fsdp2-block8-dcp-save-{preset}"
        cases.append(Case(save, 2, "block8_dcp_save", preset, job="block8-save"))
        # 3: 2 rows of each 6-row weight per rank; 4: an empty shard (6 rows in
        # torch's chunks of 2); 1: the whole tensors.
        for w in (3, 4, 1):
            cases.append(Case(f"W={w}-fsdp2-block8-dcp-2to{w}-{preset}-equals-uninterrupted",
                              w, "block8_dcp_resume", preset, needs=(save,)))
        cases.append(Case(f"W=3-fsdp2-{preset}-torch-path-in-pieces-equals-core", 3,
                          "torch_path_pieces", preset))
    for preset in ("p=fp32-m=block8", "p=bf16-master=remainder-m=block4"):
        cases.append(Case(f"W=2-fsdp2-{preset}-built-on-meta-before-to_empty", 2,
                          "block_meta_init", preset))
    # block8 and block4 under megatron_fsdp.fully_shard (_megatron_block_jobs.SHAPES):
    # saved at 2 beside the other fully_shard saves, resumed in fresh ranks at 2 and at 3.
    for fmt in ("block8", "block4"):
        for shapes in ("rows=whole-blocks", "rows=partial-blocks"):
            save = f"W=2-megatron-fully_shard-{fmt}-{shapes}-train-and-save"
            cases.append(Case(save, 2, "megatron_block_save", f"p=fp32-m={fmt}", shapes,
                              job="megatron-save"))
            for w in (2, 3):
                cases.append(Case(f"W={w}-megatron-fully_shard-{fmt}-{shapes}-dcp-2to{w}", w,
                                  "megatron_block_resume", f"p=fp32-m={fmt}", shapes,
                                  needs=(save,)))
    for layout in ("Shard(0)", "Shard(1)", "Replicate", "rows-5-3-1+megatron_fsdp_slice",
                   "rows-5-3-1+slice-off-the-rows", "rows-5-3-1+slice-of-a-tp-part"):
        cases.append(Case(f"W=3-block8-mesh-rule-{layout}", 3, "block8_mesh_rule",
                          "p=fp32-m=block8", layout))
    cases.append(Case("W=4-block8-mesh-rule-_StridedShard(0)-2x2", 4, "block8_mesh_rule",
                      "p=fp32-m=block8", "_StridedShard(0)"))
    cases.append(Case("W=3-block4-mesh-rule-Shard(1)-takes-block8", 3, "block8_mesh_rule",
                      "p=fp32-m=block4", "Shard(1)+block4"))
    cases.append(Case("W=4-block8-mesh-rule-HSDP-2x2", 4, "block8_mesh_rule",
                      "p=fp32-m=block8", "HSDP-(Replicate,Shard(0))"))
    cases.append(Case("W=2-block4-rows-cut-6-4-keyed-locally-resume-bitwise", 2,
                      "block4_uneven_rows", "p=fp32-m=block4"))
    for api in DCP_APIS:
        for preset in PRESETS:
            save4 = f"W=4-{api}-save-for-4to2-{preset}"
            cases.append(Case(save4, 4, "dcp_save", preset, api))
            same2 = f"W=2-{api}-2to2-{preset}"
            cases.append(Case(same2, 2, "dcp_resume", preset, f"{api}|2"))
            cases.append(Case(f"W=3-{api}-2to3-{preset}", 3, "dcp_resume", preset,
                              f"{api}|2", needs=(same2,)))
            cases.append(Case(f"W=2-{api}-4to2-{preset}", 2, "dcp_resume", preset,
                              f"{api}|4", needs=(save4,)))
    return cases


CASES = _build()
BY_ID = {case.id: case for case in CASES}
assert len(BY_ID) == len(CASES), "duplicate case ids"


def of_kind(*kinds):
    return [case for case in CASES if case.kind in kinds]


def checkpoint_dir(shared_dir, api, preset, saved_at):
    """Where the case that saves (api, preset) at world size ``saved_at`` writes."""
    safe = f"{api}-{preset}-W{saved_at}".replace("=", "_").replace("+", "_")
    return f"{shared_dir}/ckpt-{safe}"
