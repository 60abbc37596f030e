"""MkDocs hooks for the documentation site (mkdocs.yml names this file).

hora's docstrings cross-reference with Sphinx roles (``:func:`hora.init```), which read well in
``help()`` and in the source; Markdown renders the role's name as stray text before the code span,
so the API pages drop it and keep the code span.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):(<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(r"\1", html)
