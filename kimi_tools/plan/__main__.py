"""``python -m kimi_tools.plan --write-docs``: regenerate ``docs/scaling.md``'s section 7."""

import sys

from kimi.checkpoint import write_atomic
from kimi_tools.plan.docs import DOC, splice_docs

if sys.argv[1:] != ["--write-docs"]:
    sys.exit("usage: python -m kimi_tools.plan --write-docs   (regenerates docs/scaling.md section 7)")
write_atomic(DOC, splice_docs(DOC.read_text()).encode())
