"""The ``slidedp`` command.

Run: ``slidedp train CONFIG.yaml [section.key=value ...]`` (e.g. ``train.max_steps=5``),
``slidedp validate CONFIG.yaml [section.key=value ...]`` (every check, no GPU work),
``slidedp estimate CONFIG.yaml [section.key=value ...] [--json]`` (memory and step time),
``slidedp env [--json]``, ``slidedp export OUTPUT/checkpoint-STEP OUT_DIR``,
``slidedp bench kernels [--numel N --threads 1,2,4]``.

Bad input never shows a traceback: a ``SlidedpError`` is one line ``slidedp VERB: error: ...``
on stderr naming the problem and the fix (a config with several problems: a header line, then
one line per problem) and exit code 2; any other exception is one line with a hint to rerun with
``--debug`` (which prints the traceback) and exit code 1; Ctrl-C is exit code 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slidedp import __version__
from slidedp.autopolicy import command as plan_command
from slidedp.bench import kernels as bench_kernels
from slidedp.bench import model as bench_model
from slidedp.bench import nodes as bench_nodes
from slidedp.bench import plot as bench_plot
from slidedp.bench import predict as bench_predict
from slidedp.bench import train as bench_train
from slidedp.config import TrainConfig
from slidedp.errors import ConfigError, SlidedpError, TrainingInterruptedError
from slidedp.io.run_lock import RunLock
from slidedp.plan.device import prefer_expandable_segments
from slidedp.plan.given import take_plan
from slidedp.plan.policy import Plan, write_plan
from slidedp.profile import chunks as profile_chunks
from slidedp.profile import host as profile_host
from slidedp.profile import layer as profile_layer
from slidedp.runtime.dist import Dist
from slidedp.runtime.launch import LAUNCHER_PID
from slidedp.runtime.zygote import Children, can_fork, children_forked

if TYPE_CHECKING:
    from slidedp.io.resume import ResumeDecision

EXIT_BAD_INPUT = 2
EXIT_UNEXPECTED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
# The bench verbs whose children (workers, probes, nodes) fork from one zygote, and what a
# spawned zygote imports before its first fork (a forked one has this process's imports)
FORKING_BENCHES = {"train", "nodes", "predict"}
CHILD_IMPORTS = ("slidedp.cli", "slidedp.bench.worker")


def _train(
    config: str,
    overrides: list[str],
    plan_file: str | None = None,
    *,
    own_process: bool = False,
    resume_file: str | None = None,
) -> int:
    """Resolve and print the config, lock ``output.dir`` (``io.run_lock``), check the inputs,
    build everything (model, store, data), save ``resolved_config.yaml``, then train. A run
    refused before that save leaves ``output.dir`` as it was, lock file included.
    ``plan_file``: the plan to run (``Plan.to_json``; the launcher's to its ranks), its values
    the config's keys (``plan.given.take_plan``), run on a resume in place of the checkpoint's.
    ``resume_file``: the launcher's resume decision (``io.resume.write_resume_decision``),
    taken as it is. A launcher's children (AutoPolicy's measurements and trials, the ranks)
    fork from one zygote (``runtime.zygote``) taken before it computes anything: a copy of
    this process when ``own_process`` (it runs this command alone: ``main`` without argv),
    else a spawned interpreter."""
    from slidedp.config import load_config
    from slidedp.io.resume import read_resume_decision
    from slidedp.preflight import check_output_dir
    from slidedp.runtime.dist import Dist

    cfg, plan = load_config(config, overrides), None
    if plan_file is not None:  # its keys in the config: checked, recorded and run as it says
        cfg, plan = take_plan(cfg, Path(plan_file))
    decided = None if resume_file is None else read_resume_decision(Path(resume_file))
    ctx = Dist.from_env()
    launches = ctx is None and (cfg.runtime.launch.world > 1 or cfg.runtime.launch.nodes > 1)
    with contextlib.ExitStack() as stack:
        # before the lock and any computing: a launcher's children (AutoPolicy's measurements
        # and trials, the ranks) fork from it, and one GPU's trial child where it costs a fork
        children = children_forked(CHILD_IMPORTS, own_process=own_process)
        one_gpu = ctx is None and own_process and cfg.runtime.launch.device != "cpu"
        forks = launches or (one_gpu and can_fork())
        forked = stack.enter_context(children) if forks else None
        lock = None
        if _holds_run_lock(ctx, cfg.runtime.launch.node_rank):
            check_output_dir(cfg)  # never a lock file in a model directory or a file's place
            lock = RunLock.acquire(Path(cfg.output.dir))
        # the user's plan file (a rank of this launcher gets the launcher's: it says nothing of it)
        source = plan_file if LAUNCHER_PID not in os.environ else None
        try:
            given = _Given(plan, source, decided)
            return _train_locked(config, overrides, cfg, (ctx, forked), lock, given)
        finally:
            if lock is not None:
                lock.release()


@dataclass(frozen=True)
class _Given:
    """What a ``slidedp train`` process is handed: the plan to run and the user's file it came
    from (``--plan``), and its launcher's resume decision (``--resume-point``), or None."""

    plan: Plan | None
    source: str | None
    decided: ResumeDecision | None


def _holds_run_lock(ctx: Dist | None, node_rank: int) -> bool:
    """The process that holds the run's lock: this one alone, ``slidedp train`` starting the
    ranks of node 0, or global rank 0 where another launcher (torchrun) started the ranks."""
    if ctx is None:
        return node_rank == 0
    return ctx.main and LAUNCHER_PID not in os.environ


def _train_locked(
    config: str,
    overrides: list[str],
    cfg: TrainConfig,
    process: tuple[Dist | None, Children | None],
    lock: RunLock | None,
    given: _Given,
) -> int:
    """``_train`` once the lock is held; ``process``: this rank (None: no launcher started
    this process) and where its children fork from (``runtime.zygote.Children``), or None.
    A launcher checks the resume point once and hands its decision to the ranks."""
    from slidedp.config import RESOLVED_CONFIG, resolved_yaml, write_resolved_config
    from slidedp.io.resume import write_resume_decision
    from slidedp.preflight import check_before_training

    plan, source, decided = given.plan, given.source, given.decided
    ctx, children = process

    def refused() -> None:
        if lock is not None:
            lock.release(refused=True)

    rt = cfg.runtime
    # start the ranks (each runs this verb)
    if ctx is None and (rt.launch.world > 1 or rt.launch.nodes > 1):
        from slidedp.runtime.launch import Node, launch

        # a refusal is one line, before any rank starts; the plan is decided here, once
        # (runtime.policy=auto: its measurements in a child process), and every rank runs it
        try:
            checked = check_before_training(cfg, measure_policy=True, plan=plan, plan_source=source)
        except BaseException:
            refused()
            raise
        if checked.policy_line:
            print(checked.policy_line, flush=True)
        node = Node(
            rt.launch.nodes, rt.launch.node_rank, rt.launch.master_addr, rt.launch.master_port
        )
        with tempfile.TemporaryDirectory(prefix="slidedp-plan-") as tmp:
            plan_file = write_plan(checked.plan, Path(tmp))
            resume_file = write_resume_decision(checked.resume, Path(tmp))
            argv = ["train", config, *overrides, "--plan", str(plan_file),
                    "--resume-point", str(resume_file)]  # fmt: skip
            several_nodes = node if rt.launch.nodes > 1 else None
            zygote = None if children is None else children.zygote()
            return launch(rt.launch.world, argv, node=several_nodes, zygote=zygote)
    if ctx is not None and not ctx.main:  # rank 0 prints, checks and writes
        from slidedp.runtime.trainer import Trainer

        Trainer(cfg, plan=plan, decided=decided).run()
        return 0
    saved_as = f"{cfg.output.dir}/{RESOLVED_CONFIG}"  # written once every check passed
    print(f"slidedp train: resolved config (saved as {saved_as} if the checks pass):")
    print(resolved_yaml(cfg), end="", flush=True)
    try:
        checked = check_before_training(
            cfg, measure_policy=True, plan=plan, plan_source=source, decided=decided
        )
        if children is not None:  # AutoPolicy's trials are done: nothing else forks
            children.close()
        cfg = checked.cfg  # runtime.policy=auto: the chosen layout (saved as it ran)
        if checked.policy_line:
            print(checked.policy_line, flush=True)
        _warn("train", checked.warnings)
        from slidedp.runtime.trainer import Trainer  # the engine: once the inputs are good

        trainer = Trainer(cfg, plan=checked.plan, checked=checked)
        trainer.trackers  # noqa: B018  opened now: a tracker that cannot start is a refusal
    except BaseException:
        refused()
        raise
    write_resolved_config(cfg)  # only once every input is known good
    trainer.run()
    return 0


def _validate(config: str, overrides: list[str]) -> int:
    from slidedp.config import load_config
    from slidedp.preflight import validate

    checked = validate(load_config(config, overrides))
    _warn("validate", checked.warnings)
    print(f"slidedp validate: OK ({config})")
    for line in checked.lines:
        print(f"  {line}")
    return 0


def _warn(verb: str, warnings: tuple[str, ...]) -> None:
    for warning in warnings:
        print(f"slidedp {verb}: warning: {warning}", file=sys.stderr, flush=True)


def _estimate(
    config: str, overrides: list[str], as_json: bool, explain: bool, longest: bool, gpus: int
) -> int:
    """Print the estimate, then refuse what ``validate`` and ``train`` refuse: a run this
    machine cannot hold is their error line (``check_fits``: the numbers and the fixes),
    exit code 2, after the table or the JSON."""
    from slidedp.autopolicy.auto import resolve_auto
    from slidedp.cli_args import quiet_closed_stdout
    from slidedp.config import load_config
    from slidedp.estimate import check_fits
    from slidedp.estimate_report import estimate_run, longest_sequence, print_estimate
    from slidedp.plan.machine import Machine
    from slidedp.preflight import apply_default_policy, check_model, check_run_shape

    given = [f"runtime.gpus={gpus}"] if gpus else []  # may exceed this machine's: a prediction
    cfg = load_config(config, [*overrides, *given])
    adapter = check_model(cfg)[0]
    check_run_shape(cfg, adapter, here=False)  # what validate and train refuse
    machine = Machine.probe(cfg)
    if gpus and machine.device != "cuda":
        raise ConfigError(
            f"--gpus {gpus} predicts GPUs from this machine's GPU, and it has none (the run "
            f"resolves to the CPU): run it on the GPU host, or estimate CPU ranks with "
            f"runtime.ranks={gpus} runtime.device=cpu"
        )
    cfg, fallback = apply_default_policy(cfg, adapter, machine, None)
    cfg, chosen = resolve_auto(cfg, adapter, machine, measure=False)  # a cached profile only
    est = estimate_run(cfg, adapter, machine)
    found = longest_sequence(cfg, adapter, machine) if longest else None
    with quiet_closed_stdout():
        if (chosen or fallback) and not as_json:  # --json: one JSON object on stdout
            print(chosen or fallback)
        print_estimate(est, found, as_json=as_json, explain=explain)
    check_fits(est)
    return 0


def _export(checkpoint: str, out_dir: str) -> int:
    from slidedp.io.checkpoint import export_checkpoint

    print(f"slidedp export: wrote {export_checkpoint(Path(checkpoint), Path(out_dir))}")
    return 0


def _env(as_json: bool) -> int:
    from slidedp.envinfo import collect, format_text

    info = collect()
    print(json.dumps(info, indent=2) if as_json else format_text(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slidedp", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"slidedp {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    # the same flag after the verb; SUPPRESS keeps a verb's default from hiding the global one
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    verbs = parser.add_subparsers(dest="verb", required=True)
    env = verbs.add_parser("env", parents=[debug], help="versions, ISA path, memory, GPUs, links")
    env.add_argument("--json", action="store_true", help="one JSON object instead of text")
    for verb, help_text in (
        ("train", "train a model from a YAML config"),
        ("validate", "check config, model dir, data and output dir (no GPU work)"),
    ):
        sub = verbs.add_parser(verb, parents=[debug], help=help_text)
        sub.add_argument("config", help="YAML with model, data, train, output (and runtime)")
        sub.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=5")
        if verb == "train":
            sub.add_argument("--plan", default=None, metavar="PLAN.json",
                             help="run this plan (a run's plan.json), deciding none")  # fmt: skip
            # the launcher's resume decision to its ranks (io.resume.write_resume_decision)
            sub.add_argument("--resume-point", default=None, help=argparse.SUPPRESS)
    estimate = verbs.add_parser(
        "estimate", parents=[debug], help="host, /dev/shm, pinned, GPU memory and step time"
    )
    estimate.add_argument("config", help="YAML with model, data, train, output (and runtime)")
    estimate.add_argument("overrides", nargs="*", help="section.key=value, e.g. data.seq_len=4096")
    estimate.add_argument("--json", action="store_true", help="one JSON object instead of text")
    estimate.add_argument("--explain", action="store_true", help="the model's critical path")
    estimate.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="N GPUs of this host (runtime.gpus=N, more than it has too): the model on each route",
    )
    estimate.add_argument(
        "--longest-seq",
        action="store_true",
        help="the longest data.seq_len (multiple of 1024) this run fits on this machine; with "
        "runtime.context_parallel R, each sequence split over R GPUs",
    )
    export = verbs.add_parser("export", parents=[debug], help="checkpoint -> HF model directory")
    export.add_argument("checkpoint", help="OUTPUT/checkpoint-STEP, or OUTPUT (its latest)")
    export.add_argument("out_dir", help="a new directory: config, tokenizer, f32 safetensors")
    bench = verbs.add_parser("bench", help="benchmarks against in-run baselines")
    which = bench.add_subparsers(dest="bench", required=True)
    profile = verbs.add_parser("profile", help="measure the candidates of a policy")
    what = profile.add_subparsers(dest="profile", required=True)
    for under, name, module, help_text in (
        (which, "kernels", bench_kernels, "AdamW and cast vs torch"),
        (which, "train", bench_train, "ours vs reference and FSDP2"),
        (which, "plot", bench_plot, "one sweep figure from JSON reports"),
        (which, "model", bench_model, "the step-time model vs traced steps"),
        (which, "predict", bench_predict, "the step-time model vs a bench train report"),
        (verbs, "plan", plan_command, "choose the activation layout: a policy file"),
        (which, "nodes", bench_nodes, "the cross-node all-reduce: measured on CPU, predicted"),
        (what, "layer", profile_layer, "every activation layout of one layer"),
        (what, "host", profile_host, "host AdamW GB/s, alone and under DMA"),
        (what, "chunks", profile_chunks, "a layer's transfers by H2D/D2H chunk"),
    ):
        module.add_arguments(under.add_parser(name, parents=[debug], help=help_text))
    return parser


def _run(args: argparse.Namespace, own_process: bool = False) -> int:
    """Run the verb; ``own_process``: see ``_train``."""
    if args.verb == "env":
        return _env(args.json)
    if args.verb == "train":
        return _train(args.config, args.overrides, args.plan, own_process=own_process,
                      resume_file=args.resume_point)  # fmt: skip
    if args.verb == "validate":
        return _validate(args.config, args.overrides)
    if args.verb == "estimate":
        return _estimate(
            args.config, args.overrides, args.json, args.explain, args.longest_seq, args.gpus
        )
    if args.verb == "export":
        return _export(args.checkpoint, args.out_dir)
    if args.verb == "profile":
        profilers = {
            "host": profile_host.main,
            "chunks": profile_chunks.main,
            "layer": profile_layer.main,
        }
        return profilers[args.profile](args)
    if args.verb == "plan":
        return plan_command.main(args)
    bench_main = {
        "train": bench_train.main,
        "plot": bench_plot.main,
        "kernels": bench_kernels.main,
        "model": bench_model.main,
        "nodes": bench_nodes.main,
        "predict": bench_predict.main,
    }
    if args.bench not in FORKING_BENCHES:
        return bench_main[args.bench](args)
    with children_forked(CHILD_IMPORTS, own_process=own_process):  # before the bench computes
        return bench_main[args.bench](args)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _rank(args: argparse.Namespace, prefix: str) -> int:
    """One rank of a multi-rank run: on failure, wake the peers (the shared store is poisoned)
    and exit at once; a rank that only reacts to another's failure prints nothing. A stop on
    SIGTERM/SIGINT is agreed by every rank (``Trainer``): they leave together, rank 0 alone
    prints its line and exits 2, the others ``EXIT_STOPPED_WITH_PEERS``, and nothing is
    poisoned (rank 0 may still be writing the checkpoint)."""
    from slidedp.runtime.dist import EXIT_PEER_FAILED, EXIT_STOPPED_WITH_PEERS, Dist, fail, finish
    from slidedp.runtime.launch import watch_launcher

    watch_launcher()
    try:
        code = _main_guarded(args, prefix)
        if code == 0:
            finish()
            return 0
    except TrainingInterruptedError as stopped:
        ctx = Dist.from_env()
        main = ctx is None or ctx.main
        code = _report(stopped, args, prefix) if main else EXIT_STOPPED_WITH_PEERS
        try:
            finish()  # waits for rank 0's checkpoint
            return code
        except BaseException as e:  # rank 0 failed while saving
            code = EXIT_PEER_FAILED if fail(e) else EXIT_UNEXPECTED
    except BaseException as e:  # raised from the guard only when a peer failed
        code = EXIT_PEER_FAILED if fail(e) else EXIT_UNEXPECTED
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown of a broken process group or of the update threads


def _main_guarded(args: argparse.Namespace, prefix: str) -> int:
    """``_run`` with ``main``'s error reporting, except errors caused by a failed peer and an
    agreed stop on a signal (both re-raised)."""
    from slidedp.runtime.dist import fail

    try:
        return _run(args)
    except TrainingInterruptedError:
        raise
    except BaseException as e:
        if fail(e):
            raise
        return _report(e, args, prefix)


def _report(e: BaseException, args: argparse.Namespace, prefix: str) -> int:
    """One line on stderr for ``e`` (a config with several problems: one per problem)."""
    if args.debug:
        traceback.print_exc()
    if isinstance(e, KeyboardInterrupt):
        print(f"{prefix}interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if isinstance(e, SlidedpError):
        if isinstance(e, ConfigError) and len(e.problems) > 1:
            lines = [f"the config has {len(e.problems)} problems:", *e.problems]
            print(f"{prefix}error: " + "\n  ".join(lines), file=sys.stderr)
        else:
            print(f"{prefix}error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    hint = "" if args.debug else "; rerun with --debug for the traceback"
    print(f"{prefix}error: unexpected {type(e).__name__}: {_one_line(e)}{hint}", file=sys.stderr)
    return EXIT_UNEXPECTED


CONFIG_VERBS = ("train", "validate", "estimate", "plan")  # CONFIG.yaml [overrides]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with ``section.key=value`` overrides also after the options
    (``slidedp plan c.yaml --out p.yaml train.max_steps=5``: argparse takes positionals in one
    run, so it leaves those over)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    late = [a for a in extra if "=" in a and not a.startswith("-")]
    if extra != late or (late and args.verb not in CONFIG_VERBS):  # bench's --set: its own
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prefix = f"slidedp {args.verb}: "
    if args.verb != "bench":  # the bench's workers choose per system (bench.worker)
        prefer_expandable_segments()
    if "RANK" in os.environ and args.verb == "train":  # one rank of several: see runtime.dist
        return _rank(args, prefix)
    try:
        code = _run(args, own_process=argv is None)
    except (KeyboardInterrupt, Exception) as e:
        return _report(e, args, prefix)
    for sig in (signal.SIGINT, signal.SIGTERM) if argv is None else ():
        signal.signal(sig, signal.SIG_IGN)  # done: a late Ctrl-C (a second one after a saved
    return code  # stop) must not turn the exit code into 130 on the interpreter's way out


if __name__ == "__main__":
    sys.exit(main())
