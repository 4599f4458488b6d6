"""The run's choices as data, below ``runtime/`` and ``estimate``: ``layout`` (per-layer
activation layouts and their text form), ``policy`` (the one ``Policy`` the engine executes and
the ``Plan`` around it, resolved once from the config), ``device`` (device and dtype), ``cost``
(what a layout costs in device memory, measured by running the executors on the meta device)."""
