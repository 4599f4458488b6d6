"""Evaluation on held-out data: the mean token loss and its perplexity, forward only.

The held-out rows (``data.eval_path`` or ``data.eval_fraction``) are visited once, in order,
``train.global_batch_size`` rows a batch, streamed through the training window at the current
parameter version under ``no_grad``, the head's cross-entropy in chunks. Invariants: nothing is
saved, sent backward or updated; with several ranks one all-reduce sums losses and label
counts, so the mean is over every label token of the held-out set, as on one rank (under
context parallelism each rank's sums are its shard's).

Example::

    _, held = run_data(cfg, config, vocab)  # None: no held-out data configured
    evaluator = Evaluator(engine, held)
    print(evaluator.run(version=t))   # {"eval_loss": ..., "eval_perplexity": ..., ...}
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from slidedp.data.batch import Batch
from slidedp.data.batches import Batches
from slidedp.models.bind import bind_params
from slidedp.models.hf import LM_HEAD, NORM
from slidedp.models.loss import IGNORE_INDEX
from slidedp.runtime.activations import LayerRun
from slidedp.runtime.dist import all_reduce_sum
from slidedp.runtime.engine import Engine


def eval_batches(data: Batches) -> Iterator[tuple[Batch, int]]:
    """Every held-out row once, ``data.batch_size`` rows a batch, with its count of real rows:
    the last batch is filled up with copies of its first row whose labels are all ignored
    (every rank gets its share)."""
    n, size = len(data.rows), data.batch_size
    for start in range(0, n, size):
        rows = np.arange(start, min(start + size, n), dtype=np.int64)
        real = len(rows)
        rows = np.concatenate([rows, np.full(size - real, start, dtype=np.int64)])
        batch = data.batch_of_rows(rows)
        batch.labels[real:] = IGNORE_INDEX
        yield batch, real


def lm_loss_sum(
    hidden: torch.Tensor,  # [B, S, H] final-norm output
    weight: torch.Tensor,  # [V, H] LM head (or tied embedding)
    targets: torch.Tensor,  # [B, S] shifted labels
    chunk_tokens: int,
    softcap: float | None,
) -> torch.Tensor:
    """Σ token cross-entropies over the label tokens, ``chunk_tokens`` rows of logits at a
    time (the training loss's operations, ``models.loss.chunked_lm_loss``, without grads)."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B*S, H]
    flat_targets = targets.reshape(-1)  # [B*S]
    rows = (flat_targets != IGNORE_INDEX).nonzero().squeeze(1)  # [N]
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, rows.numel(), chunk_tokens):
        idx = rows[start : start + chunk_tokens]  # [n]
        logits = F.linear(flat.index_select(0, idx), weight)  # [n, V]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        total += F.cross_entropy(logits.float(), flat_targets.index_select(0, idx), reduction="sum")
    return total


class Evaluator:
    """Held-out loss of ``engine``'s model at a parameter version."""

    def __init__(self, engine: Engine, data: Batches) -> None:
        self.engine, self.data = engine, data

    def run(self, version: int) -> dict[str, float | int]:
        """Every held-out batch with the weights after ``version`` steps (updates drained
        first): ``eval_loss`` (mean over every label token), ``eval_perplexity``,
        ``eval_tokens`` (label tokens), ``eval_time_s``, ``eval_tokens_per_s`` (every token of
        the held-out rows, as the step's ``tokens_per_s``)."""
        engine = self.engine
        engine.drain()  # the weights of `version` in the store, every rank's updates in
        start = time.perf_counter()
        loss_sum, labels, tokens = 0.0, 0, 0
        with torch.no_grad():
            for batch, real in eval_batches(self.data):
                batch_loss, batch_labels = self._forward(batch, version)
                loss_sum, labels = loss_sum + batch_loss, labels + batch_labels
                tokens += int(batch.attention_mask[:real].sum())  # the global batch's
        if engine.ctx is not None:  # every rank's sums: the mean over every label token
            loss_sum, n = all_reduce_sum([loss_sum, labels], engine.device)
            labels = round(n)
        loss = loss_sum / max(labels, 1)
        seconds = time.perf_counter() - start
        engine.lane_times()  # the evaluation's lane times are no training step's
        return {
            "eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 700.0)),  # exp(>709) overflows a float
            "eval_tokens": labels,
            "eval_time_s": round(seconds, 6),
            "eval_tokens_per_s": round(tokens / seconds, 1),
        }

    def _forward(self, batch: Batch, v: int) -> tuple[float, int]:
        """(Σ token losses, label tokens) of this rank's rows of ``batch`` (its shard of them
        under context parallelism), streamed through the window; the inputs, embedding and
        masks as a training step's (``Engine._inputs``, ``Engine._embed_forward``)."""
        e = self.engine
        a, win = e.adapter, e.window
        inputs = e._inputs(batch, global_labels=False)
        x, embed_w = e._embed_forward(inputs, v)  # [b, S, H]; inputs.ctx: the layers' inputs
        compute, ctx = inputs.compute, inputs.ctx
        streamed = e.plan.policy.resident_layers
        for layer in range(a.num_layers):
            buf = e._layer_buffer(layer, v)
            if layer + 1 < a.num_layers:
                e._prefetch(max(layer + 1, streamed), v)
            else:
                e._load_own(e.head_buf, a.head_group, v)
            params = e._local(layer, buf)
            with e.clock.stream("compute", compute):
                x = LayerRun(a, layer, params, ctx).module_forward(params, x)[0]
            win.release(buf)
        win.acquire(e.head_buf)
        head = win.views(e.head_buf, a.head_group)
        with e.clock.stream("compute", compute):
            norm = a.norm_module()
            bind_params(norm, {"weight": head[NORM]})
            head_w = embed_w if a.tied else head[LM_HEAD]
            loss = lm_loss_sum(norm(x), head_w, inputs.targets, e.chunk_tokens, a.softcap)
        win.release(e.head_buf)
        win.release(e.embed_buf)
        return float(loss), inputs.n_labels
