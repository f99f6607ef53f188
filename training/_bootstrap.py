"""Imported by a file of `training/` that is run as a script (`python training/run_trainer.py`, or `accelerate launch
training/run_trainer.py`, which runs it so): the script's folder is then `sys.path[0]`, and the repository root is not
on the path. This registers that folder as the package `training`, found by its location, so that the script's
`training.*` imports resolve as they do under `python -m training.<name>`, without editing `sys.path`; `jetspec` and
`modeling_jetspec` come from the installed package (`pip install -e .` installs this checkout).
"""

import importlib.util
import sys
from pathlib import Path

if "training" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("training", Path(__file__).with_name("__init__.py"))
    sys.modules["training"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["training"])
