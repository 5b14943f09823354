"""The three command lines (python -m shardkit.info / plan / train): an unknown argument is one
line on stderr and exit status 2, --help works, and a reader that leaves (``| head``) is not an
error: no BrokenPipeError traceback, the same exit status, and a training run goes on (its
output is in log.txt)."""

import os
import subprocess
import sys

import pytest

import shardkit
from shardkit import info

TINY = "--classes 16 --per-class 8 --image-size 16 --batch 32 --val-classes 4 --val-per-class 3 --dim 16".split()
TINY += ["--steps", "1", "--no-progress", "--devices", "cpu"]


def _env():
    here = os.path.dirname(os.path.dirname(os.path.abspath(shardkit.__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))


def _run_with_reader_gone(args):
    """Runs ``python -m args`` with its stdout a pipe whose reader left before the first line."""
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    proc.stdout.close()  # long before the interpreter has imported torch and printed anything
    err = proc.stderr.read().decode()
    return proc.wait(timeout=300), err


@pytest.mark.parametrize("argv", [["--bogus"], ["extra"], ["--json"]])
def test_info_refuses_unknown_arguments_in_one_line(capsys, argv):
    with pytest.raises(SystemExit) as e:
        info.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m shardkit.info: error: unrecognized arguments: ") and err.count("\n") == 1, err


def test_info_help(capsys):
    with pytest.raises(SystemExit) as e:
        info.main(["--help"])
    assert e.value.code == 0 and "usage: python -m shardkit.info" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        ["shardkit.info"],
        ["shardkit.plan", "--classes", "1000", "--dim", "8", "--batch", "4"],
        ["shardkit.train", "--help"],
    ],
)
def test_a_reader_that_leaves_is_not_an_error(args):
    want = subprocess.run([sys.executable, "-m", *args], capture_output=True, env=_env(), timeout=300).returncode
    code, err = _run_with_reader_gone(args)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert code == want


def test_a_training_run_goes_on_when_its_reader_leaves(tmp_path):
    code, err = _run_with_reader_gone(["shardkit.train", *TINY, "--out", str(tmp_path)])
    assert code == 0 and "Traceback" not in err, err
    assert (tmp_path / "checkpoint" / "checkpoint.pt").is_file()
    assert "results" in (tmp_path / "log.txt").read_text()
