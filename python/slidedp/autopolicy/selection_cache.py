"""``runtime.policy: auto``'s selection cache: what a selection chose (the chosen run's
``Plan.to_json``: layout, resident layers, chunk, routes) and what it said (validated step
times, stage times, break-even), kept as ``selection-KEY.json`` beside the measurement caches
(``profile.cache``); an entry of an older format is selected again.

Invariants: the key covers everything that can change the choice (the cached measurement
reports, ``config.json``, batch, sequence, dtype, clipping, world size, GPU and its memory,
``PROGRAM_REVISION``, the runtime keys but ``KEY_EXEMPT``); a hit runs no profile, probe, solve
nor trial; a stale key is another file; an unreadable file is said in one line and rewritten.
Free host (or CPU) memory is not in the key: the preflight estimate checks a cached choice too.

Example::

    hit = read_selection(facts, layers=28, routes=[], say=print)   # None: select
    write_selection(facts, Selection(plan.to_json(), line, 12.3, {"solve": 12.3}))
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidedp.autopolicy.chunk_choice import chunk_skipped, probe_terms
from slidedp.autopolicy.clock import Clock
from slidedp.errors import ConfigError
from slidedp.plan.machine import Machine, update_threads
from slidedp.plan.policy import Plan, layer_numel
from slidedp.plan.predict import Route
from slidedp.plan.resolve import resolve_plan
from slidedp.profile.cache import cache_file, cache_key, read_report, write_report
from slidedp.profile.chunks import cached_chunks
from slidedp.profile.host import cached_host
from slidedp.profile.layer import ProfileSpec, cached_profile, profile_spec
from slidedp.profile.links import cached_links

if TYPE_CHECKING:
    from slidedp.autopolicy.validate import Validation
    from slidedp.config import TrainConfig
    from slidedp.models.hf import HFAdapter

KIND = "selection"
# what the program counts, by revision: a selection cached before a change to it (2: the host
# memory the offloaded activations may pin; 3: the resident update's device time, and every
# rank's process in the host budget of several ranks; 4: the chunk stage; 5: the calibration
# against the default's spread, a chunk 10% faster; 6: the entry is the chosen run's Plan) is
# made afresh, not reused
PROGRAM_REVISION = 6
# runtime keys that cannot change the choice: what auto writes, the cache's own switch, where
# the nodes meet, tracing, and the version wait
KEY_EXEMPT = frozenset({"layers", "offload_ratio", "resident_layers", "resident_embeddings",
                        "policy", "policy_force",
                        "node_rank", "master_addr", "master_port", "trace_path", "trace_step",
                        "version_timeout_s"})  # fmt: skip


def _digest(report: dict[str, Any]) -> str:
    """A measurement's identity: its facts and results (not where it was read from)."""
    return cache_key({k: v for k, v in report.items() if k != "cached"})


def _model_config_digest(cfg: TrainConfig) -> str:
    text = (Path(cfg.model.path) / "config.json").read_bytes()
    return hashlib.sha256(text).hexdigest()[:16]


def selection_facts(
    cfg: TrainConfig,
    *,
    profile: dict[str, Any],
    host: dict[str, Any],
    links: dict[str, Any] | None,
    chunks: dict[str, Any] | None = None,
    gpu_total_bytes: int | None,
    resident: bool,
    routes: list[Route],
) -> dict[str, Any]:
    """The key's facts: the measurements the choice rests on and the run's terms that enter
    the solve, the validation and the routes (``routes``: the candidates auto chooses among)."""
    rt = cfg.runtime.flat()
    return {
        "program": PROGRAM_REVISION,
        "profile": _digest(profile),
        "host": _digest(host),
        "links": None if links is None else _digest(links),
        "chunks": None if chunks is None else _digest(chunks),
        "model_config": _model_config_digest(cfg),
        "model_overrides": cfg.model.config_overrides(),
        "batch_per_rank": cfg.train.global_batch_size // cfg.runtime.launch.world,
        "seq_len": cfg.data.seq_len,
        "dtype": cfg.train.dtype,
        "clipping": cfg.train.max_grad_norm > 0,
        "freeze": sorted(cfg.train.freeze),  # frozen layers have no update to place
        "world": cfg.runtime.launch.world,
        "gpu": profile.get("gpu"),
        "gpu_total_bytes": gpu_total_bytes,
        "resident": resident,
        "routes": [list(r) for r in routes],
        "runtime": {k: v for k, v in sorted(rt.items()) if k not in KEY_EXEMPT},
    }


@dataclass(frozen=True)
class Selection:
    """What a selection chose (the chosen run's ``Plan.to_json``) and said."""

    plan: dict[str, Any]  # the plan of the run with the choice (its policy is the choice)
    line: str  # the banner line the selection printed
    selection_s: float
    timing_s: dict[str, float] = dataclasses.field(default_factory=dict)  # by stage
    validation: dict[str, Any] | None = None  # autopolicy.validate's trials (None: not validated)
    break_even_steps: int | None = None
    selected_at: str = ""  # UTC, as written

    def hit_line(self, path: Path) -> str:
        """The banner line of a run that takes this selection from ``path``."""
        return (
            f"{self.line}; from the cache {path} (selected {self.selected_at} in "
            f"{self.selection_s:.1f} s; runtime.policy_force=true selects again)"
        )


def selection_file(facts: dict[str, Any]) -> Path:
    return cache_file(None, KIND, facts)


def _parse(
    report: dict[str, Any] | None, facts: dict[str, Any], layers: int, routes: list[Route]
) -> Selection:
    """The cached selection of ``facts``; raises ``ValueError`` or ``KeyError`` or
    ``TypeError`` or ``ConfigError`` on anything that does not fit the run (an entry of an
    older slidedp: not a plan)."""
    if report is None:
        raise ValueError("not a JSON object")
    if report["facts"] != facts:
        raise ValueError("written for another key")
    policy = Plan.from_json(report["plan"], "the entry's plan").policy
    if len(policy.layers) != layers or not 0 <= policy.resident_layers <= layers:
        raise ValueError(f"layers {policy.layout!r} do not fit the model's {layers}")
    route = (policy.param_route, policy.grad_route)
    if routes and route not in routes:
        raise ValueError(f"route {route!r} is not one auto may take here")
    line, seconds = report["line"], float(report["selection_s"])
    if not isinstance(line, str) or not math.isfinite(seconds):
        raise ValueError("no banner line or selection time")
    return Selection(report["plan"], line, seconds, dict(report["timing_s"]),
                     report["validation"], report["break_even_steps"],
                     str(report["selected_at"]))  # fmt: skip


def read_selection(
    facts: dict[str, Any], *, layers: int, routes: list[Route], say: Callable[[str], None]
) -> tuple[Selection, Path] | None:
    """The cached selection of ``facts`` and its file, or None: none cached, or a file that
    does not read (said in one line; the new selection rewrites it)."""
    path = selection_file(facts)
    if not path.exists():
        return None
    try:
        return _parse(read_report(path), facts, layers, routes), path
    except (ValueError, KeyError, TypeError, IndexError, ConfigError) as e:
        say(f"policy   auto: the cached selection {path} does not read ({e}): selecting again")
        return None


def write_selection(facts: dict[str, Any], selection: Selection) -> Path:
    """Written atomically (``profile.cache.write_report``); returns the file."""
    path = selection_file(facts)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    fields = dataclasses.asdict(dataclasses.replace(selection, selected_at=stamp))
    write_report(path, {"facts": facts} | fields)
    return path


@dataclass(frozen=True)
class KeyTerms:
    """What a selection's key covers beside the run: whether layers may be GPU-resident, the
    routes it chose among, and the layer profile it rests on (None: the run's own)."""

    resident: bool
    routes: list[Route]
    profile: ProfileSpec | None = None


def selection_key(
    cfg: TrainConfig,
    adapter: HFAdapter,
    machine: Machine,
    terms: KeyTerms,
) -> dict[str, Any] | None:
    """The selection cache's key for ``cfg`` from the cached measurements (None: the layer
    profile of ``terms.profile``, default ``profile_spec(cfg)``, or the host probe is not
    cached, so a selection measures)."""
    routes = terms.routes
    report = cached_profile(terms.profile or profile_spec(cfg))
    gpu = machine.gpu_name if machine.device == "cuda" else None
    threads = update_threads(cfg, machine)
    host = cached_host(threads, gpu, ranks=cfg.runtime.launch.world)
    if report is None or host is None:
        return None
    links = chunks = None
    if routes and gpu is not None:
        links = cached_links(cfg.runtime.launch.world, gpu, layer_numel(adapter))
    if gpu is not None and chunk_skipped(cfg.runtime, machine) is None:  # the stage chooses
        numel, _, mirror = probe_terms(cfg, adapter, machine)
        chunks = cached_chunks(threads, gpu, numel, mirror)
        if chunks is None:
            return None
    return selection_facts(cfg, profile=report, host=host, links=links, chunks=chunks,
                           resident=terms.resident, gpu_total_bytes=machine.gpu_total_bytes,
                           routes=routes)  # fmt: skip


def from_cache(
    cfg: TrainConfig, found: Selection, path: Path, whole_layer: int
) -> tuple[TrainConfig, str]:
    """``cfg`` with the cached selection ``found`` (read from ``path``) and its banner line:
    its layout and residency, on several ranks its routes, and a chunk other than the whole
    layer (``whole_layer`` elements) with its gradient ring; the rest stays the config's."""
    policy = Plan.from_json(found.plan, str(path)).policy
    keys: dict[str, Any] = {
        "layers": policy.layout,
        "resident_layers": policy.resident_layers,
        "resident_embeddings": policy.resident_embeddings,
    }
    if cfg.runtime.launch.world > 1:
        keys |= {"param_route": policy.param_route, "grad_route": policy.grad_route}
    if policy.chunk_elems != whole_layer:
        keys |= {"chunk_elems": policy.chunk_elems, "grad_slots": policy.grad_slots}
    return dataclasses.replace(cfg, runtime=cfg.runtime.with_keys(**keys)), found.hit_line(path)


def store_selection(
    cfg: TrainConfig,
    chosen: TrainConfig,
    adapter: HFAdapter,
    machine: Machine,
    line: str,
    clock: Clock,
    validation: Validation | None,
    terms: KeyTerms,
) -> None:
    """``chosen`` cached under ``cfg``'s key, of the measurements it rests on (as cached now);
    a cache that cannot be written is said in one line, and the run goes on."""
    facts = selection_key(cfg, adapter, machine, terms)
    if facts is None:  # a measurement not in the cache (a profile given by hand): no key
        return
    plan = resolve_plan(chosen, adapter, machine)
    found = Selection(
        plan.to_json(),
        line,
        clock.total_s,
        dict(clock.seconds),
        None if validation is None else validation.summary(),
        None if validation is None else validation.break_even_steps(clock.total_s),
    )
    try:
        write_selection(facts, found)
    except OSError as e:
        print(f"policy   auto: the selection is not cached ({e})", flush=True)
