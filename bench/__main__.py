"""`python -m bench ...` from the repository root (`make bench`): see `python -m bench -h`."""
import sys

from .cli import main

sys.exit(main())
