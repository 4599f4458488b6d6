"""Which checkpoint a run continues from: decided, and the checkpoint checked, before anything is
allocated or written (``slidedp validate`` and ``slidedp train`` both call ``plan_resume``).

``train.resume``: ``""`` starts afresh (refused when ``output.dir`` holds a checkpoint), ``auto``
takes the newest intact checkpoint (none: a new run), a path takes that one. A checkpoint is
damaged when its manifest (``io.manifest``), or for older ones its list of needed files, says a
file is missing or changed, or when its states or a safetensors header cannot be read.
Invariants: ``auto`` skips damaged newer checkpoints with one warning line; a damaged one named
by path is refused, naming the previous intact one; a damaged one past the resumed step is
renamed ``checkpoint-STEP.damaged`` when the run saves that step, never written into.

A launcher decides once for its ranks: ``write_resume_decision`` hands its ``plan_resume``
answer (the checkpoint checked, its damaged successors and the warning) to the ranks, which load
it as it is (``read_resume_decision``) instead of reading the checkpoint's files again.

Example::

    point = plan_resume(cfg.train, cfg.data, Path(cfg.output.dir), adapter)  # None: a new run
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slidedp.config import TrainSection
from slidedp.data.config import DataSection
from slidedp.errors import CheckpointError
from slidedp.io.best import BestCheckpoint
from slidedp.io.checkpoint import (
    FORMAT,
    LATEST,
    OPTIMIZER_DIR,
    RNG_FILE,
    STATE_FILE,
    Progress,
    checkpoint_dirs,
    load_tensors,
    tensor_plan,
)
from slidedp.io.manifest import MANIFEST, checksum_problem, read_manifest, size_problem
from slidedp.models.hf import HFAdapter
from slidedp.runtime.schedule import lr_schedule
from slidedp.store import HostStore

_PROGRESS_FIELDS = ("step", "adam_step", "skipped_steps", "consecutive_skips")
RESUME_DECISION = "resume.json"  # the launcher's decision, beside its plan file
_RNG_FIELDS = {"python": list, "numpy": list, "torch": str, "cuda": list}


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    progress: Progress
    rng: dict[str, Any]
    # one line each: the damaged checkpoints skipped, and why; what changed since the checkpoint
    warnings: tuple[str, ...]
    set_aside: tuple[Path, ...]  # damaged checkpoints past ``path``: renamed when re-saved


@dataclass(frozen=True)
class ResumeDecision:
    """``plan_resume``'s answer, taken once by a launcher for its ranks (``point`` None: a new
    run); a rank given one loads ``point`` without checking the checkpoint again."""

    point: ResumePoint | None


def write_resume_decision(point: ResumePoint | None, directory: Path) -> Path:
    """``directory/resume.json``: ``point`` as the ranks read it back (``read_resume_decision``)."""
    saved = None
    if point is not None:
        saved = {
            "path": str(point.path),
            "progress": asdict(point.progress),
            "rng": point.rng,
            "warnings": list(point.warnings),
            "set_aside": [str(p) for p in point.set_aside],
        }
    file = directory / RESUME_DECISION
    file.write_text(json.dumps({"resume": saved}))
    return file


def read_resume_decision(file: Path) -> ResumeDecision:
    """The decision ``write_resume_decision`` wrote in ``file`` (the launcher's, to its ranks)."""
    saved = json.loads(file.read_text())["resume"]
    if saved is None:
        return ResumeDecision(None)
    point = ResumePoint(Path(saved["path"]), Progress(**saved["progress"]), saved["rng"],
                        tuple(saved["warnings"]),
                        tuple(Path(p) for p in saved["set_aside"]))  # fmt: skip
    return ResumeDecision(point)


def _read_json(path: Path, name: str) -> dict[str, Any]:
    """``path/name`` as a JSON object; ``ValueError`` saying what is wrong with it."""
    try:
        value = json.loads((path / name).read_text())
    except FileNotFoundError:
        raise ValueError(f"{name} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name} is unreadable ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} is not a JSON object")
    return value


def _read_state(path: Path) -> dict[str, Any]:
    """The trainer state with every field resuming reads (``ValueError`` naming a missing one);
    a state of another format is a ``CheckpointError``."""
    state = _read_json(path, STATE_FILE)
    if "format" in state and state["format"] != FORMAT:
        raise CheckpointError(
            f"{path} has checkpoint format {state['format']!r}, this slidedp reads {FORMAT}"
        )
    progress, train = state.get("progress"), state.get("train")
    progress = progress if isinstance(progress, dict) else {}
    train = train if isinstance(train, dict) else {}
    fields = {
        "format": state.get("format"),
        **{f"progress.{k}": progress.get(k) for k in _PROGRESS_FIELDS},
        "train.global_batch_size": train.get("global_batch_size"),
    }
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{STATE_FILE} lacks '{name}' (or it is not a count)")
    data = state.get("data", {})
    if not isinstance(data, dict) or not isinstance(data.get("order", {}), dict):
        raise ValueError(f"{STATE_FILE}'s 'data' is not a JSON object of the data keys")
    return state


def _read_rng(path: Path) -> dict[str, Any]:
    rng = _read_json(path, RNG_FILE)
    for name, kind in _RNG_FIELDS.items():
        if not isinstance(rng.get(name), kind):
            raise ValueError(f"{RNG_FILE} lacks '{name}'")
    return rng


@dataclass(frozen=True)
class _Checked:
    state: dict[str, Any]
    rng: dict[str, Any]


def _check(path: Path, adapter: HFAdapter, checksums: bool) -> _Checked:
    """Checkpoint ``path``'s files: ``ValueError`` saying what is damaged (``CheckpointError``
    when its manifest vouches for its files but they do not fit this model or config)."""
    manifest = read_manifest(path)
    if manifest is not None:
        problem = (checksum_problem if checksums else size_problem)(path, manifest)
        if problem is not None:
            raise ValueError(problem)
    try:
        checked = _Checked(_read_state(path), _read_rng(path))
        tensor_plan(path, adapter)
        return checked
    except ValueError as unreadable:  # the checksums may name the file that changed
        found = None if manifest is None or checksums else checksum_problem(path, manifest)
        if manifest is not None and found is None and isinstance(unreadable, CheckpointError):
            raise  # intact, but of another model, format or freeze: not damage
        # (without a manifest nothing tells another model's tensors from garbled ones: damage)
        raise ValueError(found or str(unreadable)) from None


def _cheap_problem(path: Path) -> str | None:
    """What the cheap checks (manifest sizes, trainer state) find wrong with ``path``."""
    try:
        manifest = read_manifest(path)
        problem = None if manifest is None else size_problem(path, manifest)
        if problem is None:
            _read_state(path)
    except (ValueError, CheckpointError) as e:
        return str(e)
    return problem


def _step(path: Path) -> int | None:
    name = path.name.removeprefix("checkpoint-")
    return int(name) if name.isdigit() else None


def _damaged(path: Path, problem: str) -> CheckpointError:
    """The refusal of a damaged checkpoint named by path, pointing at the previous intact one."""
    step = _step(path)
    earlier = [
        p
        for p in checkpoint_dirs(path.parent)
        if p != path and (step is None or (_step(p) or 0) < step) and _cheap_problem(p) is None
    ]
    fix = (
        f"resume from the previous checkpoint with train.resume={earlier[-1]} (or "
        "train.resume=auto, which skips a damaged newest checkpoint)"
        if earlier
        else "no intact checkpoint precedes it: start afresh with another output.dir"
    )
    return CheckpointError(f"checkpoint {path} is damaged: {problem}; {fix}")


def _resumable(
    path: Path, state: dict[str, Any], train: TrainSection, data: DataSection
) -> Progress:
    """The progress to continue from, or one clear error when this config cannot continue."""
    progress = Progress(**{k: state["progress"][k] for k in _PROGRESS_FIELDS})
    if progress.step > train.max_steps:
        raise CheckpointError(
            f"{path.name} is at step {progress.step}, beyond train.max_steps={train.max_steps}: "
            "raise train.max_steps or resume from an earlier checkpoint"
        )
    # what batch(t) and the held-out split depend on besides the files (a checkpoint of an
    # older format keeps no data.order: its data keys are not compared)
    order = state.get("data", {}).get("order", {})
    saved = {f"data.{k}": v for k, v in order.items()} | {
        f"train.{k}": v for k, v in state["train"].items() if k in ("global_batch_size", "seed")
    }
    now = {f"data.{k}": v for k, v in data.order_keys().items()} | {
        "train.global_batch_size": train.global_batch_size,
        "train.seed": train.seed,
    }
    for key, value in saved.items():
        if key in now and now[key] != value:
            raise CheckpointError(
                f"{path.name} was trained with {key}={json.dumps(value)}, this config has "
                f"{json.dumps(now[key])}: the data would not continue where it stopped (nor "
                "keep its held-out samples out of training); set it back"
            )
    return progress


def _newest_intact(
    existing: list[Path], adapter: HFAdapter, checksums: bool
) -> tuple[Path, _Checked, list[tuple[Path, str]]]:
    """``auto``: the newest checkpoint that passes ``_check``, and the damaged ones skipped."""
    skipped: list[tuple[Path, str]] = []
    for path in reversed(existing):
        try:
            return path, _check(path, adapter, checksums), skipped
        except CheckpointError:  # the run's checkpoints do not fit this config: none would
            raise
        except ValueError as damage:
            skipped.append((path, str(damage)))
    newest, problem = skipped[0]
    raise CheckpointError(
        f"every checkpoint in {newest.parent} is damaged (the newest, {newest.name}: {problem}); "
        "move them away to start afresh, or choose another output.dir"
    )


def _named(resume: str, adapter: HFAdapter, checksums: bool) -> tuple[Path, _Checked]:
    """A checkpoint given by path (or an output directory: the one its ``latest`` names, as
    ``slidedp export`` takes it), checked; a damaged one is refused."""
    path = Path(resume)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    looks_like_one = any((path / f).exists() for f in (STATE_FILE, MANIFEST, OPTIMIZER_DIR))
    if not path.is_dir() or not looks_like_one:
        raise CheckpointError(
            f"train.resume={resume} is not a slidedp checkpoint (no {STATE_FILE}): give a "
            "checkpoint-STEP directory, an output directory (its latest), auto, or '' to start "
            "afresh"
        )
    try:
        return path, _check(path, adapter, checksums)
    except CheckpointError:  # intact, but of another model, format or freeze: not damage
        raise
    except ValueError as damage:
        raise _damaged(path, str(damage)) from None


def plan_resume(
    train: TrainSection, data: DataSection, out_dir: Path, adapter: HFAdapter
) -> ResumePoint | None:
    """The checkpoint to continue from, checked, or None for a new run; one ``CheckpointError``
    naming the checkpoint, the file and the fix when this run cannot start as configured."""
    existing = checkpoint_dirs(out_dir)
    if train.resume == "" and existing:
        raise CheckpointError(
            f"{out_dir} already holds {existing[-1].name}: set train.resume=auto to continue "
            "from it, or choose another output.dir (a new run never overwrites checkpoints)"
        )
    if train.resume == "" or (train.resume == "auto" and not existing):
        return None
    skipped: list[tuple[Path, str]] = []
    if train.resume == "auto":
        path, checked, skipped = _newest_intact(existing, adapter, train.verify_checksums)
    else:
        path, checked = _named(train.resume, adapter, train.verify_checksums)
    progress = _resumable(path, checked.state, train, data)
    best = BestCheckpoint(out_dir, data.eval_path) if data.has_eval else None
    changed = (_schedule_change(path, checked.state, train, progress.step),
               _data_change(path, checked.state, data),
               None if best is None else best.changed)  # fmt: skip
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file():
        kept_records(metrics, progress.step)  # refused here, before anything is written
    for other in existing:
        if other in dict(skipped) or other.resolve() == path.resolve():
            continue
        if (_step(other) or 0) >= progress.step:
            problem = _cheap_problem(other)
            if problem is None:
                raise CheckpointError(
                    f"{out_dir} holds {other.name}, not older than the resumed {path.name}: a "
                    "checkpoint is never overwritten; move it away or resume from it"
                )
            skipped.append((other, problem))
    warnings = tuple(w for w in (_skipped_warning(path, skipped), *changed) if w)
    return ResumePoint(path, progress, checked.rng, warnings, tuple(p for p, _ in skipped))


def kept_records(path: Path, start: int) -> list[str]:
    """The lines of the run's ``metrics.jsonl`` (``path``) that its resume after step ``start``
    keeps. A last line cut short (no newline, not a record: the process died writing it) is of
    a step after the checkpoint's, as every record past ``start``, and goes with them."""
    raw = path.read_bytes()
    lines = raw.splitlines()
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            step = json.loads(line)["step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise TypeError(step)
        except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
            if number == len(lines) and not raw.endswith(b"\n"):
                break
            raise CheckpointError(
                f"{path}:{number} is not a step record; mend or remove that line to resume (the "
                "checkpoint holds the state, this file the log of its steps)"
            ) from None
        if step <= start:
            kept.append(line.decode())
    return kept


def _skipped_warning(path: Path, skipped: list[tuple[Path, str]]) -> str | None:
    if not skipped:
        return None
    damaged = ", ".join(f"{p.name} ({problem})" for p, problem in skipped)
    return (
        f"damaged {damaged}: skipped, resuming from {path}; a damaged checkpoint is renamed "
        "checkpoint-STEP.damaged when this run saves that step"
    )


_SCHEDULE_KEYS = {  # train.KEY: its name in a checkpoint's lr_schedule
    "lr_scheduler": "name",
    "learning_rate": "learning_rate",
    "warmup_steps": "warmup_steps",
    "max_steps": "max_steps",
}


def _schedule_change(
    path: Path, state: dict[str, Any], train: TrainSection, step: int
) -> str | None:
    """The line saying which of the optimizer's keys differ from the checkpoint's run, and the
    learning rate the run continues at where the schedule changed it; None when none did. A
    field an older (or edited) checkpoint lacks is not compared."""
    now: dict[str, Any] = {key: getattr(train, key) for key in _SCHEDULE_KEYS}
    before: dict[str, Any] = dict.fromkeys(now)
    saved = state.get("lr_schedule")
    if isinstance(saved, dict):
        before = {key: saved.get(name) for key, name in _SCHEDULE_KEYS.items()}
    changes = [key for key in now if before[key] is not None and now[key] != before[key]]
    if before["lr_scheduler"] == now["lr_scheduler"] == "constant":  # no decay to the end
        changes = [key for key in changes if key != "max_steps"]
    lr_now = lr_schedule(*now.values())(step)
    try:
        lr_then: float | None = lr_schedule(*before.values())(step)
    except (KeyError, TypeError, ValueError):  # not a schedule this slidedp knows
        lr_then = None
    for key, was in _saved_optim(state).items():
        if was is not None and getattr(train, key) != was:
            changes.append(key)
            before[key], now[key] = was, getattr(train, key)
    if not changes:
        return None
    said = ", ".join(f"train.{key} {before[key]} -> {now[key]}" for key in changes)
    if lr_then is not None and lr_now != lr_then:
        said += (f": step {step + 1} trains at learning rate {lr_now:.4g} where the "
                 f"checkpoint's schedule gives {lr_then:.4g}")  # fmt: skip
    return f"resuming {path.name} with {said}"


def _saved_optim(state: dict[str, Any]) -> dict[str, Any]:
    """The AdamW keys of the checkpoint's plan, by their ``train.KEY`` (None: not recorded)."""
    plan = state.get("plan")
    optim = plan.get("optim") if isinstance(plan, dict) else None
    optim = optim if isinstance(optim, dict) else {}
    betas = optim.get("betas")
    beta1, beta2 = betas if isinstance(betas, list) and len(betas) == 2 else (None, None)
    return {
        "weight_decay": optim.get("weight_decay"),
        "adam_beta1": beta1,
        "adam_beta2": beta2,
        "adam_epsilon": optim.get("eps"),
        "max_grad_norm": optim.get("max_grad_norm"),
    }


def _data_change(path: Path, state: dict[str, Any], data: DataSection) -> str | None:
    """The line saying the data files differ from the checkpoint's run (a file moved resumes
    as it is: the order depends on ``order_keys`` alone); None when they do not. Paths are
    compared resolved (from this working directory: a relative one the same only as written)."""
    saved = state.get("data")
    saved = saved if isinstance(saved, dict) else {}
    sources = saved.get("sources")
    sources = sources if isinstance(sources, list) else []
    before = [saved["path"]] if isinstance(saved.get("path"), str) and saved["path"] else [
        s["path"] for s in sources if isinstance(s, dict) and isinstance(s.get("path"), str)
    ]  # fmt: skip
    now = [s.path for s in data.source_specs()]

    def resolved(paths: list[str]) -> list[Path]:
        return [Path(p).expanduser().resolve() for p in paths]

    if not before or resolved(before) == resolved(now):
        return None
    return (
        f"resuming {path.name}, trained on {', '.join(before)}, on {', '.join(now)}: it "
        f"continues at step {saved.get('next_step', '?')} of this data's order (right for a "
        "file moved; another file's samples differ)"
    )


def load_resume_point(point: ResumePoint, adapter: HFAdapter, store: HostStore) -> None:
    """The checkpoint's tensors into ``store``; a file that cannot be read is reported as
    damage (the checksums name the file that changed, when the manifest has them)."""
    try:
        load_tensors(point.path, adapter, store)
    except ValueError as unreadable:
        manifest = read_manifest(point.path)
        found = None if manifest is None else checksum_problem(point.path, manifest)
        raise _damaged(point.path, found or str(unreadable)) from None
