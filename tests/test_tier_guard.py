"""The guard of the fast tier (tests/tier_guard.py): a test that trains without the ``e2e``
marker fails with one line naming the fix, even where the code under test swallowed the error;
a marked one trains; a unit test's other child processes run."""

from __future__ import annotations

import sys

import pytest

from tier_guard import trains

INNER = """
import subprocess
import sys

import pytest

from slidedp.runtime.trainer import Trainer


@pytest.fixture(scope="module")
def trained():
    Trainer.run(None)


def test_swallowed():
    try:
        Trainer.run(None)
    except Exception:
        pass  # as a CLI that turns every error into exit code 2


def test_a_child_that_trains():
    subprocess.run([sys.executable, "-m", "slidedp", "train", "run.yaml"], check=False)


def test_a_module_fixture_that_trains(trained):
    pass


@pytest.mark.e2e
def test_marked():
    with pytest.raises(AttributeError):  # the real Trainer.run, given no trainer
        Trainer.run(None)


@pytest.mark.gpu
def test_on_a_gpu():  # GPU tests are a tier of their own, never in the fast one
    with pytest.raises(AttributeError):
        Trainer.run(None)


def test_a_child_that_does_not_train():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def test_an_unmarked_training_fails_and_a_marked_one_runs(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmarkers =\n    e2e: end to end\n    gpu: on a GPU\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "tier_guard", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, failed=1, errors=4)
    result.stdout.fnmatch_lines_random(
        [
            "*test_swallowed started Trainer.run without @pytest.mark.e2e: mark it*",
            "*test_a_child_that_trains started slidedp train without @pytest.mark.e2e*",
            "*test_a_module_fixture_that_trains runs Trainer.run without @pytest.mark.e2e*",
        ]
    )
    assert "test_marked started" not in result.stdout.str()
    assert "test_on_a_gpu started" not in result.stdout.str()
    assert "test_a_child_that_does_not_train started" not in result.stdout.str()


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        ([sys.executable, "-m", "slidedp", "train", "c.yaml"], "slidedp train"),
        (["python", "-m", "slidedp", "bench", "train"], "slidedp bench"),
        (["python", "-m", "slidedp.bench.worker", "s", "r"], "python -m slidedp.bench.worker"),
        (["python", "-m", "slidedp.autopolicy.measure"], "python -m slidedp.autopolicy.measure"),
        (["python", "scripts/loss_golden.py", "--check"], "scripts/loss_golden.py"),
        (["python", "-m", "slidedp", "validate", "c.yaml"], None),
        (["python", "-m", "slidedp"], None),
        (["python", "-c", "import slidedp"], None),
        (["cargo", "test"], None),
    ],
)  # fmt: skip
def test_what_counts_as_a_training_child(argv: list[str], what: str | None) -> None:
    assert trains(argv) == what
