"""``python -m gemma4_mlx``: the generate command line (see gemma4_mlx/cli.py)."""

import sys

from .cli import main

sys.exit(main())
