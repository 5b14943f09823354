"""The API reference (docs/api/) covers every public name: each name of ``shardkit.__all__``
has its own ``::: shardkit.NAME`` entry, and each public submodule (``shardkit.parallel``,
``.distributed``, ``.plan``, ``.ops``) is rendered whole, which mkdocstrings does from its
``__all__``. Read from the source, as the site is: no import of the package needed."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBMODULES = {"parallel", "distributed", "plan", "ops"}


def _all(path):
    tree = ast.parse(open(os.path.join(ROOT, "python", "shardkit", path)).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} has no __all__")


def _directives(page):
    text = open(os.path.join(ROOT, "docs", "api", page)).read()
    return re.findall(r"^::: (\S+)((?:\n    .*)*)", text, re.M)


def test_every_top_level_name_has_an_entry():
    names = _all("__init__.py")
    assert SUBMODULES <= set(names)
    documented = {target for target, _ in _directives("shardkit.md")}
    missing = [n for n in names if n not in SUBMODULES and f"shardkit.{n}" not in documented]
    assert not missing, f"public names without an entry in docs/api/shardkit.md: {missing}"


def test_every_public_submodule_is_rendered_whole():
    for sub in sorted(SUBMODULES):
        found = _directives(f"{sub}.md")
        assert [t for t, _ in found] == [f"shardkit.{sub}"], f"docs/api/{sub}.md: {found}"
        options = found[0][1]
        assert "members:" not in options, f"docs/api/{sub}.md lists members: a name added to __all__ would be missed"
        module = f"{sub}/__init__.py" if os.path.isdir(os.path.join(ROOT, "python", "shardkit", sub)) else f"{sub}.py"
        assert _all(module), module
