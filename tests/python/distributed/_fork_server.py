"""Imported by the distributed harness's fork server alone, as its first preload
(_launch._PRELOAD): the server then dies with the process that started it (pytest, the
soak's supervisor), and each rank with the server (_launch._forked_child)."""

from shardadam.demo.launcher import die_with_parent

die_with_parent()
