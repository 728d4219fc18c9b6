"""``python -m xfuser_swiftfusion``: the ``swiftfusion`` command (under torchrun too)."""
import sys

from .tools.cli import main

sys.exit(main())
