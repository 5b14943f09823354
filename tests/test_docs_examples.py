"""Every Python code block of README.md and docs/**/*.md runs here, on the CPU at small
sizes, so an example that no longer matches the API fails the suite.

The convention, for writers of the docs:

- A fenced block whose info string is ``python`` (or ``py``) is an example and runs. Other
  blocks (``bash``, ``console``, ``text``, none) are not run.
- The examples of one file run in order, in one namespace of their own (a later block may use
  what an earlier one defined), in a temporary working directory, with the environment of a
  one-rank ``torchrun`` job (``RANK=0``, ``WORLD_SIZE=1``, ``LOCAL_RANK=0``, ``MASTER_ADDR``,
  a free ``MASTER_PORT``), so a distributed snippet runs as one rank; a process group left
  initialized is destroyed after the file.
- HTML comments right before a block (GitHub and the site do not show them; only blank lines
  or other such comments between) direct it:

  - ``<!-- example-skip: REASON -->``: not run. The reason is required and says what the
    block needs that a CPU test cannot give (e.g. "two CUDA GPUs").
  - ``<!-- example-setup:`` then Python lines, then ``-->``: run first, in the same namespace:
    the model, data and loop pieces a short snippet takes as given.
  - ``<!-- example-replace: {"OLD": "NEW", ...} -->`` (a Python dict literal): text
    substitutions made before the block runs, so the docs show real sizes and devices
    (``2_000_000`` classes, ``"cuda:0"``) while the test runs small ones on the CPU. Each OLD
    must occur in the block: a substitution that no longer applies fails, it does not rot.

  - ``<!-- example-needs-torch: 2.11 -->``: run only with that torch release or a later one
    (the declared range starts at 2.6; FSDP2 on CPUs, for one, needs 2.11); skipped, with
    the reason, before it.

  A directive that is not followed by a Python block, an unknown ``example-*`` directive or a
  skip without a reason fails the test.
"""

import ast
import glob
import os
import re
import socket
import textwrap

import pytest
import torch
import torch.distributed as dist
from conftest import TORCH_VERSION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
)
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_DIRECTIVE = re.compile(r"<!--\s*example-(\w+)\s*:(.*?)-->", re.DOTALL)


class Block:
    def __init__(self, line, lang, code, directives):
        self.line, self.lang, self.code, self.directives = line, lang, code, directives


def parse_blocks(text, name):
    """The fenced blocks of a Markdown text with the ``example-*`` comments right before each;
    raises ValueError for a directive with no Python block after it."""
    lines = text.split("\n")
    blocks, pending, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("<!--"):
            start = i
            while "-->" not in lines[i]:
                i += 1
            comment = "\n".join(lines[start : i + 1])
            for kind, body in _DIRECTIVE.findall(comment):
                pending.append((kind, body, start + 1))
            i += 1
            continue
        m = _FENCE.match(line)
        if m:
            indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
            body, i = [], i + 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
                i += 1
            if pending and lang not in ("python", "py"):
                raise ValueError(
                    f"{name}:{pending[0][2]}: an example-{pending[0][0]} directive before a {lang!r} block"
                )
            blocks.append(Block(i - len(body) + 1, lang, "\n".join(body), pending))
            pending, i = [], i + 1
            continue
        if line.strip() and pending:
            raise ValueError(
                f"{name}:{pending[0][2]}: an example-{pending[0][0]} directive not followed by a code block"
            )
        i += 1
    if pending:
        raise ValueError(f"{name}:{pending[0][2]}: an example-{pending[0][0]} directive at the end of the file")
    return blocks


def prepare(block, name):
    """(setup code, the block's code, skip reason or None), its directives applied."""
    setup, code, skip = [], block.code, None
    for kind, body, line in block.directives:
        where = f"{name}:{line}"
        if kind == "skip":
            skip = body.strip()
            if not skip:
                raise ValueError(f"{where}: example-skip needs a reason")
        elif kind == "setup":
            setup.append(textwrap.dedent(body).strip("\n"))
        elif kind == "replace":
            subs = ast.literal_eval(body.strip())
            if not isinstance(subs, dict) or not subs:
                raise ValueError(f"{where}: example-replace takes a non-empty dict literal, got {body.strip()!r}")
            for old, new in subs.items():
                if old not in code:
                    raise ValueError(f"{where}: example-replace: {old!r} does not occur in the block")
                code = code.replace(old, new)
        elif kind == "needs-torch":
            need = tuple(int(v) for v in body.strip().split("."))
            if TORCH_VERSION < need:
                skip = f"needs torch {body.strip()} or later, this is {torch.__version__}"
        else:
            raise ValueError(f"{where}: unknown directive example-{kind} (skip, setup, replace, needs-torch)")
    return "\n".join(setup), code, skip


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_convention_is_enforced():
    text = 'x\n<!-- example-replace: {"cuda": "cpu"} -->\n```python\na = "cuda"\n```\n'
    (block,) = parse_blocks(text, "t.md")
    assert prepare(block, "t.md") == ("", 'a = "cpu"', None)
    (block,) = parse_blocks('<!-- example-replace: {"gpu": "cpu"} -->\n```python\na = 1\n```\n', "t.md")
    with pytest.raises(ValueError, match="'gpu' does not occur"):
        prepare(block, "t.md")
    (block,) = parse_blocks("<!-- example-skip: -->\n```python\na = 1\n```\n", "t.md")
    with pytest.raises(ValueError, match="needs a reason"):
        prepare(block, "t.md")
    with pytest.raises(ValueError, match="not followed by a code block"):
        parse_blocks("<!-- example-skip: two GPUs -->\nSome text.\n```python\na = 1\n```\n", "t.md")
    with pytest.raises(ValueError, match="before a 'bash' block"):
        parse_blocks("<!-- example-skip: two GPUs -->\n```bash\nls\n```\n", "t.md")
    (block,) = parse_blocks(
        "<!-- example-setup:\nimport math\n-->\n<!-- example-colour: x -->\n```py\nb = 2\n```", "t.md"
    )
    with pytest.raises(ValueError, match="unknown directive example-colour"):
        prepare(block, "t.md")
    (block,) = parse_blocks("<!-- example-setup:\n    import math\n    c = 3\n-->\n\n```python\nb = c\n```\n", "t.md")
    assert prepare(block, "t.md") == ("import math\nc = 3", "b = c", None)
    assert block.line == 7  # the first line of its code in the file, for tracebacks


def test_every_file_has_runnable_examples_or_none():
    # the docs are there and the README has runnable examples
    assert "docs/guides/sharded-loss.md" in FILES
    readme = parse_blocks(open(os.path.join(ROOT, "README.md")).read(), "README.md")
    runnable = [b for b in readme if b.lang in ("python", "py") and prepare(b, "README.md")[2] is None]
    assert len(runnable) >= 4


@pytest.mark.parametrize("name", FILES)
def test_examples_run(name, tmp_path, monkeypatch):
    with open(os.path.join(ROOT, name)) as f:
        blocks = [b for b in parse_blocks(f.read(), name) if b.lang in ("python", "py")]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    namespace = {"__name__": "__docs_example__"}
    try:
        for block in blocks:
            setup, code, skip = prepare(block, name)
            if skip:
                continue
            where = f"{name}:{block.line}"
            try:
                if setup:
                    exec(compile(setup, f"{name} (example-setup before line {block.line})", "exec"), namespace)
                # padded so that a traceback's line numbers are the file's
                exec(compile("\n" * (block.line - 1) + code, name, "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"the example at {where} failed: {type(e).__name__}: {e}") from e
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        torch.set_default_dtype(torch.float32)
