"""Test support shared by tests/ and scripts/fuzz.py, scripts/soak.py.

``reference``: the fp64 reference attention; ``fuzz``: the fuzzing property and its case
generator; ``soak``: the soak run and its pass criteria; ``scripts``: a script of scripts/
loaded as a module. Nothing here imports the kernels or
strategies under test into ``reference``.
"""
