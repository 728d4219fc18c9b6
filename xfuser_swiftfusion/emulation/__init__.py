"""A GPU cluster emulated on one CPU host: the stand-in for machines, links and NVSHMEM.

- ``launcher``: ``run_emulated(fn, "NxM")`` forks N*M gloo ranks (optionally over throttled links);
- ``netns``: one network namespace per machine with ``tc tbf``-limited links (root);
- ``shm`` + ``proxy``: the one-sided ``shm`` communicator, a shared-memory symmetric heap within
  a machine and a TCP proxy across machines (entry point ``xfuser_swiftfusion.one_sided:shm``,
  the ``comm="auto"`` choice for CPU tensors);
- ``procs``: process liveness.
"""
