import os
import sys

# the shared test tables (op_cases, mesh_cases) live beside this file
sys.path.insert(0, os.path.dirname(__file__))
