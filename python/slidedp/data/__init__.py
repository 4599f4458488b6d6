"""Training data: local JSONL / JSON / Parquet → tokenized, checked, padded or packed batches.

Entry point: ``slidedp.data.build.build_data(section, model_dir=..., model=ModelFacts(...),
batch_size=..., seed=...)`` → the training ``Batches`` (``batch(step)``, a pure function of the
step, and ``report``) and the held-out ones (or None).
Modules: ``sources`` (files, formats), ``encode`` (tokenization, loss masks), ``samples``
(compact storage, over-length policy), ``layout`` (padding, packing), ``batches`` (per-step
batches, report), ``batch`` (``Batch``, the engine contract), ``config`` (``DataSection``,
imported by ``slidedp.config``: this package's ``__init__`` stays empty so that import stays
light).
"""
