"""``python -m shardadam bench``: side-by-side CPU benchmark of one Adam step
(docs/benchmarking.md).

Modules, one job each:

* ``cases``        state presets, parameter lists (shapes) and the tensors built for them
* ``contenders``   every optimizer timed, behind one ``make(name, params, preset)``
* ``multipass``    the multi-pass unscale -> ``torch._fused_adamw_`` -> rescale path
* ``probe``        the machine's bandwidth ceiling with the step's access pattern
* ``timing``       interleaved repetitions and their statistics
* ``memory``       peak extra bytes of ``step()``, in a fresh subprocess per contender
* ``distributed``  DTensor (Shard(0)) parameters on 2 gloo ranks vs the same plain tensors
* ``report``       the table, the JSON and the PNG chart
* ``cli``          arguments and the order of the run
"""
