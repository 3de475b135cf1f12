"""MkDocs hook (mkdocs.yml `hooks:`): the formulas become MathML when the site is built, so a page shows
them without JavaScript or a network (no MathJax from a CDN); browsers render MathML Core natively.

pymdownx.arithmatex (`generic: true`) leaves `<span class="arithmatex">\\(...\\)</span>` for inline maths
and `<div class="arithmatex">\\[...\\]</div>` for display maths (`$$ ... $$` in the Markdown);
latex2mathml turns each TeX source into a `<math>` element. A command latex2mathml does not know comes
out as text (`<mi>\\foo</mi>`), so a backslash left in the MathML fails the build, naming the page.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

ARITHMATEX = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">\s*'
    r"(?:\\\((?P<inline>.*?)\\\)|\\\[(?P<block>.*?)\\\])"
    r"\s*</(?P=tag)>",
    re.DOTALL,
)
TEXT_WITH_BACKSLASH = re.compile(r">[^<]*\\[^<]*<")


def mathml(tex: str, display: str, where: str) -> str:
    """The `<math>` element for one formula's TeX (HTML-escaped as arithmatex writes it)."""
    source = html.unescape(tex)  # not stripped: a trailing `\ ` is a TeX space
    try:
        out = convert(source, display=display)
    except Exception as error:  # latex2mathml raises its own exception types, one per syntax error
        raise ValueError(f"{where}: latex2mathml cannot convert {source!r}: {error!r}") from error
    if TEXT_WITH_BACKSLASH.search(out):
        raise ValueError(f"{where}: latex2mathml left a TeX command unconverted in {source!r}: {out}")
    return out


def on_page_content(html_text: str, page, **kwargs) -> str:
    where = page.file.src_uri

    def replace(match: re.Match) -> str:
        if match.group("inline") is not None:
            return mathml(match.group("inline"), "inline", where)
        return mathml(match.group("block"), "block", where)

    return ARITHMATEX.sub(replace, html_text)
