"""``io.parallel_init.ParallelNormal``: the init's normal draws by seeded chunks on a pool of
threads, the values a function of the seed, the scope and the draw order alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.tiny import tiny_config
from slidedp.io import hf_load
from slidedp.io.parallel_init import CHUNK, ParallelNormal, chunk_seed
from slidedp.models.hf import HFAdapter
from slidedp.store import HostStore


def _drawn(threads: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = torch.empty(numel), torch.empty(numel)
    with ParallelNormal(7, threads) as draws:
        draws.scope("m")
        torch.nn.init.normal_(first, mean=1.0, std=0.02)  # how _init_weights draws
        second.normal_(0.0, 3.0)  # a method call: the scope's second draw
    return first, second


def test_each_chunk_has_its_own_seeded_generator_whatever_the_threads() -> None:
    numel = 2 * CHUNK + 5  # a short last chunk
    first, second = _drawn(3, numel)
    expected = torch.empty(numel)
    for k, start in enumerate(range(0, numel, CHUNK)):
        g = torch.Generator().manual_seed(chunk_seed(7, "m", 0, k))
        expected[start : start + CHUNK].normal_(1.0, 0.02, generator=g)
    assert torch.equal(first, expected)
    assert torch.equal(torch.stack(_drawn(1, numel)), torch.stack((first, second)))
    assert not torch.equal(first[:CHUNK] - 1.0, first[CHUNK : 2 * CHUNK] - 1.0)
    # the sample std of n=8.4M draws has a standard error of 3/sqrt(2n) ~ 7e-4: 0.01 is ~14 of them
    assert abs(float(second.std()) - 3.0) < 0.01


def test_a_strided_tensor_draws_from_one_seeded_generator() -> None:
    base = torch.zeros(64, 32)
    with ParallelNormal(3, 2) as draws:
        draws.scope("s")
        base.t().normal_(0.0, 1.0)
    expected = torch.zeros(64, 32)
    g = torch.Generator().manual_seed(chunk_seed(3, "s", 0, 0))
    expected.t().normal_(0.0, 1.0, generator=g)
    assert torch.equal(base, expected)


def _expected(seed: int, scope: str, draw: int, numel: int, std: float) -> torch.Tensor:
    values = torch.empty(numel)
    for k, start in enumerate(range(0, numel, CHUNK)):
        g = torch.Generator().manual_seed(chunk_seed(seed, scope, draw, k))
        values[start : start + CHUNK].normal_(0.0, std, generator=g)
    return values


def test_draws_stay_in_flight_until_another_call_which_sees_them_done() -> None:
    """Two matrices' draws run together; the next other call (a padding row zeroed, as
    ``_init_weights`` does after the embedding's draw) waits for them and sees every value;
    memory drawn again while its first draw is in flight is drawn in order."""
    numel = CHUNK + 7
    store = torch.empty(3 * numel)  # one storage, as the host store's views share one
    a, b = store[:numel], store[numel : 2 * numel]
    with ParallelNormal(11, 3) as draws:
        draws.scope("m")
        a.normal_(0.0, 1.0)
        b.normal_(0.0, 2.0)
        assert len(draws._pending) == 4  # both matrices' two chunks, in flight together
        a[:5].zero_()  # waits for the draws, then runs
        b.normal_(0.0, 3.0)  # b's memory again: after its first draw
    assert torch.equal(a[:5], torch.zeros(5))
    assert torch.equal(a[5:], _expected(11, "m", 0, numel, 1.0)[5:])
    assert torch.equal(b, _expected(11, "m", 2, numel, 3.0))


def test_a_draw_over_memory_still_being_drawn_waits_for_it() -> None:
    """A view made before the block (making one inside is a call that waits) drawn while the
    draw of its base is in flight: drawn after it, never overwritten by its late chunks."""
    x = torch.empty(2 * CHUNK)
    middle = x[CHUNK - 8 : CHUNK + 8]
    with ParallelNormal(5, 3) as draws:
        draws.scope("o")
        x.normal_(0.0, 1.0)
        middle.normal_(0.0, 1e-6)
    assert torch.equal(middle, _expected(5, "o", 1, 16, 1e-6))
    assert torch.equal(x[: CHUNK - 8], _expected(5, "o", 0, 2 * CHUNK, 1.0)[: CHUNK - 8])


def test_an_error_in_a_draw_reaches_the_caller_as_itself() -> None:
    integers = torch.empty(8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="normal"), ParallelNormal(0, 2):
        integers.normal_()  # torch refuses normal_ on integers (raised when waited on)


def test_the_models_init_is_the_same_on_one_thread_and_many(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_config("qwen3", tied=False, layers=2).save_pretrained(tmp_path)
    adapter = HFAdapter.from_dir(tmp_path)

    def init(threads: int) -> dict[str, torch.Tensor]:
        monkeypatch.setattr(hf_load, "default_threads", lambda: threads)
        store = HostStore.create(adapter.group_specs(), staging_slots=2)
        hf_load.init_weights(adapter, store, 5)
        return {n: store.param(n).clone() for _, n in adapter.iter_params()}

    one, many = init(1), init(4)
    assert all(torch.equal(one[n], many[n]) for n in one)
    layer0 = [n for n in one if n.startswith("model.layers.0.") and n.endswith("q_proj.weight")]
    layer1 = [n.replace("layers.0.", "layers.1.") for n in layer0]
    assert not torch.equal(one[layer0[0]], one[layer1[0]])  # each layer its own scope
