"""Imported by the demo's fork server alone, as its first preload (launcher._PRELOAD):
the server then dies with the demo process that started it, and the ranks with the
server (launcher.die_with_parent). Nothing else imports it."""

from .launcher import die_with_parent

die_with_parent()
