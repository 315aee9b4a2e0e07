"""``python -m shardadam demo``: FSDP2 training side by side with torch's AdamW and
shardadam's ``FusedAdam``, a mid-way DCP checkpoint resumed on another rank count, and a
report (table, JSON, PNG). ``cli`` is the entry point; each other module has one job:
``config`` (named choices), ``corpus`` and ``data`` (text and batches), ``model``,
``worker`` (one rank), ``launcher`` (the ranks of a phase), ``report``.
"""
