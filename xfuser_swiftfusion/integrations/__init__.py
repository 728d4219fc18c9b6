"""Integrations of the core with inference engines: ``xfuser`` (xDiT's ``USP()`` routed to a
strategy, ``--sp-strategy``); each depends on the core, never the reverse."""
