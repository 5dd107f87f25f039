"""Run at the start-up of every Python process whose `PYTHONPATH` holds this folder (only
the children a test gives `mlm_faults.child_env(...)`): inject the faults it names."""

import mlm_faults

mlm_faults.install_from_env()
