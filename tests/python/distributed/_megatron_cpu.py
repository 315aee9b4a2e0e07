"""``megatron_fsdp.fully_shard`` (0.6.1) on CPU ranks with gloo: the four lines that stop it
and the smallest change that gets past each, and one overlap that is unsafe without CUDA
streams (5), applied only inside ``megatron_on_cpu()``.

Nothing here changes what reaches the optimizer (parameters, gradients, the optimizer
life cycle, the checkpoint hooks); it replaces CUDA-only plumbing around them:

1. ``megatron_fsdp.py:234`` (``MegatronFSDP.__init__``) calls ``torch.cuda.current_device()``
   even with ``device=cpu``, for a warning: it answers 0.
2. ``uneven_dtensor.py:187`` (``validate_uneven_dtensor``, called from
   ``param_and_grad_buffer.py:5159``) moves its check tensor to the GPU with ``.cuda()``:
   run it with ``Tensor.cuda`` as the identity, so its gloo all_reduce gets a CPU tensor.
3. ``megatron_fsdp.py:406`` creates ``torch.cuda.Stream()``s and
   ``param_and_grad_buffer.py:4029-4037, 4124, 4532-4560`` order its collectives with
   streams and events: CPU collectives are synchronous or return gloo work handles that
   Megatron waits on, so streams and events that do nothing keep the same order.
4. ``param_and_grad_buffer.py:4748`` reduces gradients with NCCL's ``PREMUL_SUM`` because
   ``gradient_reduce_div_fusion`` defaults to True and ``fully_shard`` has no argument
   for it; with the flag off Megatron takes its own other branch (pgb:4751: scale, then
   SUM), which gloo has.

5. ``param_and_grad_buffer.py:4561`` starts its parameter all-gathers asynchronously
   (``_coalescing_manager(..., async_ops=True)``; ``fully_shard`` forces the overlap on
   with ``zero_dp_strategy=3``) and frees a bucket's memory by resizing its storage to 0
   (``_free_storage``) in the order its streams give, which (3) turns into nothing; gloo
   meanwhile runs the all-gather on its own threads, copying into views of the bucket.
   Every coalesced collective is made synchronous instead (``async_ops=False``: waited on
   as the block exits, as its gradient reductions already are), so no gloo thread
   touches Megatron's memory while Megatron runs.

Two more are arguments, not CPU matters: a 1-D mesh fails in ``utils.py:681`` (no
sub-mesh named None), so the mesh is (dp, tp) with tp of size 1 and ``tp_dim="tp"``;
``zero_dp_strategy=3`` needs ``fsdp_unit_modules`` (``megatron_fsdp.py:432`` divides by
their count).
"""

import contextlib

import torch


class _Event:
    def wait(self, *args):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _Event()

    def synchronize(self):
        pass


@contextlib.contextmanager
def _patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def megatron_on_cpu():
    import megatron_fsdp.param_and_grad_buffer as pgb
    import megatron_fsdp.uneven_dtensor as ud

    validate, preprocess = ud.validate_uneven_dtensor, pgb.gradient_reduce_preprocessing
    coalescing = pgb._coalescing_manager

    def validate_on_cpu(dtensor):  # (2)
        with _patched(torch.Tensor, "cuda", lambda self, *args, **kwargs: self):
            return validate(dtensor)

    def reduce_without_premul_sum(grad_data, scaling_factor, ddp_config):  # (4)
        ddp_config.gradient_reduce_div_fusion = False
        return preprocess(grad_data, scaling_factor, ddp_config)

    def coalescing_synchronously(group=None, device=None, async_ops=False):  # (5)
        return coalescing(group, device, async_ops=False)

    current = _Stream()
    with contextlib.ExitStack() as stack:
        for owner, name, value in (
                (torch.cuda, "current_device", lambda: 0),  # (1)
                (pgb, "validate_uneven_dtensor", validate_on_cpu),  # imported by name
                (torch.cuda, "Stream", _Stream),  # (3)
                (torch.cuda, "current_stream", lambda *args, **kwargs: current),
                (torch.cuda, "stream", lambda stream=None: contextlib.nullcontext()),
                (pgb, "gradient_reduce_preprocessing", reduce_without_premul_sum),
                (pgb, "_coalescing_manager", coalescing_synchronously)):
            stack.enter_context(_patched(owner, name, value))
        yield
