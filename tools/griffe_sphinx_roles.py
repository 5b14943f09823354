"""A griffe extension for the documentation site (mkdocs.yml loads it): turns the Sphinx
roles of shardkit's docstrings (``:class:`shardkit.CosFace```, ``:func:`~shardkit.ops.ema_update_```)
into links to the API reference where the target is documented there, and into plain code
where it is not (a private module), so the site builds under ``mkdocs build --strict``
without every docstring being rewritten for Markdown."""

import re

import griffe

# :role:`target`, :role:`~target` (show the last name only) and :role:`title <target>`.
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):`(~?)([^`<]*?)(?:\s*<([^`>]+)>)?`")


def _autoref(match: re.Match) -> str:
    short, text, target = match.group(1), match.group(2).strip(), match.group(3)
    identifier = (target or text).strip().rstrip("()")
    title = text if target else (identifier.rsplit(".", 1)[-1] if short else text)
    # "optional": an identifier the site does not document renders as plain code, no warning
    return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = _ROLE.sub(_autoref, obj.docstring.value)
