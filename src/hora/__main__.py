"""``python -m hora``: the same as the ``hora`` command."""

import sys

from hora.cli import main

if __name__ == "__main__":
    sys.exit(main())
