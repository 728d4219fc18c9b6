"""Integrations of the core with inference engines: ``xfuser`` (xDiT's ``USP()`` routed to a
strategy, ``--sp-strategy``) and ``diffusers`` (diffusers' own context parallelism with a
strategy doing the attention: ``enable_parallelism``); each depends on the core, never the
reverse."""
