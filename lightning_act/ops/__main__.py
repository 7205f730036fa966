"""``python -m lightning_act.ops --build {cpu,cuda}``: builds one device type's kernels."""

import sys

from lightning_act.ops.extension import main

sys.exit(main())
