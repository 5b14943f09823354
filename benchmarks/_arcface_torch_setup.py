"""The pieces arcface_torch_run.py and arcface_torch_compare.py share: finding and checking a
user's checkout of InsightFace's arcface_torch (recognition/arcface_torch of
github.com/deepinsight/insightface), loading its modules, stand-ins for the optional
packages its imports name but the synthetic-data path never uses, the torch-compatibility
shim it needs on new torch, its config, and the step probe that times train_v2.py.

None of arcface_torch's code is here: it is read from the checkout the user names, unchanged.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import inspect
import os
import subprocess
import sys
import time
import types

import torch

# The commit of github.com/deepinsight/insightface these scripts were written against, and the
# git blob ids of the arcface_torch files its synthetic-data path runs (identical at 0159b24d,
# the last commit that changed recognition/arcface_torch). A checkout whose files have these
# blob ids passes the check whatever its commit.
PINNED_COMMIT = "7fadd420c2351d0ffa8cac403421c1a3ed733365"
PINNED_BLOBS = {
    "train_v2.py": "9563c6533208392ce1a81cbfaae4bcde78ade704",
    "partial_fc_v2.py": "0752554ca1a99c35347dce6cccd121b5cd69f9c6",
    "losses.py": "7d54414c77271dd6455d77b0ab06883d797fcd3a",
    "dataset.py": "6cdbdcf056786c46395cc0dd60a8db0c79bc7f5b",
    "lr_scheduler.py": "6f3cda31d500b54b8a1ad9b36abfeff9cc754ef6",
    "backbones/__init__.py": "b3eaa4945c86efa94fd0cf836cdb053ab7401d64",
    "backbones/iresnet.py": "6f2347c9231b007d0f06f31461c61d1e39418cdd",
    "configs/base.py": "034fe12053bd1fd6f858e5096ec7085d3ffd4e6b",
    "configs/3millions.py": "6bb660bde4590b999bfe1bf9bef8bbf055d65566",
    "utils/utils_config.py": "0c02eaf70fc0140aca7925f621c29a496f491cae",
    "utils/utils_callbacks.py": "d9368073f8bc091b28e7325a9099881dfc5f54cd",
    "utils/utils_logging.py": "c787b6aae7cd037a4718df44d672b8ffa9e5c249",
    "utils/utils_distributed_sampler.py": "cea6703965bff81f8b789ffd933f9b2f889cb680",
}
CHECKOUT_ENV = "SHARDKIT_ARCFACE_TORCH"  # the tests' and scripts' default checkout path
CONFIG_NAME = "shardkit_run"  # the config module registered as configs.<name>
SPEED_CONFIG = "3millions"  # arcface_torch's synthetic-data speed config, the base of ours


class CheckoutError(ValueError):
    """The arcface_torch checkout is missing, incomplete or not the pinned version."""


def find_checkout(path) -> str:
    """The arcface_torch folder from ``path``: that folder, or an insightface checkout's root
    (its recognition/arcface_torch). CheckoutError naming ``--arcface-torch`` otherwise."""
    if not path:
        raise CheckoutError(
            f"argument `--arcface-torch`: give the path of an arcface_torch checkout (or set {CHECKOUT_ENV})"
        )
    path = os.path.abspath(os.path.expanduser(str(path)))
    for cand in (path, os.path.join(path, "recognition", "arcface_torch")):
        if os.path.isfile(os.path.join(cand, "train_v2.py")) and os.path.isfile(os.path.join(cand, "partial_fc_v2.py")):
            return cand
    raise CheckoutError(
        f"argument `--arcface-torch`: {path} holds no train_v2.py and partial_fc_v2.py (neither there nor in "
        "recognition/arcface_torch below it); clone github.com/deepinsight/insightface and check out "
        f"{PINNED_COMMIT}"
    )


def git_blob_id(path: str) -> str:
    """The id git gives the file's content (sha1 of ``blob <size>\\0<bytes>``), no git needed."""
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_pinned(root: str, allow_other: bool = False) -> dict:
    """Compares the checkout's files with the pinned blob ids.

    Returns ``{"pinned_commit", "git_head" (None outside a git work tree), "mismatched":
    [files], "pinned": bool}``. Raises CheckoutError listing the files that differ unless
    ``allow_other`` (then the result records them)."""
    mismatched = []
    for rel, blob in PINNED_BLOBS.items():
        full = os.path.join(root, rel)
        if not os.path.isfile(full) or git_blob_id(full) != blob:
            mismatched.append(rel)
    head = None
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    if mismatched and not allow_other:
        raise CheckoutError(
            f"argument `--arcface-torch`: {root} differs from the pinned arcface_torch (insightface commit "
            f"{PINNED_COMMIT}) in {', '.join(mismatched)}; check that commit out, or pass --allow-unpinned "
            "to run it anyway (recorded in the output)"
        )
    return {"pinned_commit": PINNED_COMMIT, "git_head": head, "mismatched": mismatched, "pinned": not mismatched}


def load_file_module(root: str, rel: str):
    """One module of the checkout by path, under a private name (``_arcface_torch_<stem>``),
    without putting the checkout on sys.path. For the self-contained files (partial_fc_v2.py
    and losses.py import only torch and math)."""
    name = "_arcface_torch_" + rel[:-3].replace("/", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, rel))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---- stand-ins for optional packages (only where they are missing) ----


class _Missing:
    """A name from a package that is not installed: importing it works, using it says why."""

    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} is not installed here; arcface_torch_run.py runs the synthetic-data path, which "
            "does not use it (install it to run other data)"
        )

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")


def _missing_attrs(prefix: str):
    """A module ``__getattr__``: any public name is a :class:`_Missing`; dunder names are
    absent (``inspect`` and others probe ``__file__`` of every module)."""

    def getattr_(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{prefix}.{attr}")

    return getattr_


def make_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.__dict__.update(attrs)
    return module


class _EasyDict(dict):
    """easydict.EasyDict as arcface_torch's configs use it: a dict with attribute access."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        self[key] = value


class _NoSummaryWriter:
    """torch.utils.tensorboard.SummaryWriter without tensorboard: every call does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, attr):
        return lambda *args, **kwargs: None


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install_stubs() -> list:
    """Stand-ins for the packages arcface_torch's modules import at load time but its
    synthetic-data path never calls, for those not installed: easydict (a dict with attribute
    access), mxnet and torchvision (names that raise when used), tensorboard (a SummaryWriter
    that does nothing). Returns the names stood in for."""
    stubbed = []
    if not _installed("easydict"):
        sys.modules["easydict"] = make_module("easydict", EasyDict=_EasyDict)
        stubbed.append("easydict")
    for name in ("mxnet", "torchvision"):
        if not _installed(name):
            missing = make_module(name, __getattr__=_missing_attrs(name))
            missing.__path__ = []  # a package: `from torchvision.datasets import ImageFolder` imports a submodule
            sys.modules[name] = missing
            for sub in ("transforms", "datasets", "recordio", "ndarray", "image"):
                sys.modules[f"{name}.{sub}"] = make_module(f"{name}.{sub}", __getattr__=_missing_attrs(f"{name}.{sub}"))
            stubbed.append(name)
    if not _installed("tensorboard"):
        sys.modules["torch.utils.tensorboard"] = make_module("torch.utils.tensorboard", SummaryWriter=_NoSummaryWriter)
        stubbed.append("tensorboard")
    return stubbed


def stub_verification_if_unloadable() -> list:
    """utils_callbacks imports eval.verification, which needs mxnet, sklearn and scipy at load
    time; with val_targets empty it is never called. Where it cannot load, a stand-in takes
    its place (call with the checkout first on sys.path)."""
    try:
        importlib.import_module("eval.verification")
        return []
    except ImportError:
        sys.modules["eval.verification"] = make_module(
            "eval.verification", __getattr__=_missing_attrs("eval.verification")
        )
        return ["eval.verification"]


def install_torch_compat() -> list:
    """arcface_torch's PolynomialLRWarmup passes ``verbose=`` to the LR scheduler base class,
    which torch removed; where the base lacks it, the base of that class (``_LRScheduler``)
    drops the argument. Returns the shims installed."""
    from torch.optim import lr_scheduler

    base = lr_scheduler.LRScheduler
    if "verbose" in inspect.signature(base.__init__).parameters:
        return []

    def init(self, optimizer, last_epoch=-1, verbose=None):
        base.__init__(self, optimizer, last_epoch)

    lr_scheduler._LRScheduler.__init__ = init
    return ["_LRScheduler(verbose=) accepted and ignored"]


def register_config(overrides: dict) -> str:
    """arcface_torch's speed config (configs/3millions.py, synthetic data) with ``overrides``,
    registered as the module ``configs.shardkit_run``, so that train_v2.py's
    ``get_config("configs/shardkit_run")`` loads it (no file is written into the checkout).
    Returns that config argument. Needs the checkout first on sys.path."""
    speed = importlib.import_module(f"configs.{SPEED_CONFIG}").config
    easydict = importlib.import_module("easydict")
    config = easydict.EasyDict(dict(speed))
    for key, value in overrides.items():
        config[key] = value
    sys.modules[f"configs.{CONFIG_NAME}"] = make_module(f"configs.{CONFIG_NAME}", config=config)
    return f"configs/{CONFIG_NAME}"


# ---- timing train_v2.py's steps from inside its head ----


class StopRun(Exception):
    """Raised from the head's forward once the timed steps are done, to leave train_v2.py."""


class StepProbe:
    """Counts the head's forward calls (one per training step of train_v2.py) and the
    optimizer's steps, and times the steps from call ``warmup + 1`` to the call that stops the
    run (the device synchronized at both ends; train_v2.py's ``loss.item()`` syncs every step
    anyway). The run stops at call ``warmup + steps + 1`` once the optimizer has stepped
    ``min_optimizer_steps`` times (fp16's GradScaler skips the steps whose gradients overflow,
    and a skipped step allocates no optimizer state), or at call ``max_calls``. Records each
    step's loss (a detached tensor; floats at the end)."""

    def __init__(self, warmup: int, steps: int, batch: int, min_optimizer_steps: int = 0, max_calls: int = 0):
        self.warmup, self.steps, self.batch = warmup, steps, batch
        self.min_optimizer_steps = min_optimizer_steps
        self.max_calls = max(max_calls, warmup + steps + 1)
        self.calls, self.optimizer_steps, self.losses = 0, 0, []
        self.t0 = self.t1 = None
        self.head = None  # the head module, from its first forward
        self.optimizer = None  # the optimizer, from its first step (a global step hook)

    def _sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def after_optimizer_step(self, optimizer):
        self.optimizer = optimizer
        self.optimizer_steps += 1

    def before_forward(self):
        self.calls += 1
        if self.calls == self.warmup + 1:
            self._sync()
            self.t0 = time.perf_counter()
        done = self.calls > self.warmup + self.steps and self.optimizer_steps >= self.min_optimizer_steps
        if done or self.calls >= self.max_calls:
            self._sync()
            self.t1 = time.perf_counter()
            raise StopRun

    def result(self) -> dict:
        timed = self.calls - 1 - self.warmup
        seconds = None if self.t0 is None or self.t1 is None or timed < 1 else self.t1 - self.t0
        return {
            "timed_steps": timed if seconds is not None else 0,
            "seconds": seconds,
            "images_per_s": None if not seconds else timed * self.batch / seconds,
            "optimizer_steps": self.optimizer_steps,
            "enough_optimizer_steps": self.optimizer_steps >= self.min_optimizer_steps,
            "losses": [float(v) for v in self.losses],
        }


def probed(head_cls, probe: StepProbe):
    """A subclass of ``head_cls`` whose forward reports to ``probe`` first and keeps the loss."""

    class Probed(head_cls):
        def forward(self, *args, **kwargs):
            probe.head = self
            probe.before_forward()
            loss = super().forward(*args, **kwargs)
            probe.losses.append(loss.detach())
            return loss

    Probed.__name__ = Probed.__qualname__ = head_cls.__name__
    return Probed
