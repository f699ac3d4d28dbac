"""`python -m eecore.cli ...`: the `eecore` command."""
import sys

from eecore.cli import main

sys.exit(main())
