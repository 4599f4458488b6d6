"""A run's plan as data and pure functions: ``layout`` (per-layer activation layouts),
``policy`` (the ``Policy`` and the ``Plan`` the engine executes, its JSON form), ``device``,
``cost`` (a layout's device memory, from the executors on the meta device), ``timing`` (the
step-time model's inputs), ``step_spec`` (their records and the Rust model's binding),
``machine`` (the machine probe, GPU peak, host rates), ``resolve`` (``resolve_plan``: where a
run's plan is decided) and ``predict`` (a plan's step time). Nothing here runs a training step
(``autopolicy`` does)."""
