"""`python -m pyk8sres ...` is the `pyk8sres` command."""
import sys

from .cli import main

sys.exit(main())
