"""User tools on top of the core and the integrations: the ``swiftfusion`` command (``cli``:
``plan``, ``check``, ``compare``), the correctness check (``check``), the side-by-side model
comparison (``compare``, ``measure``) and the tiny models it runs (``models``)."""
