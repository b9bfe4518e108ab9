"""``python -m spmd_runtime ...`` for the CLI fault cases, started after the imports so that the exit time
counts from the moment the CLI reads its (bad) files, as the other cases count from their fault."""
import runpy
import sys

from prelude import fault

fault("the CLI reads its files")
sys.argv[0] = "spmd_runtime"
runpy.run_module("spmd_runtime", run_name="__main__", alter_sys=True)
