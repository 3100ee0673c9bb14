"""`python -m funcmla` is the `funcmla` command."""

import sys

from funcmla.cli import main

sys.exit(main())
